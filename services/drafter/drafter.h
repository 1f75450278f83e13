// SPDX-License-Identifier: MIT
// The drafter's role logic: a small draft model proposing tokens for speculative decoding
// (next). Today it checks its draft model and reports whether drafting is available.
#ifndef MM_DRAFTER_H
#define MM_DRAFTER_H

#include "mm/daemon.h"

extern mm_opt drafter_opts[]; // --draft-model

// drafter_start checks --draft-model (a directory with config.json) when given.
// Errors: MM_ENOENT naming the path.
mm_err drafter_start(mm_daemon *d, void *arg, char err[MM_ERRLEN]);
void drafter_stop(mm_daemon *d, void *arg);

#endif

// SPDX-License-Identifier: MIT
// The expert owner's role logic: which experts it holds, and (next) their FFNs on the rows it
// receives. Today it works out its share of the experts and reports it in its heartbeat.
#ifndef MM_EXPERT_H
#define MM_EXPERT_H

#include "mm/daemon.h"

// expert_start reads --model's config.json for the expert count and takes this owner's share
// (uniform placement: contiguous ranges by --instance over --owners). Errors: MM_EINVAL
// (--instance not below --owners, no expert count in config.json), MM_ENOENT.
mm_err expert_start(mm_daemon *d, void *arg, char err[MM_ERRLEN]);
void expert_stop(mm_daemon *d, void *arg);

#endif

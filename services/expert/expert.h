// SPDX-License-Identifier: MIT
// The expert owner's role logic: the (layer, expert) pairs its placement names (--placement, or
// uniform over --owners: expert e on owner e % N), their FFNs on the rows the router sends on
// --data (docs/MESH.md: a CTRL frame of (expert, n_rows) segments then one ROWS frame, answered
// by one REPLY in the same order; rows for an expert it does not hold get an MM_WIRE_ERROR
// naming it), and per-(layer, expert) token counts exported to --load-csv.
#ifndef MM_EXPERT_H
#define MM_EXPERT_H

#include "mm/daemon.h"

extern mm_opt expert_opts[]; // --max-batch-tokens --threads --load-csv --load-interval-ms

// expert_start reads the placement, opens the model (mmap: only the experts it runs are paged
// in) and starts the data server. Errors: MM_EINVAL (--instance not below --owners, a bad
// placement), the model's and the transport's errors.
mm_err expert_start(mm_daemon *d, void *arg, char err[MM_ERRLEN]);
void expert_stop(mm_daemon *d, void *arg);

#endif

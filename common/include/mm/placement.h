// SPDX-License-Identifier: MIT
// Expert placement: which expert owner holds which routed expert of which layer (an expert may
// sit on several owners: replicas). docs/MESH.md gives the JSON form:
//   {"version":1, "n_layers":L, "n_experts":E, "n_owners":N,
//    "experts": [[[owner, ...] per expert] per layer]}     (dense layers: [])
// Its canonical text hashes into the placement fingerprint (mm/identity.h); with no file the
// mesh uses the uniform placement (expert e of every MoE layer on owner e % N).
//
// Design notes: an mm_placement is immutable after it is built and may be shared by threads.
// Replica lists keep the file's order; the router serves an expert from the first live owner
// of its list.
#ifndef MM_PLACEMENT_H
#define MM_PLACEMENT_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "mm/err.h"
#include "mm/model.h"

#define MM_PLACEMENT_MAX_OWNERS 256

typedef struct mm_placement {
    int n_layers, n_experts, n_owners;
    bool *moe;        // (n_layers) layer has routed experts
    uint8_t *n_rep;   // (n_layers, n_experts) owners holding the expert
    uint16_t *owner;  // (n_layers, n_experts, n_owners) the owners, in list order
} mm_placement;

// mm_placement_uniform builds the uniform placement of cfg's model over n_owners.
// Returns owned *out (mm_placement_free). Errors: MM_EINVAL (n_owners out of 1..256, a dense
// model), MM_ENOMEM.
mm_err mm_placement_uniform(mm_placement **out, const mm_model_config *cfg, int n_owners,
                            char err[MM_ERRLEN]);

// mm_placement_balanced spreads each layer's experts over n_owners by their measured load
// (load_csv: "layer,expert,tokens" lines as expert owners export them; a header line is
// allowed, also between concatenated files; missing experts count 0): heaviest first onto the least-loaded owner. Then the
// replicate_hot heaviest experts of each layer get one more replica on the least-loaded owner
// that lacks them (their load split between the copies). Errors: MM_ENOENT, MM_EFORMAT (bad
// CSV line, named), MM_EINVAL.
mm_err mm_placement_balanced(mm_placement **out, const mm_model_config *cfg, int n_owners,
                             const char *load_csv, int replicate_hot, char err[MM_ERRLEN]);

// mm_placement_load reads a placement file and checks it against cfg (layer and expert
// counts, MoE layers, owner ids below n_owners, every expert of an MoE layer placed, no owner
// twice in a list). n_owners_expect > 0 also requires that owner count. Errors: MM_ENOENT,
// MM_EFORMAT / MM_EINVAL naming the file and the entry.
mm_err mm_placement_load(mm_placement **out, const char *path, const mm_model_config *cfg,
                         int n_owners_expect, char err[MM_ERRLEN]);

// mm_placement_open: mm_placement_load when path is set, else mm_placement_uniform.
mm_err mm_placement_open(mm_placement **out, const char *path, const mm_model_config *cfg,
                         int n_owners, char err[MM_ERRLEN]);

// mm_placement_write writes p as JSON (one line per layer) to f. Errors: MM_ESYS.
mm_err mm_placement_write(const mm_placement *p, FILE *f, char err[MM_ERRLEN]);

void mm_placement_free(mm_placement *p); // accepts NULL

// Accessors. r < mm_placement_n_rep(p, layer, expert).
static inline int mm_placement_n_rep(const mm_placement *p, int layer, int expert) {
    return p->n_rep[(size_t)layer * (size_t)p->n_experts + (size_t)expert];
}
static inline int mm_placement_owner(const mm_placement *p, int layer, int expert, int r) {
    return p->owner[((size_t)layer * (size_t)p->n_experts + (size_t)expert) *
                        (size_t)p->n_owners + (size_t)r];
}
// mm_placement_owns: does owner hold (layer, expert)?
bool mm_placement_owns(const mm_placement *p, int layer, int expert, int owner);
// mm_placement_count: how many (layer, expert) pairs owner holds.
long mm_placement_count(const mm_placement *p, int owner);

#endif

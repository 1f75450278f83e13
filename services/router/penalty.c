// SPDX-License-Identifier: MIT
// Per-sequence penalty counts (see penalty.h).
#include "penalty.h"

#include <stdlib.h>
#include <string.h>

struct mm_pen_slot {
    bool used;
    uint64_t seq_id;
    int64_t len;         // positions covered
    mm_tok_count *ent;   // (max_ctx) distinct tokens
    int32_t *index;      // (cap) entry of a hash bucket, -1: empty
    mm_penalty_hist hist;
    const mm_pen_table *t;
};

struct mm_pen_table {
    int n_slots, max_ctx;
    uint32_t cap; // power of two >= 2 * max_ctx
    mm_pen_slot *slots;
};

mm_err mm_pen_table_new(mm_pen_table **out, int n_slots, int max_ctx) {
    *out = NULL;
    if (n_slots <= 0 || max_ctx <= 0)
        return MM_EINVAL;
    mm_pen_table *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return MM_ENOMEM;
    t->n_slots = n_slots;
    t->max_ctx = max_ctx;
    t->cap = 16;
    while (t->cap < 2u * (uint32_t)max_ctx)
        t->cap <<= 1;
    t->slots = calloc((size_t)n_slots, sizeof(*t->slots));
    if (t->slots == NULL) {
        free(t);
        return MM_ENOMEM;
    }
    for (int i = 0; i < n_slots; i++)
        t->slots[i].t = t;
    *out = t;
    return MM_OK;
}

void mm_pen_table_free(mm_pen_table *t) {
    if (t == NULL)
        return;
    for (int i = 0; i < t->n_slots; i++) {
        free(t->slots[i].ent);
        free(t->slots[i].index);
    }
    free(t->slots);
    free(t);
}

mm_err mm_pen_table_get(mm_pen_table *t, uint64_t seq_id, mm_pen_slot **out,
                        char err[MM_ERRLEN]) {
    mm_pen_slot *free_slot = NULL;
    for (int i = 0; i < t->n_slots; i++) {
        mm_pen_slot *s = &t->slots[i];
        if (s->used && s->seq_id == seq_id) {
            *out = s;
            return MM_OK;
        }
        if (!s->used && free_slot == NULL)
            free_slot = s;
    }
    if (free_slot != NULL && free_slot->ent == NULL) { // first use of this slot: kept after
        free_slot->ent = malloc((size_t)t->max_ctx * sizeof(*free_slot->ent));
        free_slot->index = malloc((size_t)t->cap * sizeof(*free_slot->index));
        if (free_slot->ent == NULL || free_slot->index == NULL) {
            free(free_slot->ent);
            free(free_slot->index);
            free_slot->ent = NULL;
            free_slot->index = NULL;
            return mm_errf(err, MM_ENOMEM, "seq %llu: no memory for penalty counts",
                           (unsigned long long)seq_id);
        }
        memset(free_slot->index, 0xff, (size_t)t->cap * sizeof(*free_slot->index));
        free_slot->hist.tok = free_slot->ent;
    }
    if (free_slot == NULL)
        return mm_errf(err, MM_EFULL, "seq %llu: %d sequences with penalties are running; this "
                       "router keeps counts for at most %d", (unsigned long long)seq_id,
                       t->n_slots, t->n_slots);
    free_slot->used = true;
    free_slot->seq_id = seq_id;
    free_slot->len = 0;
    free_slot->hist.n = 0;
    *out = free_slot;
    return MM_OK;
}

void mm_pen_table_release(mm_pen_table *t, uint64_t seq_id) {
    for (int i = 0; i < t->n_slots; i++) {
        mm_pen_slot *s = &t->slots[i];
        if (s->used && s->seq_id == seq_id) {
            memset(s->index, 0xff, (size_t)t->cap * sizeof(*s->index));
            s->used = false;
            s->hist.n = 0;
            s->len = 0;
        }
    }
}

static mm_err count(mm_pen_slot *s, int32_t token, bool output, char err[MM_ERRLEN]) {
    const uint32_t mask = s->t->cap - 1;
    uint32_t h = ((uint32_t)token * 2654435761u) & mask;
    while (s->index[h] >= 0 && s->ent[s->index[h]].token != token)
        h = (h + 1) & mask;
    if (s->index[h] < 0) {
        if (s->hist.n >= (uint32_t)s->t->max_ctx)
            return mm_errf(err, MM_EFULL, "seq %llu: penalty history past %d tokens",
                           (unsigned long long)s->seq_id, s->t->max_ctx);
        s->index[h] = (int32_t)s->hist.n;
        s->ent[s->hist.n++] = (mm_tok_count){.token = token};
    }
    mm_tok_count *c = &s->ent[s->index[h]];
    if (output)
        c->output++;
    else
        c->prompt++;
    return MM_OK;
}

mm_err mm_pen_slot_feed(mm_pen_slot *s, int64_t pos, const int32_t *tokens, uint32_t n,
                        char err[MM_ERRLEN]) {
    if (pos > s->len)
        return mm_errf(err, MM_EINVAL, "seq %llu: tokens at position %lld but its penalty "
                       "history covers %lld", (unsigned long long)s->seq_id, (long long)pos,
                       (long long)s->len);
    for (uint32_t i = 0; i < n; i++)
        if (pos + i >= s->len) {
            MM_TRY(count(s, tokens[i], false, err));
            s->len = pos + i + 1;
        }
    return MM_OK;
}

mm_err mm_pen_slot_sampled(mm_pen_slot *s, int64_t pos, int32_t token, char err[MM_ERRLEN]) {
    if (pos != s->len)
        return mm_errf(err, MM_EINVAL, "seq %llu: token sampled for position %lld but its "
                       "penalty history covers %lld", (unsigned long long)s->seq_id,
                       (long long)pos, (long long)s->len);
    MM_TRY(count(s, token, true, err));
    s->len = pos + 1;
    return MM_OK;
}

const mm_penalty_hist *mm_pen_slot_hist(const mm_pen_slot *s) {
    return &s->hist;
}

// SPDX-License-Identifier: MIT
// StepPlan builder and StepResult reader (see mm/step.h).
#include "mm/step.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct mm_step_builder {
    uint32_t max_seqs, max_release;
    mm_ctl_msg env;
    Mmctl__StepPlan plan;
    Mmctl__SeqStep *seqs;       // (max_seqs)
    Mmctl__SeqStep **seq_ptrs;  // (max_seqs)
    Mmctl__Sampling *sampling;  // (max_seqs)
    uint64_t *release;          // (max_release)
};

mm_err mm_step_builder_new(mm_step_builder **out, uint32_t max_seqs, uint32_t max_release) {
    *out = NULL;
    if (max_seqs == 0)
        return MM_EINVAL;
    mm_step_builder *b = calloc(1, sizeof(*b));
    if (b == NULL)
        return MM_ENOMEM;
    b->max_seqs = max_seqs;
    b->max_release = max_release;
    b->seqs = calloc(max_seqs, sizeof(*b->seqs));
    b->seq_ptrs = calloc(max_seqs, sizeof(*b->seq_ptrs));
    b->sampling = calloc(max_seqs, sizeof(*b->sampling));
    b->release = calloc(max_release ? max_release : 1, sizeof(*b->release));
    if (!b->seqs || !b->seq_ptrs || !b->sampling || !b->release) {
        mm_step_builder_free(b);
        return MM_ENOMEM;
    }
    mm_step_builder_reset(b, 0);
    *out = b;
    return MM_OK;
}

void mm_step_builder_free(mm_step_builder *b) {
    if (b == NULL)
        return;
    free(b->seqs);
    free(b->seq_ptrs);
    free(b->sampling);
    free(b->release);
    free(b);
}

void mm_step_builder_reset(mm_step_builder *b, uint64_t step_id) {
    mmctl__envelope__init(&b->env);
    mmctl__step_plan__init(&b->plan);
    b->plan.step_id = step_id;
    b->plan.seqs = b->seq_ptrs;
    b->plan.release = b->release;
    b->env.body_case = MMCTL__ENVELOPE__BODY_STEP_PLAN;
    b->env.step_plan = &b->plan;
}

// add: appends a seq (tokens may be empty only for a follow entry).
static mm_err add(mm_step_builder *b, uint64_t seq_id, uint32_t pos, const int32_t *tokens,
                  uint32_t n, bool sample, const mm_sampling *sp, uint32_t n_top) {
    if (b->plan.n_seqs >= b->max_seqs)
        return MM_EFULL;
    size_t i = b->plan.n_seqs++;
    Mmctl__SeqStep *q = &b->seqs[i];
    mmctl__seq_step__init(q);
    q->seq_id = seq_id;
    q->pos = pos;
    q->tokens = (int32_t *)tokens;
    q->n_tokens = n;
    q->sample = sample;
    q->logprobs = n_top;
    if (sp != NULL) {
        Mmctl__Sampling *s = &b->sampling[i];
        mmctl__sampling__init(s);
        s->temperature = sp->temperature;
        s->top_p = sp->top_p;
        s->top_k = sp->top_k;
        s->min_p = sp->min_p;
        s->seed = sp->seed;
        s->presence_penalty = sp->presence_penalty;
        s->frequency_penalty = sp->frequency_penalty;
        s->repetition_penalty = sp->repetition_penalty;
        q->sampling = s;
    }
    b->seq_ptrs[i] = q;
    return MM_OK;
}

mm_err mm_step_builder_add(mm_step_builder *b, uint64_t seq_id, uint32_t pos,
                           const int32_t *tokens, uint32_t n, bool sample, const mm_sampling *sp,
                           uint32_t n_top) {
    if (n == 0 || tokens == NULL)
        return MM_EINVAL;
    return add(b, seq_id, pos, tokens, n, sample, sp, n_top);
}

mm_err mm_step_builder_add_follow(mm_step_builder *b, uint64_t seq_id, uint32_t end_pos,
                                  const mm_sampling *sp, uint32_t n_top) {
    MM_TRY(add(b, seq_id, 0, NULL, 0, true, sp, n_top));
    Mmctl__SeqStep *q = &b->seqs[b->plan.n_seqs - 1];
    q->follow = true;
    q->end_pos = end_pos;
    return MM_OK;
}

void mm_step_builder_set_after(mm_step_builder *b, uint64_t after_step) {
    b->plan.after_step = after_step;
}

void mm_step_builder_set_no_logprob(mm_step_builder *b) {
    if (b->plan.n_seqs > 0)
        b->seqs[b->plan.n_seqs - 1].no_logprob = true;
}

void mm_step_builder_set_draft(mm_step_builder *b, uint32_t max_draft) {
    if (b->plan.n_seqs > 0)
        b->seqs[b->plan.n_seqs - 1].max_draft = max_draft;
}

mm_err mm_step_builder_release(mm_step_builder *b, uint64_t seq_id) {
    if (b->plan.n_release >= b->max_release)
        return MM_EFULL;
    b->release[b->plan.n_release++] = seq_id;
    return MM_OK;
}

mm_ctl_msg *mm_step_builder_env(mm_step_builder *b) { return &b->env; }

uint32_t mm_step_builder_n_seqs(const mm_step_builder *b) { return (uint32_t)b->plan.n_seqs; }

mm_err mm_step_result_check(const mm_ctl_msg *reply, uint64_t step_id, uint32_t n_seqs,
                            const Mmctl__StepResult **res, char err[MM_ERRLEN]) {
    *res = NULL;
    if (reply->body_case == MMCTL__ENVELOPE__BODY_ACK && reply->ack && !reply->ack->ok)
        return mm_errf(err, MM_EPROTO, "router refused the step plan: %s", reply->ack->error);
    if (reply->body_case != MMCTL__ENVELOPE__BODY_STEP_RESULT)
        return mm_errf(err, MM_EPROTO, "reply to step %llu is %s, not step_result",
                       (unsigned long long)step_id, mm_ctl_body_name(reply));
    const Mmctl__StepResult *r = reply->step_result;
    if (r->step_id != step_id)
        return mm_errf(err, MM_EPROTO, "step_result for step %llu, expected %llu",
                       (unsigned long long)r->step_id, (unsigned long long)step_id);
    if (r->error_code != 0)
        return mm_errf(err, (mm_err)r->error_code, "step %llu failed: %s",
                       (unsigned long long)step_id, r->error);
    if (r->n_results != n_seqs)
        return mm_errf(err, MM_EPROTO, "step %llu: %zu results for %u seqs",
                       (unsigned long long)step_id, r->n_results, n_seqs);
    *res = r;
    return MM_OK;
}

void mm_step_sampling_from_pb(const Mmctl__Sampling *pb, mm_sampling *sp) {
    memset(sp, 0, sizeof(*sp));
    if (pb == NULL)
        return;
    sp->temperature = pb->temperature;
    sp->top_p = pb->top_p;
    sp->top_k = pb->top_k;
    sp->min_p = pb->min_p;
    sp->seed = pb->seed;
    sp->presence_penalty = pb->presence_penalty;
    sp->frequency_penalty = pb->frequency_penalty;
    sp->repetition_penalty = pb->repetition_penalty;
}

int mm_step_logprob_line(char *buf, size_t cap, int32_t token, float logprob, uint32_t n_top,
                         const int32_t *top_ids, const float *top_logprobs) {
    int n = snprintf(buf, cap, "%d %.9g", token, (double)logprob);
    for (uint32_t i = 0; i < n_top && n >= 0 && (size_t)n < cap; i++)
        n += snprintf(buf + n, cap - (size_t)n, "%s%d:%.9g", i == 0 ? " top=" : ",", top_ids[i],
                      (double)top_logprobs[i]);
    return n < 0 ? 0 : ((size_t)n >= cap ? (int)cap - 1 : n);
}

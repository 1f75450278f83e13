// SPDX-License-Identifier: MIT
// A daemon's bootstrap identity: what it is (role, instance, addresses) and what it serves
// (protocol version, build id, model fingerprint, placement fingerprint). Daemons mesh only when
// the last four agree (DESIGN.md invariant 4); mm_identity_check names the first that differs.
#ifndef MM_IDENTITY_H
#define MM_IDENTITY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mm/err.h"

#define MM_FP_LEN 48     // fingerprint strings, NUL included ("sha256:" + 16 hex, or "none")
#define MM_ADDR_LEN 256  // control/data URLs
#define MM_ROLE_LEN 16

// The roles of the mesh, in the order status listings use.
#define MM_N_ROLES 5
extern const char *const mm_roles[MM_N_ROLES]; // gateway router attention expert drafter

// An attention shard's KV capacity, stated in its Hello (Identity fields 14-19) so that the
// gateway admits by what the shards really hold. All 0: not reported (another role, a shard
// without --model; a daemon of another build is refused at join anyway).
typedef struct mm_kv_capacity {
    uint32_t block_size;   // tokens per KV block
    uint64_t blocks;       // KV blocks of the cache
    uint32_t token_bytes;  // bytes one token takes (all layers, K and V)
    uint64_t budget_bytes; // the byte budget the blocks were carved from (--kv-mb)
    uint32_t max_seqs;     // sequences held at once
    uint32_t max_ctx;      // longest sequence one slot holds
} mm_kv_capacity;

typedef struct mm_identity {
    uint32_t protocol_version;          // MM_CTL_PROTOCOL_VERSION
    char build_id[64];                  // mm_build_id()
    char model_fp[MM_FP_LEN];           // mm_identity_model_fingerprint
    char placement_fp[MM_FP_LEN];       // mm_identity_placement_fingerprint
    char role[MM_ROLE_LEN];             // one of mm_roles
    uint32_t instance;
    char control_addr[MM_ADDR_LEN];     // --listen
    char data_addr[MM_ADDR_LEN];        // --data, "" when unused
    uint64_t incarnation;               // random per process start
    uint32_t pid;
    char host[64];
    char device[32];                    // --device
    uint32_t heartbeat_ms;
    char numerics[32];                  // mm_identity_numerics: "" on the CPU
    mm_kv_capacity kv;                  // attention shards (mm_daemon_set_kv_capacity)
} mm_identity;

// mm_role_index returns the position of role in mm_roles, or -1 when it is not a role.
int mm_role_index(const char *role);

// mm_identity_model_fingerprint hashes (SHA-256, first 64 bits as 16 hex digits, prefixed
// "sha256:") config.json and the header (8-byte length + JSON) of every *.safetensors file in
// model_dir, in file-name order; not the weights, so it is quick on any model size. NULL or ""
// gives "none". Errors: MM_ENOENT (no directory or no config.json), MM_EFORMAT (a safetensors
// header that is truncated or absurdly long), MM_ESYS. Blocks on file reads.
mm_err mm_identity_model_fingerprint(const char *model_dir, char out[MM_FP_LEN],
                                     char err[MM_ERRLEN]);

// mm_identity_placement_fingerprint hashes the canonical form (sorted keys, compact) of the
// placement JSON file, so that whitespace and key order do not matter; with no file (NULL or "")
// it hashes "uniform:<n_owners>". Errors: MM_ENOENT, MM_EFORMAT (not JSON), MM_EINVAL.
mm_err mm_identity_placement_fingerprint(const char *placement_file, long long n_owners,
                                         char out[MM_FP_LEN], char err[MM_ERRLEN]);

// mm_identity_numerics writes into out (n bytes) the settings of a daemon on device that change
// its kernels' bits and so must agree across a mesh on GPUs: on cuda:N "attention=tc" (the
// tensor-core attention contract, the default) or "attention=f32" (MM_GPU_ATT_TC=0); on hip:N
// "attention=f32"; "" on the CPU (and for no device), where nothing is switchable.
void mm_identity_numerics(const char *device, char *out, size_t n);

// mm_identity_check compares the fields that must agree for two daemons to mesh: protocol
// version, build id, model fingerprint, placement fingerprint (in that order), then the
// numerics when both daemons declare them (two GPU daemons). Returns MM_OK, or
// MM_EIDENTITY with *field naming the first difference and ours_val/theirs_val (buffers of
// MM_ADDR_LEN) holding both values as text. Pure; thread-safe.
mm_err mm_identity_check(const mm_identity *ours, const mm_identity *theirs, const char **field,
                         char ours_val[MM_ADDR_LEN], char theirs_val[MM_ADDR_LEN]);

// mm_kv_capacity_reported: whether c states anything (a field is non-zero).
bool mm_kv_capacity_reported(const mm_kv_capacity *c);

// mm_kv_capacity_check validates a reported capacity from a peer before anyone trusts it:
// every field set and within sane bounds (block size 1..4096, blocks 1..2^31-1, 1..2^40
// tokens, token bytes 1..2^30, max seqs 1..2^20, max ctx 1..2^24), and the blocks fit the
// stated budget. Errors: MM_EINVAL naming the first bad field and its value. Pure.
mm_err mm_kv_capacity_check(const mm_kv_capacity *c, char err[MM_ERRLEN]);

// mm_identity_name writes "role/instance" into buf (at least 32 bytes).
const char *mm_identity_name(const mm_identity *id, char *buf, size_t n);

#endif

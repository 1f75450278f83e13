// SPDX-License-Identifier: MIT
// Identity fingerprints and the agreement check; see mm/identity.h.
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "mm/identity.h"

const char *const mm_roles[MM_N_ROLES] = {"gateway", "router", "attention", "expert", "drafter"};

// A safetensors header beyond this is not a real checkpoint (the largest seen are a few MiB).
#define MAX_ST_HEADER_BYTES (100u << 20)

int mm_role_index(const char *role) {
    for (int i = 0; role && i < MM_N_ROLES; i++)
        if (!strcmp(role, mm_roles[i]))
            return i;
    return -1;
}

const char *mm_identity_name(const mm_identity *id, char *buf, size_t n) {
    snprintf(buf, n, "%s/%u", id->role, id->instance);
    return buf;
}

bool mm_kv_capacity_reported(const mm_kv_capacity *c) {
    return c->block_size || c->blocks || c->token_bytes || c->budget_bytes || c->max_seqs ||
           c->max_ctx;
}

mm_err mm_kv_capacity_check(const mm_kv_capacity *c, char err[MM_ERRLEN]) {
    if (c->block_size < 1 || c->block_size > 4096)
        return mm_errf(err, MM_EINVAL, "KV block size %u (want 1..4096 tokens)", c->block_size);
    if (c->blocks < 1 || c->blocks > 0x7fffffffull)
        return mm_errf(err, MM_EINVAL, "KV blocks %llu (want 1..2^31-1)",
                       (unsigned long long)c->blocks);
    if (c->blocks * c->block_size > (1ull << 40))
        return mm_errf(err, MM_EINVAL, "KV tokens %llu (over 2^40)",
                       (unsigned long long)(c->blocks * c->block_size));
    if (c->token_bytes < 1 || c->token_bytes > (1u << 30))
        return mm_errf(err, MM_EINVAL, "KV bytes per token %u (want 1..2^30)", c->token_bytes);
    // blocks x block_size x token_bytes <= budget, by division (the product may overflow)
    if (c->budget_bytes / c->token_bytes / c->block_size < c->blocks)
        return mm_errf(err, MM_EINVAL, "KV blocks %llu of %u tokens x %u bytes do not fit the "
                       "stated budget of %llu bytes", (unsigned long long)c->blocks,
                       c->block_size, c->token_bytes, (unsigned long long)c->budget_bytes);
    if (c->max_seqs < 1 || c->max_seqs > (1u << 20))
        return mm_errf(err, MM_EINVAL, "max seqs %u (want 1..2^20)", c->max_seqs);
    if (c->max_ctx < 1 || c->max_ctx > (1u << 24))
        return mm_errf(err, MM_EINVAL, "max ctx %u (want 1..2^24 tokens)", c->max_ctx);
    return MM_OK;
}

static void digest_to_fp(const unsigned char *md, char out[MM_FP_LEN]) {
    int k = snprintf(out, MM_FP_LEN, "sha256:");
    for (int i = 0; i < 8; i++)
        k += snprintf(out + k, (size_t)(MM_FP_LEN - k), "%02x", md[i]);
}

static mm_err hash_file_bytes(EVP_MD_CTX *md, const char *path, size_t max_bytes, char *err) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return mm_errf(err, errno == ENOENT ? MM_ENOENT : MM_ESYS, "%s: %s", path, strerror(errno));
    unsigned char buf[65536];
    size_t n, total = 0;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0) {
        total += n;
        if (total > max_bytes) {
            fclose(f);
            return mm_errf(err, MM_EFORMAT, "%s: larger than %zu bytes", path, max_bytes);
        }
        EVP_DigestUpdate(md, buf, n);
    }
    mm_err rv = ferror(f) ? mm_errf(err, MM_ESYS, "%s: read error", path) : MM_OK;
    fclose(f);
    return rv;
}

// Hashes the 8-byte little-endian header length and the JSON header of one safetensors file.
static mm_err hash_st_header(EVP_MD_CTX *md, const char *path, char *err) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return mm_errf(err, MM_ESYS, "%s: %s", path, strerror(errno));
    mm_err rv = MM_OK;
    unsigned char len8[8];
    char *hdr = NULL;
    if (fread(len8, 1, 8, f) != 8) {
        rv = mm_errf(err, MM_EFORMAT, "%s: shorter than a safetensors header", path);
        goto out;
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | len8[i];
    if (n == 0 || n > MAX_ST_HEADER_BYTES) {
        rv = mm_errf(err, MM_EFORMAT, "%s: safetensors header length %llu is not plausible", path,
                     (unsigned long long)n);
        goto out;
    }
    hdr = malloc(n);
    if (!hdr) {
        rv = MM_ENOMEM;
        goto out;
    }
    if (fread(hdr, 1, n, f) != n) {
        rv = mm_errf(err, MM_EFORMAT, "%s: truncated safetensors header (%llu bytes declared)",
                     path, (unsigned long long)n);
        goto out;
    }
    EVP_DigestUpdate(md, len8, 8);
    EVP_DigestUpdate(md, hdr, n);
out:
    free(hdr);
    fclose(f);
    return rv;
}

static int is_safetensors(const struct dirent *e) {
    size_t n = strlen(e->d_name);
    return n > 12 && !strcmp(e->d_name + n - 12, ".safetensors");
}

mm_err mm_identity_model_fingerprint(const char *model_dir, char out[MM_FP_LEN],
                                     char err[MM_ERRLEN]) {
    if (!model_dir || !*model_dir) {
        snprintf(out, MM_FP_LEN, "none");
        return MM_OK;
    }
    struct stat st;
    if (stat(model_dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return mm_errf(err, MM_ENOENT, "--model %s: not a directory", model_dir);
    mm_err rv = MM_OK;
    struct dirent **names = NULL;
    int n_names = 0;
    char path[4096];
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md || !EVP_DigestInit_ex(md, EVP_sha256(), NULL)) {
        rv = mm_errf(err, MM_ESYS, "EVP sha256 unavailable");
        goto out;
    }
    snprintf(path, sizeof(path), "%s/config.json", model_dir);
    EVP_DigestUpdate(md, "config.json", 12);
    if ((rv = hash_file_bytes(md, path, 16u << 20, err)) != MM_OK) {
        if (rv == MM_ENOENT)
            mm_errf(err, MM_ENOENT, "--model %s: no config.json", model_dir);
        goto out;
    }
    n_names = scandir(model_dir, &names, is_safetensors, alphasort);
    if (n_names < 0) {
        n_names = 0;
        rv = mm_errf(err, MM_ESYS, "--model %s: %s", model_dir, strerror(errno));
        goto out;
    }
    for (int i = 0; i < n_names; i++) {
        snprintf(path, sizeof(path), "%s/%s", model_dir, names[i]->d_name);
        EVP_DigestUpdate(md, names[i]->d_name, strlen(names[i]->d_name) + 1);
        if ((rv = hash_st_header(md, path, err)) != MM_OK)
            goto out;
    }
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int dlen = 0;
    EVP_DigestFinal_ex(md, digest, &dlen);
    digest_to_fp(digest, out);
out:
    for (int i = 0; i < n_names; i++)
        free(names[i]);
    free(names);
    EVP_MD_CTX_free(md);
    return rv;
}

mm_err mm_identity_placement_fingerprint(const char *placement_file, long long n_owners,
                                         char out[MM_FP_LEN], char err[MM_ERRLEN]) {
    char *text = NULL;
    char uniform[64];
    if (placement_file && *placement_file) {
        json_error_t je;
        json_t *root = json_load_file(placement_file, 0, &je);
        if (!root)
            return mm_errf(err, je.line < 0 ? MM_ENOENT : MM_EFORMAT, "--placement %s: %s",
                           placement_file, je.text);
        text = json_dumps(root, JSON_SORT_KEYS | JSON_COMPACT);
        json_decref(root);
        if (!text)
            return MM_ENOMEM;
    } else {
        if (n_owners < 1)
            return mm_errf(err, MM_EINVAL, "--owners %lld: need at least one expert owner",
                           n_owners);
        snprintf(uniform, sizeof(uniform), "uniform:%lld", n_owners);
    }
    const char *s = text ? text : uniform;
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int dlen = 0;
    mm_err rv = MM_OK;
    if (!EVP_Digest(s, strlen(s), digest, &dlen, EVP_sha256(), NULL))
        rv = mm_errf(err, MM_ESYS, "EVP sha256 failed");
    else
        digest_to_fp(digest, out);
    free(text);
    return rv;
}

void mm_identity_numerics(const char *device, char *out, size_t n) {
    if (n == 0)
        return;
    out[0] = '\0';
    if (device != NULL && strncmp(device, "cuda", 4) == 0) {
        const char *e = getenv("MM_GPU_ATT_TC"); // as kernels/cuda/attention_tc.cu reads it
        snprintf(out, n, "attention=%s", e != NULL && strcmp(e, "0") == 0 ? "f32" : "tc");
    } else if (device != NULL && strncmp(device, "hip", 3) == 0) {
        snprintf(out, n, "attention=f32");
    }
}

mm_err mm_identity_check(const mm_identity *ours, const mm_identity *theirs, const char **field,
                         char ours_val[MM_ADDR_LEN], char theirs_val[MM_ADDR_LEN]) {
    if (ours->protocol_version != theirs->protocol_version) {
        *field = "protocol version";
        snprintf(ours_val, MM_ADDR_LEN, "%u", ours->protocol_version);
        snprintf(theirs_val, MM_ADDR_LEN, "%u", theirs->protocol_version);
        return MM_EIDENTITY;
    }
    const struct { const char *name; const char *a, *b; } f[] = {
        {"build id", ours->build_id, theirs->build_id},
        {"model fingerprint", ours->model_fp, theirs->model_fp},
        {"placement fingerprint", ours->placement_fp, theirs->placement_fp},
        // a CPU daemon ("") meshes with GPU ones; two GPU daemons must run the same contracts
        {"numerics (MM_GPU_ATT_TC)", ours->numerics[0] && theirs->numerics[0] ? ours->numerics : "",
         ours->numerics[0] && theirs->numerics[0] ? theirs->numerics : ""},
    };
    for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++)
        if (strcmp(f[i].a, f[i].b) != 0) {
            *field = f[i].name;
            snprintf(ours_val, MM_ADDR_LEN, "%s", f[i].a);
            snprintf(theirs_val, MM_ADDR_LEN, "%s", f[i].b);
            return MM_EIDENTITY;
        }
    *field = NULL;
    return MM_OK;
}

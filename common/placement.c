// SPDX-License-Identifier: MIT
// Expert placement: build (uniform, balanced), read, check and write (see mm/placement.h).
#include "mm/placement.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "mm/json.h"

static mm_err alloc(mm_placement **out, const mm_model_config *cfg, int n_owners, char *err) {
    *out = NULL;
    if (cfg->n_experts <= 0)
        return mm_errf(err, MM_EINVAL, "the model (%s) has no routed experts to place",
                       cfg->model_type);
    if (n_owners < 1 || n_owners > MM_PLACEMENT_MAX_OWNERS)
        return mm_errf(err, MM_EINVAL, "%d owners: must be 1..%d", n_owners,
                       MM_PLACEMENT_MAX_OWNERS);
    mm_placement *p = calloc(1, sizeof(*p));
    if (!p)
        return MM_ENOMEM;
    p->n_layers = cfg->n_layers;
    p->n_experts = cfg->n_experts;
    p->n_owners = n_owners;
    size_t le = (size_t)p->n_layers * (size_t)p->n_experts;
    p->moe = calloc((size_t)p->n_layers, sizeof(*p->moe));
    p->n_rep = calloc(le, sizeof(*p->n_rep));
    p->owner = calloc(le * (size_t)n_owners, sizeof(*p->owner));
    if (!p->moe || !p->n_rep || !p->owner) {
        mm_placement_free(p);
        return MM_ENOMEM;
    }
    for (int l = 0; l < p->n_layers; l++)
        p->moe[l] = cfg->layer_moe[l];
    *out = p;
    return MM_OK;
}

void mm_placement_free(mm_placement *p) {
    if (!p)
        return;
    free(p->moe);
    free(p->n_rep);
    free(p->owner);
    free(p);
}

static void add(mm_placement *p, int l, int e, int o) {
    size_t i = (size_t)l * (size_t)p->n_experts + (size_t)e;
    p->owner[i * (size_t)p->n_owners + p->n_rep[i]] = (uint16_t)o;
    p->n_rep[i]++;
}

bool mm_placement_owns(const mm_placement *p, int layer, int expert, int owner) {
    if (layer < 0 || layer >= p->n_layers || expert < 0 || expert >= p->n_experts)
        return false;
    for (int r = 0; r < mm_placement_n_rep(p, layer, expert); r++)
        if (mm_placement_owner(p, layer, expert, r) == owner)
            return true;
    return false;
}

long mm_placement_count(const mm_placement *p, int owner) {
    long n = 0;
    for (int l = 0; l < p->n_layers; l++)
        for (int e = 0; e < p->n_experts; e++)
            n += mm_placement_owns(p, l, e, owner);
    return n;
}

mm_err mm_placement_uniform(mm_placement **out, const mm_model_config *cfg, int n_owners,
                            char err[MM_ERRLEN]) {
    MM_TRY(alloc(out, cfg, n_owners, err));
    mm_placement *p = *out;
    for (int l = 0; l < p->n_layers; l++)
        if (p->moe[l])
            for (int e = 0; e < p->n_experts; e++)
                add(p, l, e, e % n_owners);
    return MM_OK;
}

// ---- balanced ------------------------------------------------------------------------------

static mm_err read_load(const char *path, const mm_placement *p, double *load, char *err) {
    FILE *f = fopen(path, "r");
    if (!f)
        return mm_errf(err, errno == ENOENT ? MM_ENOENT : MM_ESYS, "%s: %s", path,
                       strerror(errno));
    char line[256];
    int ln = 0;
    mm_err rv = MM_OK;
    while (fgets(line, sizeof(line), f)) {
        ln++;
        if (line[0] == '\n' || line[0] == '#' || strncmp(line, "layer", 5) == 0)
            continue;
        long l, e;
        double t;
        char extra;
        if (sscanf(line, "%ld,%ld,%lf %c", &l, &e, &t, &extra) != 3 || t < 0) {
            rv = mm_errf(err, MM_EFORMAT, "%s:%d: expected 'layer,expert,tokens', got '%.60s'",
                         path, ln, line);
            break;
        }
        if (l < 0 || l >= p->n_layers || e < 0 || e >= p->n_experts) {
            rv = mm_errf(err, MM_EFORMAT, "%s:%d: layer %ld expert %ld is outside the model "
                         "(%d layers, %d experts)", path, ln, l, e, p->n_layers, p->n_experts);
            break;
        }
        load[l * p->n_experts + e] += t;
    }
    fclose(f);
    return rv;
}

mm_err mm_placement_balanced(mm_placement **out, const mm_model_config *cfg, int n_owners,
                             const char *load_csv, int replicate_hot, char err[MM_ERRLEN]) {
    MM_TRY(alloc(out, cfg, n_owners, err));
    mm_placement *p = *out;
    const int E = p->n_experts;
    mm_err rv = MM_OK;
    double *load = calloc((size_t)p->n_layers * (size_t)E, sizeof(double));
    double *owner_load = calloc((size_t)n_owners, sizeof(double));
    int *order = calloc((size_t)E, sizeof(int));
    if (!load || !owner_load || !order) {
        rv = MM_ENOMEM;
        goto done;
    }
    if (replicate_hot < 0 || replicate_hot > E) {
        rv = mm_errf(err, MM_EINVAL, "--replicate-hot %d: must be 0..%d", replicate_hot, E);
        goto done;
    }
    if (load_csv)
        MM_TRY_GOTO(rv, read_load(load_csv, p, load, err), done);
    for (int l = 0; l < p->n_layers; l++) {
        if (!p->moe[l])
            continue;
        const double *ld = load + (size_t)l * (size_t)E;
        for (int e = 0; e < E; e++)
            order[e] = e;
        // heaviest first; ties by expert id (insertion sort: E is small)
        for (int i = 1; i < E; i++) {
            int v = order[i], j = i;
            while (j > 0 && ld[order[j - 1]] < ld[v])
                order[j] = order[j - 1], j--;
            order[j] = v;
        }
        memset(owner_load, 0, (size_t)n_owners * sizeof(double));
        int *count = calloc((size_t)n_owners, sizeof(int));
        if (!count) {
            rv = MM_ENOMEM;
            goto done;
        }
        for (int i = 0; i < E; i++) {
            int best = 0; // least load, then fewest experts, then lowest id
            for (int o = 1; o < n_owners; o++)
                if (owner_load[o] < owner_load[best] ||
                    (owner_load[o] == owner_load[best] && count[o] < count[best]))
                    best = o;
            add(p, l, order[i], best);
            owner_load[best] += ld[order[i]] + 1.0; // +1: unmeasured experts still spread
            count[best]++;
        }
        for (int i = 0; i < replicate_hot && n_owners > 1; i++) {
            int e = order[i], best = -1;
            for (int o = 0; o < n_owners; o++)
                if (!mm_placement_owns(p, l, e, o) &&
                    (best < 0 || owner_load[o] < owner_load[best]))
                    best = o;
            if (best < 0)
                continue;
            int first = mm_placement_owner(p, l, e, 0);
            owner_load[first] -= ld[e] / 2;
            owner_load[best] += ld[e] / 2;
            add(p, l, e, best);
        }
        free(count);
    }
done:
    free(load);
    free(owner_load);
    free(order);
    if (rv != MM_OK) {
        mm_placement_free(p);
        *out = NULL;
    }
    return rv;
}

// ---- file ----------------------------------------------------------------------------------

mm_err mm_placement_load(mm_placement **out, const char *path, const mm_model_config *cfg,
                         int n_owners_expect, char err[MM_ERRLEN]) {
    *out = NULL;
    json_t *j = NULL;
    MM_TRY(mm_json_load_file(path, &j, err));
    mm_err rv = MM_OK;
    long long ver = 0, nl = 0, ne = 0, no = 0;
    mm_placement *p = NULL;
    MM_TRY_GOTO(rv, mm_json_get_int(j, "version", path, &ver, err), done);
    MM_TRY_GOTO(rv, mm_json_get_int(j, "n_layers", path, &nl, err), done);
    MM_TRY_GOTO(rv, mm_json_get_int(j, "n_experts", path, &ne, err), done);
    MM_TRY_GOTO(rv, mm_json_get_int(j, "n_owners", path, &no, err), done);
    if (ver != 1) {
        rv = mm_errf(err, MM_EFORMAT, "%s: version %lld, expected 1", path, ver);
        goto done;
    }
    if (nl != cfg->n_layers || ne != cfg->n_experts) {
        rv = mm_errf(err, MM_EINVAL, "%s: placement for %lld layers x %lld experts, the model "
                     "has %d x %d", path, nl, ne, cfg->n_layers, cfg->n_experts);
        goto done;
    }
    if (n_owners_expect > 0 && no != n_owners_expect) {
        rv = mm_errf(err, MM_EINVAL, "%s: placement for %lld owners, the mesh has --owners %d",
                     path, no, n_owners_expect);
        goto done;
    }
    MM_TRY_GOTO(rv, alloc(&p, cfg, (int)no, err), done);
    json_t *ex = json_object_get(j, "experts");
    if (!json_is_array(ex) || json_array_size(ex) != (size_t)nl) {
        rv = mm_errf(err, MM_EFORMAT, "%s: \"experts\" must be an array of %lld layers", path,
                     nl);
        goto done;
    }
    for (int l = 0; l < (int)nl; l++) {
        json_t *lay = json_array_get(ex, (size_t)l);
        size_t n = json_is_array(lay) ? json_array_size(lay) : (size_t)-1;
        if (n != (p->moe[l] ? (size_t)ne : 0)) {
            rv = mm_errf(err, MM_EFORMAT, "%s: layer %d must list %lld experts (it is %s)", path,
                         l, p->moe[l] ? ne : 0, p->moe[l] ? "an MoE layer" : "dense");
            goto done;
        }
        for (int e = 0; e < (int)n; e++) {
            json_t *lst = json_array_get(lay, (size_t)e);
            if (!json_is_array(lst) || json_array_size(lst) == 0) {
                rv = mm_errf(err, MM_EFORMAT, "%s: layer %d expert %d: needs a non-empty list of "
                             "owners", path, l, e);
                goto done;
            }
            for (size_t r = 0; r < json_array_size(lst); r++) {
                json_t *o = json_array_get(lst, r);
                long long v = json_is_integer(o) ? json_integer_value(o) : -1;
                if (v < 0 || v >= no || mm_placement_owns(p, l, e, (int)v)) {
                    rv = mm_errf(err, MM_EFORMAT, "%s: layer %d expert %d: owner entry %zu is "
                                 "not a distinct owner id below %lld", path, l, e, r, no);
                    goto done;
                }
                add(p, l, e, (int)v);
            }
        }
    }
done:
    json_decref(j);
    if (rv != MM_OK)
        mm_placement_free(p);
    else
        *out = p;
    return rv;
}

mm_err mm_placement_open(mm_placement **out, const char *path, const mm_model_config *cfg,
                         int n_owners, char err[MM_ERRLEN]) {
    if (path && *path)
        return mm_placement_load(out, path, cfg, n_owners, err);
    return mm_placement_uniform(out, cfg, n_owners, err);
}

mm_err mm_placement_write(const mm_placement *p, FILE *f, char err[MM_ERRLEN]) {
    fprintf(f, "{\"version\":1, \"n_layers\":%d, \"n_experts\":%d, \"n_owners\":%d,\n"
               " \"experts\": [\n", p->n_layers, p->n_experts, p->n_owners);
    for (int l = 0; l < p->n_layers; l++) {
        fputs("  [", f);
        for (int e = 0; p->moe[l] && e < p->n_experts; e++) {
            fputs(e ? ",[" : "[", f);
            for (int r = 0; r < mm_placement_n_rep(p, l, e); r++)
                fprintf(f, r ? ",%d" : "%d", mm_placement_owner(p, l, e, r));
            fputc(']', f);
        }
        fputs(l + 1 < p->n_layers ? "],\n" : "]\n", f);
    }
    fputs(" ]}\n", f);
    if (fflush(f) != 0 || ferror(f))
        return mm_errf(err, MM_ESYS, "writing the placement: %s", strerror(errno));
    return MM_OK;
}

// SPDX-License-Identifier: MIT
// Option tables: defaults < config file < environment < command line. See mm/config.h.
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "mm/config.h"
#include "mm/log.h"

static mm_err set_value(mm_opt *o, const char *val, const char *source, char *err) {
    char *end = NULL;
    switch (o->type) {
    case MM_OPT_STR: {
        char **dst = o->dst;
        free(*dst);
        *dst = val ? strdup(val) : NULL;
        if (val && !*dst)
            return MM_ENOMEM;
        return MM_OK;
    }
    case MM_OPT_INT: {
        errno = 0;
        long long v = strtoll(val, &end, 0);
        if (errno || end == val || *end)
            return mm_errf(err, MM_EINVAL, "--%s: '%s' from %s is not an integer", o->name, val,
                           source);
        *(long long *)o->dst = v;
        return MM_OK;
    }
    case MM_OPT_DBL: {
        errno = 0;
        double v = strtod(val, &end);
        if (errno || end == val || *end)
            return mm_errf(err, MM_EINVAL, "--%s: '%s' from %s is not a number", o->name, val,
                           source);
        *(double *)o->dst = v;
        return MM_OK;
    }
    case MM_OPT_BOOL:
        if (!mm_parse_bool(val, (bool *)o->dst))
            return mm_errf(err, MM_EINVAL, "--%s: '%s' from %s is not true or false", o->name,
                           val, source);
        return MM_OK;
    }
    return MM_EINVAL;
}

bool mm_parse_bool(const char *s, bool *out) {
    if (!strcmp(s, "1") || !strcasecmp(s, "true") || !strcasecmp(s, "yes") || !strcasecmp(s, "on"))
        *out = true;
    else if (!strcmp(s, "0") || !strcasecmp(s, "false") || !strcasecmp(s, "no") ||
             !strcasecmp(s, "off"))
        *out = false;
    else
        return false;
    return true;
}

bool mm_env_off(const char *name) {
    const char *v = getenv(name);
    bool on = true;
    return v && mm_parse_bool(v, &on) && !on;
}

static mm_opt *find_opt(mm_opt *opts, const char *name, size_t len) {
    for (mm_opt *o = opts; o->name; o++)
        if (strlen(o->name) == len && !strncmp(o->name, name, len))
            return o;
    return NULL;
}

static mm_err load_file(mm_cli *cli, const char *path, char *err) {
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root)
        return mm_errf(err, MM_EINVAL, "config file %s: line %d: %s", path, je.line, je.text);
    mm_err rv = MM_OK;
    if (!json_is_object(root)) {
        rv = mm_errf(err, MM_EINVAL, "config file %s: top level must be a JSON object", path);
        goto out;
    }
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        mm_opt *o = find_opt(cli->opts, key, strlen(key));
        if (!o) {
            rv = mm_errf(err, MM_EINVAL, "config file %s: unknown option '%s'", path, key);
            goto out;
        }
        char buf[64];
        const char *s;
        if (json_is_string(v))
            s = json_string_value(v);
        else if (json_is_integer(v))
            snprintf(buf, sizeof(buf), "%lld", (long long)json_integer_value(v)), s = buf;
        else if (json_is_real(v))
            snprintf(buf, sizeof(buf), "%.17g", json_real_value(v)), s = buf;
        else if (json_is_boolean(v))
            s = json_is_true(v) ? "true" : "false";
        else {
            rv = mm_errf(err, MM_EINVAL, "config file %s: option '%s' must be a string, number "
                         "or boolean", path, key);
            goto out;
        }
        char src[300];
        snprintf(src, sizeof(src), "config file %s", path);
        if ((rv = set_value(o, s, src, err)) != MM_OK)
            goto out;
    }
out:
    json_decref(root);
    return rv;
}

static mm_err parse(mm_cli *cli, int argc, char **argv, char err[MM_ERRLEN]) {
    cli->n_args = 0;
    cli->args = NULL;
    cli->help_shown = false;
    for (mm_opt *o = cli->opts; o->name; o++)
        if (o->type == MM_OPT_STR)
            *(char **)o->dst = NULL;
    for (mm_opt *o = cli->opts; o->name; o++) {
        if (o->def)
            MM_TRY(set_value(o, o->def, "the default", err));
        else if (o->type == MM_OPT_BOOL)
            *(bool *)o->dst = false;
    }
    // Pass 1: --help and --config come first so that the command line still wins.
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--"))
            break;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            mm_config_usage(cli);
            cli->help_shown = true;
            return MM_OK;
        }
        const char *cfg = NULL;
        if (!strcmp(argv[i], "--config") && i + 1 < argc)
            cfg = argv[i + 1];
        else if (!strncmp(argv[i], "--config=", 9))
            cfg = argv[i] + 9;
        if (cfg)
            MM_TRY(load_file(cli, cfg, err));
    }
    // Environment.
    for (mm_opt *o = cli->opts; o->name; o++) {
        char env[128] = "MM_";
        size_t k = 3;
        for (const char *p = o->name; *p && k < sizeof(env) - 1; p++)
            env[k++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
        env[k] = 0;
        const char *v = getenv(env);
        if (v) {
            char src[160];
            snprintf(src, sizeof(src), "environment %s", env);
            MM_TRY(set_value(o, v, src, err));
        }
    }
    // Command line.
    static char *no_args[1];
    cli->args = no_args;
    int first_pos = -1;
    for (int i = 1; i < argc; i++) {
        char *a = argv[i];
        if (!strcmp(a, "--")) {
            if (first_pos < 0)
                first_pos = i + 1;
            break;
        }
        if (strncmp(a, "--", 2) != 0 || a[2] == 0) {
            // positional: keep them in order at the front of argv's tail
            if (first_pos < 0)
                first_pos = i;
            argv[first_pos + cli->n_args] = a;
            cli->n_args++;
            continue;
        }
        const char *name = a + 2, *eq = strchr(name, '='), *val = NULL;
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        if (len == 6 && !strncmp(name, "config", 6)) {
            if (!eq)
                i++;
            continue;
        }
        mm_opt *o = find_opt(cli->opts, name, len);
        if (!o)
            return mm_errf(err, MM_EINVAL, "unknown option '--%.*s' (see %s --help)", (int)len,
                           name, cli->prog);
        if (eq)
            val = eq + 1;
        else if (o->type == MM_OPT_BOOL) {
            val = "true";
            if (i + 1 < argc && (!strcasecmp(argv[i + 1], "true") || !strcasecmp(argv[i + 1], "false")))
                val = argv[++i];
        } else if (i + 1 < argc)
            val = argv[++i];
        else
            return mm_errf(err, MM_EINVAL, "option '--%s' needs a value", o->name);
        MM_TRY(set_value(o, val, "the command line", err));
    }
    if (first_pos >= 0 && cli->n_args > 0)
        cli->args = argv + first_pos;
    return MM_OK;
}

mm_err mm_config_parse(mm_cli *cli, int argc, char **argv, char err[MM_ERRLEN]) {
    mm_err rv = parse(cli, argc, argv, err);
    if (rv != MM_OK)
        mm_config_fini(cli); // a failed parse owns nothing: the strings set so far are freed
    return rv;
}

void mm_config_usage(const mm_cli *cli) {
    printf("usage: %s %s\n\n%s\n\noptions:\n", cli->prog, cli->usage ? cli->usage : "[options]",
           cli->summary);
    for (const mm_opt *o = cli->opts; o->name; o++) {
        const char *meta = o->type == MM_OPT_STR ? " STR" : o->type == MM_OPT_INT ? " N"
                         : o->type == MM_OPT_DBL ? " X" : "";
        char left[64];
        snprintf(left, sizeof(left), "--%s%s", o->name, meta);
        printf("  %-28s %s", left, o->help);
        if (o->def)
            printf(" (default: %s)", o->def);
        printf("\n");
    }
    printf("  %-28s %s\n  %-28s %s\n", "--config FILE", "read options from a JSON object file",
           "--help", "print this help and exit");
    printf("\nEvery option can also be set in the environment as MM_<NAME> (e.g. --max-tokens as "
           "MM_MAX_TOKENS);\nthe command line wins over the environment, which wins over the "
           "config file.\n");
}

void mm_config_log(const mm_cli *cli) {
    for (const mm_opt *o = cli->opts; o->name; o++) {
        switch (o->type) {
        case MM_OPT_STR: {
            const char *s = *(char **)o->dst;
            mm_log_info("config %s=%s", o->name, s ? s : "(unset)");
            break;
        }
        case MM_OPT_INT:
            mm_log_info("config %s=%lld", o->name, *(long long *)o->dst);
            break;
        case MM_OPT_DBL:
            mm_log_info("config %s=%g", o->name, *(double *)o->dst);
            break;
        case MM_OPT_BOOL:
            mm_log_info("config %s=%s", o->name, *(bool *)o->dst ? "true" : "false");
            break;
        }
    }
}

void mm_config_fini(mm_cli *cli) {
    if (!cli || !cli->opts)
        return;
    for (mm_opt *o = cli->opts; o->name; o++)
        if (o->type == MM_OPT_STR && o->dst) {
            free(*(char **)o->dst);
            *(char **)o->dst = NULL;
        }
}

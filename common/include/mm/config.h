// SPDX-License-Identifier: MIT
// Command-line configuration shared by every binary.
//
// Each binary declares a table of mm_opt (NULL-terminated by name). Values are resolved in
// this order, later winning: the table's default, the config file (--config FILE: a JSON
// object of option name -> value), the environment (MM_<NAME>, upper case, '-' -> '_'),
// then the command line (--name VALUE or --name=VALUE; a bool flag alone means true and
// may be followed by true|false). --help prints the table and the caller exits 0.
#ifndef MM_CONFIG_H
#define MM_CONFIG_H

#include <stdbool.h>
#include <stddef.h>

#include "mm/err.h"

enum mm_opt_type { MM_OPT_STR, MM_OPT_INT, MM_OPT_DBL, MM_OPT_BOOL };

typedef struct mm_opt {
    const char *name;      // long flag without "--", e.g. "listen"
    enum mm_opt_type type; // what dst points to: char * / long long / double / bool
    void *dst;             // written by mm_config_parse; strings are owned by the table
    const char *def;       // default as text; NULL leaves a string NULL (unset)
    const char *help;      // one line for --help
} mm_opt;

typedef struct mm_cli {
    const char *prog;      // binary name shown in --help and logs
    const char *summary;   // one sentence shown first in --help
    const char *usage;     // e.g. "[options]"; NULL for "[options]"
    mm_opt *opts;          // table, terminated by an entry with name == NULL
    int n_args;            // out: number of positional arguments left
    char **args;           // out: the positional arguments (borrowed from argv)
    bool help_shown;       // out: --help was given and printed; the caller should exit 0
} mm_cli;

// mm_config_parse resolves every option of cli->opts. Errors: MM_EINVAL naming the option
// and the offending value or source (bad number, unknown flag, missing value, bad config
// file); then no string is left owned. Not thread-safe; call at start. Free the strings of a
// successful parse with mm_config_fini.
mm_err mm_config_parse(mm_cli *cli, int argc, char **argv, char err[MM_ERRLEN]);

// mm_parse_bool reads a boolean word as the options do: "1", "true", "yes", "on" (any case)
// set *out true; "0", "false", "no", "off" false. Anything else returns false, *out untouched.
bool mm_parse_bool(const char *s, bool *out);
// mm_env_off: environment variable name is set to one of mm_parse_bool's false words (the
// switches that are on unless turned off, e.g. MM_GPU_GRAPHS=0).
bool mm_env_off(const char *name);

// mm_config_usage prints --help text for cli to stdout.
void mm_config_usage(const mm_cli *cli);

// mm_config_log writes the effective configuration, one "config name=value" line per option,
// at info level.
void mm_config_log(const mm_cli *cli);

// mm_config_fini frees strings the table owns; accepts a table never parsed.
void mm_config_fini(mm_cli *cli);

#endif

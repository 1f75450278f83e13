// SPDX-License-Identifier: MIT
// Logging: one line per event on stderr, "<level> <daemon>[<pid>]: <message>".
// Under systemd (JOURNAL_STREAM set) each line starts with the syslog priority "<N>" instead,
// which journald turns into the entry's priority. Thread-safe: a line is written with one
// write(2) call.
#ifndef MM_LOG_H
#define MM_LOG_H

enum mm_log_level { MM_LOG_ERROR = 0, MM_LOG_WARN, MM_LOG_INFO, MM_LOG_DEBUG };

// mm_log_init names the process in every line (borrows name: it must outlive logging) and sets
// the level. Call once at start, before threads.
void mm_log_init(const char *name, enum mm_log_level level);
void mm_log_set_level(enum mm_log_level level);
enum mm_log_level mm_log_get_level(void);
// mm_log_level_parse maps "error|warn|info|debug" to a level; returns -1 for anything else.
int mm_log_level_parse(const char *s);

void mm_log(enum mm_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define mm_log_error(...) mm_log(MM_LOG_ERROR, __VA_ARGS__)
#define mm_log_warn(...)  mm_log(MM_LOG_WARN, __VA_ARGS__)
#define mm_log_info(...)  mm_log(MM_LOG_INFO, __VA_ARGS__)
#define mm_log_debug(...) \
    do { if (mm_log_get_level() >= MM_LOG_DEBUG) mm_log(MM_LOG_DEBUG, __VA_ARGS__); } while (0)

#endif

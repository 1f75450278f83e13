// SPDX-License-Identifier: MIT
// Line-oriented logger; see mm/log.h.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mm/log.h"

static const char *g_name = "moemesh";
static enum mm_log_level g_level = MM_LOG_INFO;
static int g_journal = 0;

static const char *const level_names[] = {"error", "warn", "info", "debug"};
static const int level_syslog[] = {3, 4, 6, 7};

void mm_log_init(const char *name, enum mm_log_level level) {
    if (name != NULL)
        g_name = name;
    g_level = level;
    g_journal = getenv("JOURNAL_STREAM") != NULL;
}

void mm_log_set_level(enum mm_log_level level) { g_level = level; }
enum mm_log_level mm_log_get_level(void) { return g_level; }

int mm_log_level_parse(const char *s) {
    for (int i = 0; i <= MM_LOG_DEBUG; i++)
        if (strcmp(s, level_names[i]) == 0)
            return i;
    return -1;
}

void mm_log(enum mm_log_level level, const char *fmt, ...) {
    if (level > g_level)
        return;
    char line[2048];
    int n;
    if (g_journal) {
        n = snprintf(line, sizeof(line), "<%d>%s[%d]: ", level_syslog[level], g_name, (int)getpid());
    } else {
        struct timespec ts;
        struct tm tm;
        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        n = snprintf(line, sizeof(line), "%02d:%02d:%02d.%03ld %-5s %s[%d]: ", tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, level_names[level], g_name, (int)getpid());
    }
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof(line) - 2)
        len = sizeof(line) - 2;
    for (size_t i = (size_t)n; i < len; i++) // one event, one line
        if (line[i] == '\n')
            line[i] = ' ';
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}

/* status.c -- thread-local error message behind every non-zero fattn_status. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "fattn.h"

static _Thread_local char last_error[1024];

fattn_status fattn_set_error(fattn_status status, const char *file, int line, const char *fmt, ...) {
    const char *base = strrchr(file, '/');
    int n = snprintf(last_error, sizeof last_error, "%s:%d: ", base ? base + 1 : file, line);
    if (n < 0 || n >= (int)sizeof last_error) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error + n, sizeof last_error - (size_t)n, fmt, ap);
    va_end(ap);
    return status;
}

const char *fattn_last_error(void) { return last_error; }

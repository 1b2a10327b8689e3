/* A msgpack reader over a byte range, for the fast path of KV event batches (events.c) and their cutting
 * (split.c): it reads what vLLM writes and declines the rest, never allocating. Its smallest steps are
 * inline here, since the event readers call them per field and per token id. */
#ifndef KVGATE_NATIVE_MSGPACK_H
#define KVGATE_NATIVE_MSGPACK_H

#include "common.h"

#define MAX_DEPTH 32 /* nesting skip() follows */

typedef struct {
    const uint8_t *p, *end;
} Reader;

/* Every reader returns 0 on success, -1 when the bytes are not what the fast path accepts
 * (the caller then declines the whole batch). */

static inline int need(Reader *r, size_t n) { return (size_t)(r->end - r->p) >= n ? 0 : -1; }

static inline int is_nil(Reader *r) {
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* The next value is a map (fixmap, map 16 or map 32); nothing read. */
static inline int at_map(const Reader *r) {
    if (r->p >= r->end) return 0;
    uint8_t b = *r->p;
    return (b & 0xf0) == 0x80 || b == 0xde || b == 0xdf;
}

static inline int str_is(const char *s, uint32_t n, const char *lit) {
    return strlen(lit) == n && memcmp(s, lit, n) == 0;
}

/* msgpack.c */
static int rd_int(Reader *r, uint64_t *v); /* an integer's 64 bits (two's complement for negatives) */
static int rd_array(Reader *r, uint32_t *n);
static int rd_map(Reader *r, uint32_t *n);
static int rd_str(Reader *r, const char **s, uint32_t *n); /* ASCII only */
static int rd_float(Reader *r);
static int skip(Reader *r, int depth);
static int skip_opt_int(Reader *r);

#endif

/* The msgpack reader: integers, array and map headers, ASCII strs, floats, and skipping any value but
 * ext types. Part of kvcache._native (module.c). */
#include "msgpack.h"

/* An integer's 64 bits (two's complement for negatives). */
static int rd_int(Reader *r, uint64_t *v) {
    if (need(r, 1)) return -1;
    uint8_t b = *r->p++;
    if (b <= 0x7f) { *v = b; return 0; }
    if (b >= 0xe0) { *v = (uint64_t)(int64_t)(int8_t)b; return 0; }
    int n;
    int sign;
    switch (b) {
    case 0xcc: n = 1; sign = 0; break;
    case 0xcd: n = 2; sign = 0; break;
    case 0xce: n = 4; sign = 0; break;
    case 0xcf: n = 8; sign = 0; break;
    case 0xd0: n = 1; sign = 1; break;
    case 0xd1: n = 2; sign = 1; break;
    case 0xd2: n = 4; sign = 1; break;
    case 0xd3: n = 8; sign = 1; break;
    default: r->p--; return -1;
    }
    if (need(r, n)) return -1;
    uint64_t x = be(r->p, n);
    r->p += n;
    if (sign && n < 8 && (x >> (8 * n - 1)) & 1) x |= ~UINT64_C(0) << (8 * n); /* sign-extend */
    *v = x;
    return 0;
}

/* An array or map header: fix form (high nibble `fix`) or the 16/32-bit forms m16, m16 + 1. */
static int rd_header(Reader *r, uint32_t *n, uint8_t fix, uint8_t m16) {
    if (need(r, 1)) return -1;
    uint8_t b = *r->p;
    if ((b & 0xf0) == fix) { *n = b & 0x0f; r->p++; return 0; }
    if (b == m16 || b == m16 + 1) {
        int w = b == m16 ? 2 : 4;
        if (need(r, 1 + w)) return -1;
        *n = (uint32_t)be(r->p + 1, w);
        r->p += 1 + w;
        return 0;
    }
    return -1;
}

static int rd_array(Reader *r, uint32_t *n) { return rd_header(r, n, 0x90, 0xdc); }

static int rd_map(Reader *r, uint32_t *n) { return rd_header(r, n, 0x80, 0xde); }

/* A str, ASCII only (msgpack's decoder would reject invalid UTF-8; ASCII needs no check). */
static int rd_str(Reader *r, const char **s, uint32_t *n) {
    if (need(r, 1)) return -1;
    uint8_t b = *r->p;
    uint32_t len;
    int w;
    if ((b & 0xe0) == 0xa0) { len = b & 0x1f; w = 0; }
    else if (b == 0xd9) w = 1;
    else if (b == 0xda) w = 2;
    else if (b == 0xdb) w = 4;
    else return -1;
    if (need(r, 1 + w)) return -1;
    if (w) len = (uint32_t)be(r->p + 1, w);
    if (need(r, 1 + w + (size_t)len)) return -1;
    const uint8_t *start = r->p + 1 + w;
    for (uint32_t i = 0; i < len; i++)
        if (start[i] >= 0x80) return -1;
    *s = (const char *)start;
    *n = len;
    r->p = start + len;
    return 0;
}

static int rd_float(Reader *r) {
    if (need(r, 1)) return -1;
    uint8_t b = *r->p;
    if (b == 0xca && !need(r, 5)) { r->p += 5; return 0; }
    if (b == 0xcb && !need(r, 9)) { r->p += 9; return 0; }
    return -1;
}

/* Skip any value except ext types and non-ASCII strs (declined: the general path decides). */
static int skip(Reader *r, int depth) {
    if (depth > MAX_DEPTH || need(r, 1)) return -1;
    uint8_t b = *r->p;
    uint64_t ignored;
    uint32_t n;
    const char *s;
    if (b <= 0x7f || b >= 0xe0 || (b >= 0xcc && b <= 0xd3)) return rd_int(r, &ignored);
    if ((b & 0xe0) == 0xa0 || (b >= 0xd9 && b <= 0xdb)) return rd_str(r, &s, &n);
    if (b == 0xc0 || b == 0xc2 || b == 0xc3) { r->p++; return 0; }
    if (b == 0xca || b == 0xcb) return rd_float(r);
    if (b >= 0xc4 && b <= 0xc6) { /* bin */
        int w = b == 0xc4 ? 1 : b == 0xc5 ? 2 : 4;
        if (need(r, 1 + w)) return -1;
        size_t len = be(r->p + 1, w);
        if (need(r, 1 + w + len)) return -1;
        r->p += 1 + w + len;
        return 0;
    }
    if ((b & 0xf0) == 0x90 || b == 0xdc || b == 0xdd) {
        if (rd_array(r, &n)) return -1;
        for (uint32_t i = 0; i < n; i++)
            if (skip(r, depth + 1)) return -1;
        return 0;
    }
    if (at_map(r)) {
        if (rd_map(r, &n)) return -1;
        for (uint32_t i = 0; i < 2 * n; i++)
            if (skip(r, depth + 1)) return -1;
        return 0;
    }
    return -1; /* ext */
}

static int skip_opt_int(Reader *r) {
    uint64_t v;
    return is_nil(r) ? 0 : rd_int(r, &v);
}


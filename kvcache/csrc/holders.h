/* Who holds a key: up to four slot numbers inline in the key's 8-byte holder word, more as a bitmask in
 * the pool; entries (a key gaining or losing a holder, with the per-slot and per-pod counts), the
 * background passes and eviction. The holder reads the match walk runs per block are inline here. */
#ifndef KVGATE_NATIVE_HOLDERS_H
#define KVGATE_NATIVE_HOLDERS_H

#include "blockkeys.h" /* GOLDEN, for fold */
#include "core.h"

#define HOLD_OVF 0xFFFFu                /* first field of an overflow holder word */
#define PASS_BUDGET 8192                /* key positions one maintenance call sweeps while dead slots wait */

static inline int hold_ovf(uint64_t h) { return (h & 0xFFFF) == HOLD_OVF; }

static inline uint64_t *hold_words(const Core *c, uint64_t h) { return c->pool + ((h >> 16) & 0xFFFFFFFFu) * c->W; }

static inline int bit_of(const uint64_t *w, Py_ssize_t s) { return (int)((w[s >> 6] >> (s & 63)) & 1); }

/* The holder bitmask of h into out, words [lo, hi) only (the others are left as they are). */
static inline void hold_bits_range(const Core *c, uint64_t h, uint64_t *out, int lo, int hi) {
    if (hold_ovf(h)) {
        memcpy(out + lo, hold_words(c, h) + lo, sizeof(uint64_t) * (hi - lo));
        return;
    }
    memset(out + lo, 0, sizeof(uint64_t) * (hi - lo));
    for (; h; h >>= 16) {
        uint32_t s = (uint32_t)(h & 0xFFFF) - 1;
        if ((int)(s >> 6) >= lo && (int)(s >> 6) < hi) out[s >> 6] |= UINT64_C(1) << (s & 63);
    }
}

/* An engine block hash folded into the hash maps' range (index.py's _fold): below TOMB. */
static inline uint64_t fold(uint64_t h) {
    h *= GOLDEN;
    return h >= TOMB ? h - 2 : h;
}

enum { R_UNKNOWN = -2, R_NOT_HELD = -1, R_FREED = 0, R_STILL_HELD = 1 };

/* holders.c */
static Py_ssize_t hold_list(const Core *c, uint64_t h); /* the holders' slot numbers into c->scratch; their count */
static int hold_has_group(const Core *c, uint64_t h, int32_t g);
static int store_pair(Core *c, int model, int m, uint64_t h, uint64_t k, uint32_t slot, uint32_t stamp);
static int release_one(Core *c, int model, int m, uint64_t h, uint32_t slot); /* an R_ value */
static void pass_step(Core *c, Py_ssize_t budget);
static int evict(Core *c);
static void passes(Core *c);
static int maintain(Core *c);

#endif

/* The index's two open-addressing tables: a key table per medium (block key -> holders and a recency
 * stamp) and a hash map per model (the engine's folded block hash -> block key). Linear probing and
 * backward-shift deletion (no tombstones, so no rebuild at a steady size); the probes are inline here
 * since the match walk (core.c) and the holder updates (holders.c) run them in their loops. */
#ifndef KVGATE_NATIVE_TABLES_H
#define KVGATE_NATIVE_TABLES_H

#include "common.h"

#define EMPTY UINT64_MAX
#define TOMB (UINT64_MAX - 1) /* folded engine hashes stay below it (index.py's _fold) */

#define MAX_LOAD_NUM 3                  /* grow past 3/4 full ... */
#define MAX_LOAD_DEN 4
#define GROW_LOAD 0.55                  /* ... to 0.55 full */
#define MIN_CAP 64

typedef struct { uint64_t key, hold; } KSlot;
typedef struct { uint64_t h, key; } HSlot;

typedef struct {
    KSlot *s;
    uint32_t *stamp;
    Py_ssize_t cap, live;
    int used; /* a medium id in use */
} KTable;

typedef struct {
    HSlot *s;
    Py_ssize_t cap, live;
} HTable;

typedef struct Core Core; /* core.h */

static inline Py_ssize_t kt_home(Py_ssize_t cap, uint64_t k) {
    return (Py_ssize_t)((((k >> 28) & 0xFFFFFFFFu) * (uint64_t)cap) >> 32);
}

static inline Py_ssize_t ht_home(Py_ssize_t cap, uint64_t h) { return (Py_ssize_t)(((h >> 32) * (uint64_t)cap) >> 32); }

static inline Py_ssize_t kt_find(const KTable *t, uint64_t k) {
    if (!t->live) return -1;
    Py_ssize_t s = kt_home(t->cap, k);
    for (;;) {
        uint64_t x = t->s[s].key;
        if (x == k) return s;
        if (x == EMPTY) return -1;
        if (++s == t->cap) s = 0;
    }
}

static inline Py_ssize_t ht_find(const HTable *t, uint64_t h) {
    if (!t->live) return -1;
    Py_ssize_t s = ht_home(t->cap, h);
    for (;;) {
        uint64_t x = t->s[s].h;
        if (x == h) return s;
        if (x == EMPTY) return -1;
        if (++s == t->cap) s = 0;
    }
}

/* tables.c */
static int kt_alloc(KTable *t, Py_ssize_t cap);
static int ht_alloc(HTable *t, Py_ssize_t cap);
static int kt_reserve(Core *c, KTable *t, Py_ssize_t more); /* room for `more` keys: a rehash, maybe without the GIL */
static int ht_reserve(Core *c, HTable *t, Py_ssize_t more);
static void kt_delete(KTable *t, Py_ssize_t hole);
static void ht_delete(HTable *t, Py_ssize_t hole);
static Py_ssize_t kt_claim(KTable *t, uint64_t k, int *fresh);

#endif

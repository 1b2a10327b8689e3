/* The Core object, the index's whole state: its tables (tables.h), slots and pods, holder bitmasks,
 * counters and the cursors of the background passes and of eviction. Every part that changes the index
 * takes a Core. */
#ifndef KVGATE_NATIVE_CORE_H
#define KVGATE_NATIVE_CORE_H

#include "tables.h"

/* One implementation for every fleet shape. A Core holds:
 * - per medium a key table: block key -> holders (the slots holding it there) and a recency stamp;
 * - per model a hash map: the engine's folded block hash -> block key;
 * - slots (one per (pod, rank), numbered from 0) grouped by pod, with per-slot and per-pod counts
 *   kept as they change (stats never scan).
 * Both tables are open addressing with linear probing and backward-shift deletion (no tombstones,
 * so no rebuild at a steady size). A key's holders fit in its 8-byte word while there are at most
 * four of them (16-bit slot numbers); more holders move to a bitmask of W words in a pool.
 * Slots are freed lazily: a cleared slot is dead at once (its entries uncounted, never a
 * candidate) and its holder marks are removed by the maintenance pass, a bounded amount of work
 * per call; its number is reused only after a pass started after its death has finished.
 * Recency stamps are uint32 ticks compared by age (tick - stamp, modulo 2**32); the maintenance
 * pass clamps ages at 2**30 so they never wrap. Eviction sweeps from a cursor, dropping keys
 * among those older than a threshold read off the stamps (exact on small tables, sampled on large
 * ones), spread evenly over the sweep (see evict_threshold). Every allocation goes through
 * PyMem_Raw* (tracemalloc counts it). The GIL is held throughout (a large rehash aside). */

#define MAX_SLOTS 0xFFF0                /* slot numbers fit the 16-bit fields (stored + 1) */

enum { SLOT_FREE = 0, SLOT_LIVE = 1, SLOT_DEAD = 2 };

struct Core {
    PyObject_HEAD
    KTable *media;
    int n_media;
    HTable *models;
    int n_models;
    /* slots */
    Py_ssize_t slot_cap; /* a multiple of 64: slot numbers below it */
    int W;               /* slot_cap / 64: words of a holder bitmask */
    int32_t *slot_group, *slot_next;
    uint8_t *slot_state;
    int64_t *slot_entries;
    uint64_t *live_bits, *dead_bits, *pass_bits;
    Py_ssize_t n_dead;
    /* groups (pods) */
    Py_ssize_t group_cap;
    int32_t *group_head;
    int64_t *group_blocks;
    uint8_t *group_state; /* 0 free, 1 live, 2 removed (freed once its slots are) */
    uint32_t *group_mark;
    uint32_t mark;
    /* holder bitmasks of keys with more than four holders: W words each */
    uint64_t *pool;
    Py_ssize_t pool_cap, pool_top, pool_live;
    int64_t pool_free;
    uint32_t *scratch; /* slot numbers, slot_cap of them */
    /* counters */
    int64_t entries, max_entries, evicted;
    uint32_t tick, maint_tick;
    /* maintenance pass */
    int m_table, pass_active;
    Py_ssize_t m_pos;
    /* eviction */
    int e_table, e_valid;
    Py_ssize_t e_pos, e_seen, e_cycle;
    int64_t e_progress;
    uint32_t e_age, e_tick;   /* this cycle's candidates: keys at least e_age old at tick e_tick */
    int64_t e_take, e_cand;   /* evict about e_take of every e_cand candidates met, evenly */
    int64_t e_acc, e_met;
    int e_exact, e_counted;   /* read every stamp next cycle; this cycle's e_cand is exact */
    uint64_t rng;
    /* orphaned engine hashes */
    int h_active, h_model;
    Py_ssize_t h_pos;
    int rehashing; /* a large table is being rehashed with the GIL released */
};

#endif

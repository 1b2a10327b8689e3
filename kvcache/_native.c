/* kvcache._native: the prefix index's tables and hot loops in C.
 *
 * - chain_keys: kvgate's block keys (see kvcache/blockkeys.py for the definition).
 * - Core: the index's tables (key tables per medium, engine-hash maps per model, slots and pods,
 *   counts, recency, eviction, background passes); kvcache/index.py is its only user and keeps
 *   names, logging and the per-pod answers. One implementation for every fleet shape.
 * - scan_batch / Core.apply_batch: one vLLM KV event batch (msgpack bytes) checked, then applied
 *   without building a Python object per event or per token id. Anything outside the common shape
 *   (see scan_batch) is declined, and the caller takes the general path (kvcache.wire.decode_batch
 *   + PrefixIndex.apply, which calls Core.store / Core.release), which handles and counts it.
 * - Core.match: the leading-run walk for a prompt (compute keys, probe, running AND of holders).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#define EMPTY UINT64_MAX
#define TOMB (UINT64_MAX - 1) /* folded engine hashes stay below it (index.py's _fold) */
#define KEY_MASK ((UINT64_C(1) << 60) - 1)
/* 2**64 / golden ratio, odd: the multiplier of the key chain and of the engine hash fold alike
 * (blockkeys.py's MULT, index.py's _MIX). */
#define GOLDEN UINT64_C(0x9E3779B97F4A7C15)
#define MAX_DEPTH 32

/* ---- block keys ------------------------------------------------------------------------ */

/* One block's token ids -> 64 bits. Multiply-xorshift per token, then a finaliser; the block
 * size is mixed in so blocks of different sizes never agree by construction. */
static inline uint64_t block_hash_step(uint64_t h, uint64_t t) {
    h ^= t;
    h *= UINT64_C(0xFF51AFD7ED558CCD);
    return h ^ (h >> 32);
}

static inline uint64_t block_hash_init(uint64_t bs) { return UINT64_C(0x243F6A8885A308D3) ^ bs; }

static inline uint64_t block_hash_final(uint64_t h) {
    h ^= h >> 29;
    h *= UINT64_C(0xC4CEB9FE1A85EC53);
    return h ^ (h >> 32);
}

static inline uint64_t chain(uint64_t parent, uint64_t bh) { return (parent * GOLDEN + bh) & KEY_MASK; }

/* A Python int token id as its 64 bits (two's complement for negatives); -1 and an exception
 * (TypeError, OverflowError) when it is no int in [-2**63, 2**64). */
static inline int token_bits(PyObject *o, uint64_t *out) {
    /* token ids are small ints: read one-digit ints directly (a third of the cost of a prompt's keys) */
#if PY_VERSION_HEX >= 0x030C0000
    if (PyLong_CheckExact(o) && PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        *out = (uint64_t)(int64_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
        return 0;
    }
#else
    if (PyLong_CheckExact(o) && Py_ABS(Py_SIZE(o)) <= 1) {
        int64_t v = (int64_t)((PyLongObject *)o)->ob_digit[0];
        *out = (uint64_t)(Py_SIZE(o) < 0 ? -v : v);
        return 0;
    }
#endif
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "token ids must be ints, got %.80s", Py_TYPE(o)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred()) return -1;
        *out = (uint64_t)v;
        return 0;
    }
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(o);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        *out = (uint64_t)u;
        return 0;
    }
    PyErr_SetString(PyExc_OverflowError, "token id below -2**63");
    return -1;
}

/* Token ids from a list or tuple of ints, or from a one-dimensional integer buffer (array.array,
 * numpy): the buffer path reads the ids without a Python int per token. */
typedef struct {
    PyObject *seq;
    PyObject **items;
    Py_buffer view;
    int is_buf, is_signed, itemsize;
    Py_ssize_t n;
} Tokens;

static int tokens_open(PyObject *o, Tokens *t) {
    memset(t, 0, sizeof *t);
    if (!PyList_Check(o) && !PyTuple_Check(o) && PyObject_CheckBuffer(o)) {
        if (PyObject_GetBuffer(o, &t->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
        const char *f = t->view.format ? t->view.format : "B";
        if (*f == '@' || *f == '=' || *f == '<') f++;
        int ok = t->view.ndim <= 1 && f[0] && !f[1] && strchr("bBhHiIlLqQ", f[0]) &&
                 (t->view.itemsize == 1 || t->view.itemsize == 2 || t->view.itemsize == 4 || t->view.itemsize == 8);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "token ids buffer must hold integers, got format %.20s", t->view.format);
            PyBuffer_Release(&t->view);
            return -1;
        }
        t->is_buf = 1;
        t->is_signed = f[0] >= 'a';
        t->itemsize = (int)t->view.itemsize;
        t->n = t->view.len / t->view.itemsize;
        return 0;
    }
    t->seq = PySequence_Fast(o, "token_ids must be a sequence");
    if (!t->seq) return -1;
    t->items = PySequence_Fast_ITEMS(t->seq);
    t->n = PySequence_Fast_GET_SIZE(t->seq);
    return 0;
}

static inline int tokens_get(const Tokens *t, Py_ssize_t i, uint64_t *out) {
    if (!t->is_buf) return token_bits(t->items[i], out);
    const char *p = (const char *)t->view.buf + i * t->itemsize;
    switch (t->itemsize) {
    case 1: *out = t->is_signed ? (uint64_t)(int64_t)*(const int8_t *)p : *(const uint8_t *)p; break;
    case 2: *out = t->is_signed ? (uint64_t)(int64_t)*(const int16_t *)p : *(const uint16_t *)p; break;
    case 4: *out = t->is_signed ? (uint64_t)(int64_t)*(const int32_t *)p : *(const uint32_t *)p; break;
    default: *out = *(const uint64_t *)p; break;
    }
    return 0;
}

static void tokens_close(Tokens *t) {
    if (t->is_buf) PyBuffer_Release(&t->view);
    Py_XDECREF(t->seq);
}

/* Block i of tk hashed (finalised): -1 with an exception at its first bad token id. */
static int block_hash_one(Tokens *tk, Py_ssize_t i, Py_ssize_t bs, uint64_t *out) {
    uint64_t h = block_hash_init((uint64_t)bs), t;
    for (Py_ssize_t j = 0; j < bs; j++) {
        if (tokens_get(tk, i * bs + j, &t) < 0) return -1;
        h = block_hash_step(h, t);
    }
    *out = block_hash_final(h);
    return 0;
}

/* The hashes (finalised) of blocks [0, n) of tk into out. One block's multiply chain waits on each
 * multiply (latency-bound); four blocks' chains interleaved keep four in flight, ~3x the rate
 * (chain_keys of a 1,724-token prompt: 6.5 -> 2.x us). A bad token id in a group of four is
 * reported as the sequential walk reports it: the group again, one block after another. */
static int block_hashes(Tokens *tk, Py_ssize_t n, Py_ssize_t bs, uint64_t *out) {
    const uint64_t init = block_hash_init((uint64_t)bs);
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        uint64_t h0 = init, h1 = init, h2 = init, h3 = init, t0, t1, t2, t3;
        const Py_ssize_t b0 = i * bs, b1 = b0 + bs, b2 = b1 + bs, b3 = b2 + bs;
        int bad = 0;
        for (Py_ssize_t j = 0; j < bs; j++) {
            if (tokens_get(tk, b0 + j, &t0) < 0 || tokens_get(tk, b1 + j, &t1) < 0 ||
                tokens_get(tk, b2 + j, &t2) < 0 || tokens_get(tk, b3 + j, &t3) < 0) {
                bad = 1;
                break;
            }
            h0 = block_hash_step(h0, t0);
            h1 = block_hash_step(h1, t1);
            h2 = block_hash_step(h2, t2);
            h3 = block_hash_step(h3, t3);
        }
        if (bad) {
            PyErr_Clear();
            for (Py_ssize_t b = i; b < i + 4; b++)
                if (block_hash_one(tk, b, bs, &out[b]) < 0) return -1;
            continue; /* unreachable in practice: the group holds a bad id */
        }
        out[i] = block_hash_final(h0);
        out[i + 1] = block_hash_final(h1);
        out[i + 2] = block_hash_final(h2);
        out[i + 3] = block_hash_final(h3);
    }
    for (; i < n; i++)
        if (block_hash_one(tk, i, bs, &out[i]) < 0) return -1;
    return 0;
}

/* chain_keys(parent: int, token_ids: Sequence[int], block_size: int) -> bytes
 * The keys (native uint64) of every full block of token_ids under the block keyed parent. */
static PyObject *py_chain_keys(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long parent;
    PyObject *tokens;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "KOn", &parent, &tokens, &bs)) return NULL;
    if (bs <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive, got %zd", bs);
        return NULL;
    }
    Tokens tk;
    if (tokens_open(tokens, &tk) < 0) return NULL;
    Py_ssize_t n = tk.n / bs;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!out) {
        tokens_close(&tk);
        return NULL;
    }
    uint64_t *keys = (uint64_t *)PyBytes_AS_STRING(out);
    if (block_hashes(&tk, n, bs, keys) < 0) {
        tokens_close(&tk);
        Py_DECREF(out);
        return NULL;
    }
    uint64_t k = parent;
    for (Py_ssize_t i = 0; i < n; i++) keys[i] = k = chain(k, keys[i]);
    tokens_close(&tk);
    return out;
}

/* ---- the index's tables ------------------------------------------------------------------
 *
 * One implementation for every fleet shape. A Core holds:
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

#define HOLD_OVF 0xFFFFu                /* first field of an overflow holder word */
#define MAX_SLOTS 0xFFF0                /* slot numbers fit the 16-bit fields (stored + 1) */
#define MAX_LOAD_NUM 3                  /* grow past 3/4 full ... */
#define MAX_LOAD_DEN 4
#define GROW_LOAD 0.55                  /* ... to 0.55 full */
#define MIN_CAP 64
#define AGE_CLAMP (UINT32_C(1) << 30)
#define EXACT_KEYS 65536                /* up to this many keys the eviction threshold is exact */
#define SAMPLES 4096
#define PASS_BUDGET 8192                /* key positions one maintenance call sweeps while dead slots wait */
#define ORPHAN_BUDGET 2048              /* engine-hash positions one call sweeps (each a probe: a cache miss) */

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

enum { SLOT_FREE = 0, SLOT_LIVE = 1, SLOT_DEAD = 2 };

typedef struct {
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
} Core;

/* ---- key table and hash map ---- */

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

static void kt_empty(KTable *t) {
    for (Py_ssize_t i = 0; i < t->cap; i++) t->s[i].key = EMPTY, t->s[i].hold = 0;
}

static void ht_empty(HTable *t) {
    for (Py_ssize_t i = 0; i < t->cap; i++) t->s[i].h = EMPTY, t->s[i].key = 0;
}

/* Tables are probed at random, far beyond the caches: on 4 KiB pages nearly every probe of a large
 * table also misses the TLB, and a page walk under a hypervisor's nested paging costs about as much
 * as the miss itself. Large tables ask for transparent huge pages; kernels set to `madvise` (a
 * common default) use them only where asked. Before the first touch, so the faults take them. */
#define HUGE_PAGE ((uintptr_t)2 << 20)
static void advise_huge(void *p, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    uintptr_t a = ((uintptr_t)p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), b = ((uintptr_t)p + n) & ~(HUGE_PAGE - 1);
    if (n >= 2 * HUGE_PAGE && b > a) (void)madvise((void *)a, b - a, MADV_HUGEPAGE); /* advice: failure is harmless */
#else
    (void)p, (void)n;
#endif
}

/* A table of `cap` slots; emptied unless `empty` is 0 (the caller empties it, e.g. without the GIL:
 * writing a large table's every page takes tens of ms). */
static int kt_alloc_as(KTable *t, Py_ssize_t cap, int empty) {
    KSlot *s = PyMem_RawMalloc(sizeof(KSlot) * cap);
    uint32_t *st = PyMem_RawCalloc(cap, sizeof(uint32_t));
    if (!s || !st) {
        PyMem_RawFree(s);
        PyMem_RawFree(st);
        PyErr_NoMemory();
        return -1;
    }
    advise_huge(s, sizeof(KSlot) * cap);
    advise_huge(st, sizeof(uint32_t) * cap);
    t->s = s;
    t->stamp = st;
    t->cap = cap;
    t->live = 0;
    if (empty) kt_empty(t);
    return 0;
}

static int kt_alloc(KTable *t, Py_ssize_t cap) { return kt_alloc_as(t, cap, 1); }

static int ht_alloc_as(HTable *t, Py_ssize_t cap, int empty) {
    HSlot *s = PyMem_RawMalloc(sizeof(HSlot) * cap);
    if (!s) {
        PyErr_NoMemory();
        return -1;
    }
    advise_huge(s, sizeof(HSlot) * cap);
    t->s = s;
    t->cap = cap;
    t->live = 0;
    if (empty) ht_empty(t);
    return 0;
}

static int ht_alloc(HTable *t, Py_ssize_t cap) { return ht_alloc_as(t, cap, 1); }

static inline Py_ssize_t grown_cap(Py_ssize_t live) {
    Py_ssize_t cap = (Py_ssize_t)(live / GROW_LOAD) + 1;
    return cap < MIN_CAP ? MIN_CAP : cap;
}

/* Tables at least this large are rehashed with the GIL released: a rehash of millions of keys takes
 * tens to hundreds of ms, which would hold every other thread of the process (the event loop serving
 * requests) meanwhile. The caller's lock keeps other threads out of the index itself; c->rehashing
 * turns a call that bypasses it into an error instead of a read of half-built tables. */
#define NOGIL_REHASH_CAP 65536

/* The GIL released for a large rehash (NULL: kept); rehash_end takes it back. */
static PyThreadState *rehash_begin(Core *c, int nogil) {
    if (!nogil) return NULL;
    c->rehashing = 1;
    return PyEval_SaveThread();
}

static void rehash_end(Core *c, PyThreadState *ts) {
    if (!ts) return;
    PyEval_RestoreThread(ts);
    c->rehashing = 0;
}

/* Room for `more` keys without passing the maximum load: a rehash into a larger table. */
static int kt_reserve(Core *c, KTable *t, Py_ssize_t more) {
    if ((t->live + more) * MAX_LOAD_DEN <= t->cap * MAX_LOAD_NUM) return 0;
    KTable old = *t;
    int nogil = old.cap >= NOGIL_REHASH_CAP;
    if (kt_alloc_as(t, grown_cap(old.live + more), !nogil) < 0) {
        *t = old;
        return -1;
    }
    t->used = old.used;
    PyThreadState *ts = rehash_begin(c, nogil);
    if (nogil) kt_empty(t);
    for (Py_ssize_t i = 0; i < old.cap; i++) {
        uint64_t k = old.s[i].key;
        if (k == EMPTY) continue;
        Py_ssize_t s = kt_home(t->cap, k);
        while (t->s[s].key != EMPTY)
            if (++s == t->cap) s = 0;
        t->s[s] = old.s[i];
        t->stamp[s] = old.stamp[i];
    }
    t->live = old.live;
    PyMem_RawFree(old.s); /* the raw domain needs no GIL */
    PyMem_RawFree(old.stamp);
    rehash_end(c, ts);
    return 0;
}

static int ht_reserve(Core *c, HTable *t, Py_ssize_t more) {
    if ((t->live + more) * MAX_LOAD_DEN <= t->cap * MAX_LOAD_NUM) return 0;
    HTable old = *t;
    int nogil = old.cap >= NOGIL_REHASH_CAP;
    if (ht_alloc_as(t, grown_cap(old.live + more), !nogil) < 0) {
        *t = old;
        return -1;
    }
    PyThreadState *ts = rehash_begin(c, nogil);
    if (nogil) ht_empty(t);
    for (Py_ssize_t i = 0; i < old.cap; i++) {
        uint64_t h = old.s[i].h;
        if (h == EMPTY) continue;
        Py_ssize_t s = ht_home(t->cap, h);
        while (t->s[s].h != EMPTY)
            if (++s == t->cap) s = 0;
        t->s[s] = old.s[i];
    }
    t->live = old.live;
    PyMem_RawFree(old.s);
    rehash_end(c, ts);
    return 0;
}

/* Is `home` cyclically in (hole, j]? Then the key at j cannot move back to the hole. */
static inline int stays(Py_ssize_t hole, Py_ssize_t j, Py_ssize_t home) {
    return hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
}

/* Backward-shift deletion: later keys of the probe run move back into the hole. */
static void kt_delete(KTable *t, Py_ssize_t hole) {
    Py_ssize_t j = hole;
    for (;;) {
        if (++j == t->cap) j = 0;
        uint64_t k = t->s[j].key;
        if (k == EMPTY) break;
        if (stays(hole, j, kt_home(t->cap, k))) continue;
        t->s[hole] = t->s[j];
        t->stamp[hole] = t->stamp[j];
        hole = j;
    }
    t->s[hole].key = EMPTY;
    t->s[hole].hold = 0;
    t->live--;
}

static void ht_delete(HTable *t, Py_ssize_t hole) {
    Py_ssize_t j = hole;
    for (;;) {
        if (++j == t->cap) j = 0;
        uint64_t h = t->s[j].h;
        if (h == EMPTY) break;
        if (stays(hole, j, ht_home(t->cap, h))) continue;
        t->s[hole] = t->s[j];
        hole = j;
    }
    t->s[hole].h = EMPTY;
    t->live--;
}

/* k's slot, inserted with no holders if absent (room reserved by the caller). */
static Py_ssize_t kt_claim(KTable *t, uint64_t k, int *fresh) {
    Py_ssize_t s = kt_home(t->cap, k);
    for (;;) {
        uint64_t x = t->s[s].key;
        if (x == k) {
            *fresh = 0;
            return s;
        }
        if (x == EMPTY) break;
        if (++s == t->cap) s = 0;
    }
    t->s[s].key = k;
    t->s[s].hold = 0;
    t->live++;
    *fresh = 1;
    return s;
}

/* ---- holders ---- */

static inline int hold_ovf(uint64_t h) { return (h & 0xFFFF) == HOLD_OVF; }

static inline uint64_t *hold_words(const Core *c, uint64_t h) { return c->pool + ((h >> 16) & 0xFFFFFFFFu) * c->W; }

static inline int bit_of(const uint64_t *w, Py_ssize_t s) { return (int)((w[s >> 6] >> (s & 63)) & 1); }

/* The holders' slot numbers into c->scratch; their count. */
static Py_ssize_t hold_list(const Core *c, uint64_t h) {
    Py_ssize_t n = 0;
    if (hold_ovf(h)) {
        const uint64_t *w = hold_words(c, h);
        for (int i = 0; i < c->W; i++)
            for (uint64_t b = w[i]; b; b &= b - 1) c->scratch[n++] = (uint32_t)(i * 64 + __builtin_ctzll(b));
        return n;
    }
    for (; h; h >>= 16) c->scratch[n++] = (uint32_t)(h & 0xFFFF) - 1;
    return n;
}

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

static int64_t pool_alloc(Core *c) {
    if (c->pool_free >= 0) {
        int64_t i = c->pool_free;
        c->pool_free = (int64_t)c->pool[i * c->W];
        c->pool_live++;
        return i;
    }
    if (c->pool_top == c->pool_cap) {
        Py_ssize_t cap = c->pool_cap ? 2 * c->pool_cap : 64;
        uint64_t *p = PyMem_RawRealloc(c->pool, sizeof(uint64_t) * c->W * cap);
        if (!p) {
            PyErr_NoMemory();
            return -1;
        }
        c->pool = p;
        c->pool_cap = cap;
    }
    c->pool_live++;
    return c->pool_top++;
}

static void pool_release(Core *c, int64_t i) {
    c->pool[i * c->W] = (uint64_t)c->pool_free;
    c->pool_free = i;
    c->pool_live--;
}

/* Adds `slot` to holder word *h: 1 if added, 0 if it held already, -1 on a failed allocation. */
static int hold_add(Core *c, uint64_t *h, uint32_t slot) {
    uint64_t x = *h;
    if (hold_ovf(x)) {
        uint64_t *w = hold_words(c, x);
        if (bit_of(w, slot)) return 0;
        w[slot >> 6] |= UINT64_C(1) << (slot & 63);
        return 1;
    }
    for (int i = 0; i < 4; i++) {
        uint64_t f = (x >> (16 * i)) & 0xFFFF;
        if (f == slot + 1) return 0;
        if (!f) {
            *h = x | ((uint64_t)(slot + 1) << (16 * i));
            return 1;
        }
    }
    int64_t i = pool_alloc(c); /* a fifth holder: to a bitmask */
    if (i < 0) return -1;
    uint64_t *w = c->pool + i * c->W;
    memset(w, 0, sizeof(uint64_t) * c->W);
    for (; x; x >>= 16) {
        uint32_t s = (uint32_t)(x & 0xFFFF) - 1;
        w[s >> 6] |= UINT64_C(1) << (s & 63);
    }
    w[slot >> 6] |= UINT64_C(1) << (slot & 63);
    *h = HOLD_OVF | ((uint64_t)i << 16);
    return 1;
}

/* Removes `slot` from *h: 1 if it held, else 0. Four or fewer holders left move back inline. */
static int hold_del(Core *c, uint64_t *h, uint32_t slot) {
    uint64_t x = *h;
    if (hold_ovf(x)) {
        uint64_t *w = hold_words(c, x);
        if (!bit_of(w, slot)) return 0;
        w[slot >> 6] &= ~(UINT64_C(1) << (slot & 63));
        int n = 0;
        for (int i = 0; i < c->W && n <= 4; i++) n += __builtin_popcountll(w[i]);
        if (n <= 4) {
            uint64_t y = 0;
            int f = 0;
            for (int i = 0; i < c->W; i++)
                for (uint64_t b = w[i]; b; b &= b - 1)
                    y |= (uint64_t)(i * 64 + __builtin_ctzll(b) + 1) << (16 * f++);
            pool_release(c, (int64_t)((x >> 16) & 0xFFFFFFFFu));
            *h = y;
        }
        return 1;
    }
    for (int i = 0; i < 4; i++) {
        uint64_t f = (x >> (16 * i)) & 0xFFFF;
        if (!f) return 0;
        if (f == slot + 1) {
            uint64_t low = (UINT64_C(1) << (16 * i)) - 1;
            *h = (x & low) | ((x >> 16) & ~low);
            return 1;
        }
    }
    return 0;
}

static void hold_free(Core *c, uint64_t h) {
    if (hold_ovf(h)) pool_release(c, (int64_t)((h >> 16) & 0xFFFFFFFFu));
}

/* Does any slot of group g hold the key whose holder word is h? */
static int hold_has_group(const Core *c, uint64_t h, int32_t g) {
    if (hold_ovf(h)) {
        const uint64_t *w = hold_words(c, h);
        for (int32_t s = c->group_head[g]; s >= 0; s = c->slot_next[s])
            if (bit_of(w, s)) return 1;
        return 0;
    }
    for (; h; h >>= 16)
        if (c->slot_group[(h & 0xFFFF) - 1] == g) return 1;
    return 0;
}

/* Does group g hold key k in any medium but `skip`? */
static int group_holds(const Core *c, uint64_t k, int32_t g, int skip) {
    for (int m = 0; m < c->n_media; m++) {
        if (m == skip || !c->media[m].used) continue;
        Py_ssize_t s = kt_find(&c->media[m], k);
        if (s >= 0 && hold_has_group(c, c->media[m].s[s].hold, g)) return 1;
    }
    return 0;
}

static int held_anywhere(const Core *c, uint64_t k) {
    for (int m = 0; m < c->n_media; m++)
        if (c->media[m].used && kt_find(&c->media[m], k) >= 0) return 1;
    return 0;
}

/* ---- entries ---- */

/* Medium m's key k gains holder `slot` (live), stamped: 1 if newly held, 0 if held, -1 on error. */
static int key_add(Core *c, int m, uint64_t k, uint32_t slot, uint32_t stamp) {
    KTable *t = &c->media[m];
    if (kt_reserve(c, t, 1) < 0) return -1;
    int fresh;
    Py_ssize_t s = kt_claim(t, k, &fresh);
    uint64_t h = t->s[s].hold;
    int32_t g = c->slot_group[slot];
    int had = !fresh && hold_has_group(c, h, g);
    if (!had && c->n_media > 1) had = group_holds(c, k, g, m);
    int r = hold_add(c, &h, slot);
    if (r < 0) {
        if (fresh) kt_delete(t, s);
        return -1;
    }
    t->s[s].hold = h;
    t->stamp[s] = stamp;
    if (r) {
        c->entries++;
        c->slot_entries[slot]++;
        if (!had) c->group_blocks[g]++;
    }
    return r;
}

/* `slot` no longer holds the key at position s of medium m: 1 if it held it, else 0; *freed when
 * the key had no other holder (it is deleted). */
static int key_del_at(Core *c, int m, Py_ssize_t s, uint32_t slot, int *freed) {
    KTable *t = &c->media[m];
    uint64_t h = t->s[s].hold, k = t->s[s].key;
    *freed = 0;
    if (!hold_del(c, &h, slot)) return 0;
    if (c->slot_state[slot] == SLOT_LIVE) {
        c->entries--;
        c->slot_entries[slot]--;
    }
    int32_t g = c->slot_group[slot];
    if (h) {
        t->s[s].hold = h;
    } else {
        kt_delete(t, s);
        *freed = 1;
    }
    if (!(h && hold_has_group(c, h, g)) && !group_holds(c, k, g, m)) c->group_blocks[g]--;
    return 1;
}

/* Drops the key at position s of medium m with all its holders (eviction); its live entries. */
static int64_t key_drop_at(Core *c, int m, Py_ssize_t s) {
    KTable *t = &c->media[m];
    uint64_t h = t->s[s].hold, k = t->s[s].key;
    Py_ssize_t n = hold_list(c, h);
    hold_free(c, h);
    kt_delete(t, s);
    int64_t gone = 0;
    uint32_t mark = ++c->mark;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t x = c->scratch[i];
        if (c->slot_state[x] == SLOT_LIVE) {
            gone++;
            c->slot_entries[x]--;
        }
        int32_t g = c->slot_group[x];
        if (c->group_mark[g] == mark) continue;
        c->group_mark[g] = mark;
        if (!group_holds(c, k, g, -1)) c->group_blocks[g]--;
    }
    c->entries -= gone;
    return gone;
}

enum { R_UNKNOWN = -2, R_NOT_HELD = -1, R_FREED = 0, R_STILL_HELD = 1 };

/* Engine hash h (folded) of `model` is no longer held by `slot` in medium m (-1: a medium with
 * no table). A freed key's hash entry goes too unless another medium still holds the key. */
static int release_one(Core *c, int model, int m, uint64_t h, uint32_t slot) {
    HTable *ht = &c->models[model];
    Py_ssize_t hs = ht_find(ht, h);
    if (hs < 0) return R_UNKNOWN;
    if (m < 0) return R_NOT_HELD;
    uint64_t k = ht->s[hs].key;
    Py_ssize_t s = kt_find(&c->media[m], k);
    int freed;
    if (s < 0 || !key_del_at(c, m, s, slot, &freed)) return R_NOT_HELD;
    if (!freed) return R_STILL_HELD;
    if (!held_anywhere(c, k)) ht_delete(ht, hs);
    return R_FREED;
}

/* Map engine hash h to key k for `model`, and k gains holder `slot` in medium m. */
static int store_pair(Core *c, int model, int m, uint64_t h, uint64_t k, uint32_t slot, uint32_t stamp) {
    HTable *ht = &c->models[model];
    if (ht_reserve(c, ht, 1) < 0) return -1;
    Py_ssize_t s = ht_home(ht->cap, h);
    for (;;) {
        uint64_t x = ht->s[s].h;
        if (x == h) break;
        if (x == EMPTY) {
            ht->s[s].h = h;
            ht->live++;
            break;
        }
        if (++s == ht->cap) s = 0;
    }
    ht->s[s].key = k;
    return key_add(c, m, k, slot, stamp);
}

static inline uint64_t fold(uint64_t h) {
    h *= GOLDEN;
    return h >= TOMB ? h - 2 : h;
}

/* ---- maintenance: dead slots, stamp ages, orphaned engine hashes ---- */

static Py_ssize_t total_cap(const Core *c) {
    Py_ssize_t n = 0;
    for (int m = 0; m < c->n_media; m++)
        if (c->media[m].used) n += c->media[m].cap;
    return n;
}

static int64_t total_keys(const Core *c) {
    int64_t n = 0;
    for (int m = 0; m < c->n_media; m++)
        if (c->media[m].used) n += c->media[m].live;
    return n;
}

static void slot_unlink(Core *c, int32_t s) {
    int32_t g = c->slot_group[s];
    int32_t *p = &c->group_head[g];
    while (*p != s) p = &c->slot_next[*p];
    *p = c->slot_next[s];
    if (c->group_head[g] < 0 && c->group_state[g] == 2) { /* a removed pod's last slot */
        c->group_state[g] = 0;
        c->group_blocks[g] = 0;
    }
    c->slot_group[s] = -1;
    c->slot_next[s] = -1;
    c->slot_state[s] = SLOT_FREE;
}

/* A pass over every table finished: the slots dead when it started are gone everywhere. */
static void pass_done(Core *c) {
    for (int i = 0; i < c->W; i++) {
        for (uint64_t b = c->pass_bits[i]; b; b &= b - 1) {
            int32_t s = i * 64 + __builtin_ctzll(b);
            slot_unlink(c, s);
            c->n_dead--;
        }
        c->dead_bits[i] &= ~c->pass_bits[i];
        c->pass_bits[i] = 0;
    }
    c->pass_active = 0;
}

/* Sweeps up to `budget` key-table positions from the pass cursor: dead holders out, ages clamped. */
static void pass_step(Core *c, Py_ssize_t budget) {
    while (budget > 0) {
        if (!c->pass_active) {
            c->pass_active = 1;
            c->m_table = 0;
            c->m_pos = 0;
            memcpy(c->pass_bits, c->dead_bits, sizeof(uint64_t) * c->W);
        }
        if (c->m_table >= c->n_media) {
            pass_done(c);
            if (!c->n_dead) return;
            continue;
        }
        KTable *t = &c->media[c->m_table];
        if (!t->used || c->m_pos >= t->cap) {
            c->m_table++;
            c->m_pos = 0;
            continue;
        }
        Py_ssize_t s = c->m_pos;
        budget--;
        uint64_t k = t->s[s].key;
        if (k == EMPTY) {
            c->m_pos++;
            continue;
        }
        if ((uint32_t)(c->tick - t->stamp[s]) > AGE_CLAMP) t->stamp[s] = c->tick - AGE_CLAMP;
        if (c->n_dead) {
            Py_ssize_t n = hold_list(c, t->s[s].hold);
            int freed = 0;
            for (Py_ssize_t i = 0; i < n && !freed; i++)
                if (c->slot_state[c->scratch[i]] == SLOT_DEAD) key_del_at(c, c->m_table, s, c->scratch[i], &freed);
            if (freed) continue; /* a later key moved into s: look at it too */
        }
        c->m_pos++;
    }
}

/* Deletes up to `budget` engine hashes whose key no medium holds. */
static void orphan_step(Core *c, Py_ssize_t budget) {
    while (budget > 0 && c->h_active) {
        if (c->h_model >= c->n_models) {
            c->h_active = 0;
            return;
        }
        HTable *ht = &c->models[c->h_model];
        if (c->h_pos >= ht->cap) {
            c->h_model++;
            c->h_pos = 0;
            continue;
        }
        budget--;
        HSlot *e = &ht->s[c->h_pos];
        if (e->h != EMPTY && !held_anywhere(c, e->key)) {
            ht_delete(ht, c->h_pos);
            continue;
        }
        c->h_pos++;
    }
}

/* ---- eviction ---- */

static uint32_t select_nth(uint32_t *a, Py_ssize_t n, Py_ssize_t k) { /* the k-th smallest (0-based) */
    Py_ssize_t lo = 0, hi = n - 1;
    while (lo < hi) {
        uint32_t p = a[lo + (hi - lo) / 2];
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < p) i++;
            while (a[j] > p) j--;
            if (i <= j) {
                uint32_t x = a[i];
                a[i++] = a[j];
                a[j--] = x;
            }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else return a[k];
    }
    return a[k];
}

static inline uint64_t next_rand(Core *c) {
    c->rng = c->rng * UINT64_C(6364136223846793005) + UINT64_C(1442695040888963407);
    return c->rng >> 17;
}

/* This cycle's candidates and how many of them to evict. Candidates are the keys at least e_age old
 * now (e_tick); keys stored or matched later never are, so the set only shrinks as the cursor
 * sweeps. The age is the take-th oldest key's, take = max(need, 1/32 of the keys): exact on small
 * tables (strictly older keys first while there are any), else read off sampled stamps. Many keys
 * can share that age (a long prefill is one event, one tick), so the sweep evicts take of every
 * e_cand candidates it meets, spread evenly: its deletions then spread over the table as the stores
 * spread theirs. (Dropping every candidate at the cursor made it crawl while the stores filled the
 * rest of the table into probe runs of tens of thousands of keys.) */
static int evict_threshold(Core *c, int64_t need) {
    int64_t keys = total_keys(c);
    Py_ssize_t cap = total_cap(c);
    int exact = keys <= EXACT_KEYS || c->e_exact;
    Py_ssize_t n = 0, want = exact ? (Py_ssize_t)keys : SAMPLES;
    uint32_t *ages = PyMem_RawMalloc(sizeof(uint32_t) * (want ? want : 1));
    if (!ages) {
        PyErr_NoMemory();
        return -1;
    }
    if (exact) {
        for (int m = 0; m < c->n_media; m++) {
            KTable *t = &c->media[m];
            if (!t->used) continue;
            for (Py_ssize_t s = 0; s < t->cap && n < want; s++)
                if (t->s[s].key != EMPTY) ages[n++] = c->tick - t->stamp[s];
        }
    } else {
        for (Py_ssize_t tries = 0; n < want && tries < 8 * SAMPLES; tries++) {
            Py_ssize_t g = (Py_ssize_t)(next_rand(c) % (uint64_t)cap);
            for (int m = 0; m < c->n_media; m++) {
                KTable *t = &c->media[m];
                if (!t->used) continue;
                if (g < t->cap) {
                    if (t->s[g].key != EMPTY) ages[n++] = c->tick - t->stamp[g];
                    break;
                }
                g -= t->cap;
            }
        }
    }
    c->e_tick = c->tick;
    c->e_acc = c->e_met = 0;
    c->e_counted = exact;
    if (!n) {
        PyMem_RawFree(ages);
        c->e_age = 0;
        c->e_take = c->e_cand = 1;
        return 0;
    }
    Py_ssize_t take;
    if (exact) {
        take = need > n / 32 ? (need < n ? (Py_ssize_t)need : n) : n / 32;
    } else {
        double q = (double)need / (double)(keys ? keys : 1);
        if (q < 1.0 / 32) q = 1.0 / 32;
        take = (Py_ssize_t)(q * n) + 1;
        if (take > n) take = n;
    }
    if (take < 1) take = 1;
    uint32_t age = select_nth(ages, n, n - take); /* the take-th largest */
    Py_ssize_t older = 0, ties = 0;
    for (Py_ssize_t i = 0; i < n; i++) older += ages[i] > age, ties += ages[i] == age;
    Py_ssize_t cand = older + ties;
    if (exact && older && age < UINT32_MAX) {
        age++;
        cand = older;
    }
    PyMem_RawFree(ages);
    c->e_age = age;
    c->e_take = take < cand ? take : cand;
    c->e_cand = cand;
    return 0;
}

/* Evicts keys until the entries are within the bound. */
static int evict(Core *c) {
    while (c->entries > c->max_entries) {
        if (!total_keys(c)) { /* cannot happen while the counts are right; never spin */
            c->entries = 0;
            break;
        }
        if (!c->e_valid || c->e_seen >= c->e_cycle) {
            if (c->e_valid && !c->e_progress) c->e_exact = 1; /* a whole sweep found nothing: read every stamp */
            if (evict_threshold(c, c->entries - c->max_entries) < 0) return -1;
            c->e_valid = 1;
            c->e_seen = 0;
            c->e_cycle = total_cap(c);
            c->e_progress = 0;
        }
        if (c->e_table >= c->n_media) {
            c->e_table = 0;
            c->e_pos = 0;
        }
        KTable *t = &c->media[c->e_table];
        if (!t->used || c->e_pos >= t->cap) {
            c->e_table++;
            c->e_pos = 0;
            continue;
        }
        c->e_seen++;
        Py_ssize_t s = c->e_pos;
        uint64_t since = (uint32_t)(c->tick - c->e_tick);
        if (t->s[s].key != EMPTY && (uint32_t)(c->tick - t->stamp[s]) >= since + c->e_age) {
            int drop = (c->e_acc += c->e_take) >= c->e_cand;
            if (drop) c->e_acc -= c->e_cand;
            if (c->e_counted && ++c->e_met >= c->e_cand) c->e_seen = c->e_cycle; /* every candidate met */
            if (drop) {
                int64_t gone = key_drop_at(c, c->e_table, s);
                c->evicted += gone;
                c->e_progress += 1;
                continue; /* a later key may have moved into s */
            }
        }
        c->e_pos++;
    }
    if (c->e_progress && c->e_exact) c->e_exact = 0;
    return 0;
}
/* ---- msgpack reading ------------------------------------------------------------------------ */

typedef struct {
    const uint8_t *p, *end;
} Reader;

/* Every reader returns 0 on success, -1 when the bytes are not what the fast path accepts
 * (the caller then declines the whole batch). */

static inline int need(Reader *r, size_t n) { return (size_t)(r->end - r->p) >= n ? 0 : -1; }

static inline uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

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

static inline int str_is(const char *s, uint32_t n, const char *lit) {
    return strlen(lit) == n && memcmp(s, lit, n) == 0;
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

static int skip_opt_str(Reader *r) {
    const char *s;
    uint32_t n;
    return is_nil(r) ? 0 : rd_str(r, &s, &n);
}

static int skip_opt_int(Reader *r) {
    uint64_t v;
    return is_nil(r) ? 0 : rd_int(r, &v);
}

/* nil, or an array skipped whole */
static int skip_opt_array(Reader *r) {
    uint32_t n;
    if (is_nil(r)) return 0;
    const uint8_t *at = r->p;
    if (rd_array(r, &n)) return -1;
    r->p = at;
    return skip(r, 0);
}

/* nil or 0: KV cache group 0, the only one indexed */
static int rd_group(Reader *r) {
    uint64_t v;
    if (is_nil(r)) return 0;
    if (rd_int(r, &v) || v != 0) return -1;
    return 0;
}

/* ---- events ------------------------------------------------------------------------------- */

typedef struct {
    /* batch summary (scan) */
    Py_ssize_t stored_events, stored_blocks, removed_events, removed_blocks;
    int64_t block_size; /* 0 until a BlockStored */
    const char *medium; /* shared by every event of the batch; nil and "" read as "GPU" */
    uint32_t medium_len;
    int medium_seen;
    /* apply */
    int applying;
    Core *c;
    int model, mid; /* mid -1: removals in a medium without a table */
    uint32_t slot;
    uint64_t root;
    PyObject *loras; /* scan: the set of LoRA keys of chain-starting stores (NULL in a run: see roots) */
    PyObject *roots; /* apply, and a run's scan: LoRA key -> root key */
    Py_ssize_t added, removed, unknown_parent, unknown_removed;
    /* a run's one-pass apply of a one-event batch (apply_run): the medium (mid -2 until then) and
     * the block size are checked at the event, before it changes anything; what the run cannot
     * take (an unknown medium for stores, another block size, a LoRA key without a root) declines
     * without an error; a batch of several events sets `several` and is left alone */
    int one_pass, several;
    PyObject *media;
    int64_t expect_bs;
} Batch;

static int medium_in(PyObject *media, const char *s, uint32_t n, long *id);

/* One pass: resolve the batch's medium at its only event; 0, or -1 to decline (an error set if any). */
static int one_pass_medium(Batch *b, int stores) {
    if (b->mid != -2) return 0;
    long mid;
    if (medium_in(b->media, b->medium ? b->medium : "GPU", b->medium ? b->medium_len : 3, &mid)) return -1;
    if (stores && (mid < 0 || b->block_size != b->expect_bs)) return -1; /* Python learns them first */
    if (mid < -1 || mid >= b->c->n_media || (mid >= 0 && !b->c->media[mid].used)) {
        PyErr_SetString(PyExc_ValueError, "apply_run: bad medium id");
        return -1;
    }
    b->mid = (int)mid;
    return 0;
}

static const uint8_t NIL_BYTE[1] = {0xc0};

/* Every event of a batch must name the same medium (nil and absent count as nil). */
static int rd_medium(Reader *r, Batch *b) {
    const char *s = NULL;
    uint32_t n = 0;
    if (!is_nil(r) && rd_str(r, &s, &n)) return -1;
    if (s == NULL || n == 0) { /* nil and "" both mean GPU (the index's default medium) */
        s = "GPU";
        n = 3;
    }
    if (!b->medium_seen) {
        b->medium_seen = 1;
        b->medium = s;
        b->medium_len = n;
        return 0;
    }
    if (n != b->medium_len || memcmp(s, b->medium, n)) return -1;
    return 0;
}

/* Fields of a BlockStored, wherever they sit in the bytes. */
typedef struct {
    Reader hashes, tokens;
    uint32_t n_hashes, n_tokens;
    int has_parent;
    uint64_t parent;
    uint64_t block_size;
    const char *lora_name; /* NULL: nil or absent */
    uint32_t lora_name_len;
    int has_lora_id;
    int64_t lora_id;
} Stored;

/* A block hash: an int (its 64 bits), or bin bytes (a digest) read as their last 8 bytes,
 * big-endian: the int vLLM publishes by default for the same digest (index.py's _bytes_hash). */
static int rd_hash(Reader *r, uint64_t *v) {
    if (need(r, 1)) return -1;
    uint8_t b = *r->p;
    if (b < 0xc4 || b > 0xc6) return rd_int(r, v);
    int w = b == 0xc4 ? 1 : b == 0xc5 ? 2 : 4;
    if (need(r, 1 + w)) return -1;
    size_t len = be(r->p + 1, w);
    if (need(r, 1 + w + len)) return -1;
    const uint8_t *data = r->p + 1 + w;
    size_t take = len < 8 ? len : 8;
    *v = be(data + len - take, (int)take);
    r->p += 1 + w + len;
    return 0;
}

static int rd_hash_array(Reader *r, Reader *at, uint32_t *n) {
    uint64_t v;
    if (rd_array(r, n)) return -1;
    *at = *r;
    for (uint32_t i = 0; i < *n; i++)
        if (rd_hash(r, &v)) return -1;
    return 0;
}

static int rd_tokens(Reader *r, Stored *st) {
    uint64_t v;
    if (rd_array(r, &st->n_tokens)) return -1;
    st->tokens = *r;
    for (uint32_t i = 0; i < st->n_tokens; i++)
        if (rd_int(r, &v)) return -1;
    return 0;
}

static int rd_parent(Reader *r, Stored *st) {
    if (is_nil(r)) {
        st->has_parent = 0;
        return 0;
    }
    st->has_parent = 1;
    return rd_hash(r, &st->parent);
}

static int rd_lora_name(Reader *r, Stored *st) {
    st->lora_name = NULL;
    return is_nil(r) ? 0 : rd_str(r, &st->lora_name, &st->lora_name_len);
}

static int rd_lora_id(Reader *r, Stored *st) {
    uint64_t v;
    st->has_lora_id = 0;
    if (is_nil(r)) return 0;
    if (!need(r, 2) && *r->p == 0xcf && (r->p[1] & 0x80)) return -1; /* above 2**63: the general path */
    if (rd_int(r, &v)) return -1;
    st->has_lora_id = 1;
    st->lora_id = (int64_t)v;
    return 0;
}

/* The LoRA key of a chain-starting store, as index.py's _root names it: the adapter's name, else
 * "#lora_id=N" (vLLM before 0.14), else none (the base model). Scanning collects the keys (a run's
 * scan, without a set, declines a key missing from `roots`); applying looks up their root keys
 * (computed in Python). -2: a Python error. */
static int chain_root(Batch *b, const Stored *st, uint64_t *root) {
    if (!st->lora_name && !st->has_lora_id) {
        *root = b->root;
        return 0;
    }
    PyObject *key = st->lora_name ? PyUnicode_DecodeASCII(st->lora_name, st->lora_name_len, NULL)
                                  : PyUnicode_FromFormat("#lora_id=%lld", (long long)st->lora_id);
    if (!key) return -2;
    int rc = 0;
    if (!b->applying && b->loras) {
        rc = PySet_Add(b->loras, key) < 0 ? -2 : 0;
    } else {
        PyObject *v = PyDict_GetItemWithError(b->roots, key);
        if (!v) {
            if (PyErr_Occurred()) rc = -2;
            else if (!b->applying || b->one_pass) rc = -1; /* a run: a key the caller has no root for yet */
            else {
                PyErr_SetObject(PyExc_KeyError, key);
                rc = -2;
            }
        } else {
            *root = PyLong_AsUnsignedLongLong(v);
            rc = PyErr_Occurred() ? -2 : 0;
        }
    }
    Py_DECREF(key);
    return rc;
}

static int rd_block_size(Reader *r, Stored *st) {
    if (rd_int(r, &st->block_size)) return -1;
    return st->block_size == 0 || st->block_size > (1u << 20) ? -1 : 0; /* also rejects negatives */
}

static int do_stored(Batch *b, Stored *st) {
    if (st->n_hashes == 0 || (uint64_t)st->n_tokens != (uint64_t)st->n_hashes * st->block_size) return -1;
    if (b->block_size && (uint64_t)b->block_size != st->block_size) return -1;
    b->block_size = (int64_t)st->block_size;
    b->stored_events++;
    b->stored_blocks += st->n_hashes;
    uint64_t k = 0;
    if (!st->has_parent && chain_root(b, st, &k)) return -1;
    if (!b->applying) return 0;
    if (b->one_pass && one_pass_medium(b, 1)) return -1;
    if (b->mid < 0) {
        PyErr_SetString(PyExc_ValueError, "apply_batch: stores need a medium table");
        return -1;
    }
    if (st->has_parent) {
        HTable *ht = &b->c->models[b->model];
        Py_ssize_t s = ht_find(ht, fold(st->parent));
        if (s < 0) { /* its chain is unknown: never guess a chain start */
            b->unknown_parent += st->n_hashes;
            return 0;
        }
        k = ht->s[s].key;
    }
    uint32_t tick = ++b->c->tick;
    Reader hr = st->hashes, tr = st->tokens;
    uint64_t bs = st->block_size, h, t;
    for (uint32_t i = 0; i < st->n_hashes; i++) {
        uint64_t bh = block_hash_init(bs);
        for (uint64_t j = 0; j < bs; j++) {
            rd_int(&tr, &t);
            bh = block_hash_step(bh, t);
        }
        k = chain(k, block_hash_final(bh));
        rd_hash(&hr, &h);
        int r = store_pair(b->c, b->model, b->mid, fold(h), k, b->slot, tick);
        if (r < 0) return -1;
        b->added += r;
    }
    return 0;
}

static int do_removed(Batch *b, Reader hashes, uint32_t n) {
    b->removed_events++;
    b->removed_blocks += n;
    if (!b->applying) return 0;
    if (b->one_pass && one_pass_medium(b, 0)) return -1;
    uint64_t h;
    for (uint32_t i = 0; i < n; i++) {
        rd_hash(&hashes, &h);
        int res = release_one(b->c, b->model, b->mid, fold(h), b->slot);
        if (res >= R_FREED) b->removed++;
        else if (res == R_UNKNOWN) b->unknown_removed++;
    }
    return 0;
}

/* ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys,
 *  group_idx, kind, window] with 4 to 11 fields after the tag (vLLM <= 0.23) */
static int stored_array(Reader *r, Batch *b, uint32_t fields) {
    Stored st = {0};
    if (fields < 4 || fields > 11) return -1;
    if (rd_hash_array(r, &st.hashes, &st.n_hashes) || rd_parent(r, &st) || rd_tokens(r, &st) ||
        rd_block_size(r, &st))
        return -1;
    uint32_t f = 4;
    int medium_read = 0;
    for (; f < fields; f++) {
        switch (f) {
        case 4: if (rd_lora_id(r, &st)) return -1; break;
        case 5: if (rd_medium(r, b)) return -1; medium_read = 1; break;
        case 6: if (rd_lora_name(r, &st)) return -1; break;
        case 7: if (skip_opt_array(r)) return -1; break;    /* extra_keys */
        case 8: if (rd_group(r)) return -1; break;
        case 9: if (skip_opt_str(r)) return -1; break;
        case 10: if (skip_opt_int(r)) return -1; break;
        }
    }
    if (!medium_read) {
        Reader none = {NIL_BYTE, NIL_BYTE + 1};
        if (rd_medium(&none, b)) return -1;
    }
    return do_stored(b, &st);
}

static int removed_array(Reader *r, Batch *b, uint32_t fields) {
    Reader hashes;
    uint32_t n;
    if (fields < 1 || fields > 3) return -1;
    if (rd_hash_array(r, &hashes, &n)) return -1;
    if (fields >= 2) {
        if (rd_medium(r, b)) return -1;
    } else {
        Reader none = {NIL_BYTE, NIL_BYTE + 1};
        if (rd_medium(&none, b)) return -1;
    }
    if (fields >= 3 && rd_group(r)) return -1;
    return do_removed(b, hashes, n);
}

enum {
    F_TYPE = 1, F_HASHES = 2, F_PARENT = 4, F_TOKENS = 8, F_BS = 16, F_LORA_ID = 32, F_MEDIUM = 64,
    F_LORA_NAME = 128, F_EXTRA = 256, F_GROUP = 512, F_KIND = 1024, F_WINDOW = 2048,
    /* known to the decoder, not modelled: any value */
    F_LOCALITY = 4096, F_OWNERSHIP = 8192, F_SESSION = 16384, F_LOOKAHEAD = 32768
};

/* A map event: {"type": tag, ...}; the tag is read first or later, fields are parsed as found.
 * Known fields the index ignores (locality, ownership, session_id, lookahead_token_ids) are
 * skipped; any other key declines the batch (the general path counts it). */
static int map_event(Reader *r, Batch *b, uint32_t pairs) {
    Stored st = {0};
    int seen = 0, tag = 0; /* 1 stored, 2 removed */
    Reader medium_at = {NULL, NULL};
    for (uint32_t i = 0; i < pairs; i++) {
        const char *key;
        uint32_t kn;
        if (rd_str(r, &key, &kn)) return -1;
        int f;
        if (str_is(key, kn, "type")) f = F_TYPE;
        else if (str_is(key, kn, "block_hashes")) f = F_HASHES;
        else if (str_is(key, kn, "parent_block_hash")) f = F_PARENT;
        else if (str_is(key, kn, "token_ids")) f = F_TOKENS;
        else if (str_is(key, kn, "block_size")) f = F_BS;
        else if (str_is(key, kn, "lora_id")) f = F_LORA_ID;
        else if (str_is(key, kn, "medium")) f = F_MEDIUM;
        else if (str_is(key, kn, "lora_name")) f = F_LORA_NAME;
        else if (str_is(key, kn, "extra_keys")) f = F_EXTRA;
        else if (str_is(key, kn, "group_idx")) f = F_GROUP;
        else if (str_is(key, kn, "kv_cache_spec_kind")) f = F_KIND;
        else if (str_is(key, kn, "kv_cache_spec_sliding_window")) f = F_WINDOW;
        else if (str_is(key, kn, "locality")) f = F_LOCALITY;
        else if (str_is(key, kn, "ownership")) f = F_OWNERSHIP;
        else if (str_is(key, kn, "session_id")) f = F_SESSION;
        else if (str_is(key, kn, "lookahead_token_ids")) f = F_LOOKAHEAD;
        else return -1;
        if (seen & f) return -1; /* a repeated key */
        seen |= f;
        switch (f) {
        case F_TYPE: {
            const char *s;
            uint32_t n;
            if (rd_str(r, &s, &n)) return -1;
            if (str_is(s, n, "BlockStored")) tag = 1;
            else if (str_is(s, n, "BlockRemoved")) tag = 2;
            else return -1;
            break;
        }
        case F_HASHES: if (rd_hash_array(r, &st.hashes, &st.n_hashes)) return -1; break;
        case F_PARENT: if (rd_parent(r, &st)) return -1; break;
        case F_TOKENS: if (rd_tokens(r, &st)) return -1; break;
        case F_BS: if (rd_block_size(r, &st)) return -1; break;
        case F_LORA_ID: if (rd_lora_id(r, &st)) return -1; break;
        case F_LORA_NAME: if (rd_lora_name(r, &st)) return -1; break;
        case F_MEDIUM: {
            const char *s;
            uint32_t n;
            medium_at = *r;
            if (!is_nil(r) && rd_str(r, &s, &n)) return -1;
            break;
        }
        case F_EXTRA: if (skip_opt_array(r)) return -1; break;
        case F_GROUP: if (rd_group(r)) return -1; break;
        case F_KIND: if (skip_opt_str(r)) return -1; break;
        case F_WINDOW: if (skip_opt_int(r)) return -1; break;
        default: if (skip(r, 0)) return -1;
        }
    }
    Reader none = {NIL_BYTE, NIL_BYTE + 1};
    if (rd_medium(medium_at.p ? &medium_at : &none, b)) return -1;
    if (tag == 1) {
        /* every known key may appear in a BlockStored: only the required ones are checked */
        if ((seen & (F_HASHES | F_TOKENS | F_BS)) != (F_HASHES | F_TOKENS | F_BS)) return -1;
        if (!(seen & F_PARENT)) st.has_parent = 0;
        return do_stored(b, &st);
    }
    if (tag == 2) {
        if (!(seen & F_HASHES) || (seen & ~(F_TYPE | F_HASHES | F_MEDIUM | F_GROUP | F_LOCALITY | F_OWNERSHIP)))
            return -1;
        return do_removed(b, st.hashes, st.n_hashes);
    }
    return -1;
}

static int event(Reader *r, Batch *b) {
    uint32_t n;
    if (at_map(r)) {
        if (rd_map(r, &n)) return -1;
        return map_event(r, b, n);
    }
    if (rd_array(r, &n) || n == 0) return -1;
    const char *s;
    uint32_t sn;
    if (rd_str(r, &s, &sn)) return -1;
    if (str_is(s, sn, "BlockStored")) return stored_array(r, b, n - 1);
    if (str_is(s, sn, "BlockRemoved")) return removed_array(r, b, n - 1);
    return -1;
}

/* [ts, events(, rank, ...)] or {"ts": ..., "events": ..., "data_parallel_rank": ...} */
/* The envelope of a batch (vLLM's EventBatch, map or array form): `events` left at its events array's
 * header. -1: not a batch in the fast path's envelope. */
static int envelope(const char *data, Py_ssize_t len, Reader *out) {
    Reader r = {(const uint8_t *)data, (const uint8_t *)data + len};
    Reader events = {NULL, NULL};
    uint32_t n;
    if (at_map(&r)) {
        if (rd_map(&r, &n)) return -1;
        int seen = 0;
        for (uint32_t i = 0; i < n; i++) {
            const char *key;
            uint32_t kn;
            if (rd_str(&r, &key, &kn)) return -1;
            if (str_is(key, kn, "ts")) {
                uint64_t v;
                if (seen & 1 || (rd_float(&r) && rd_int(&r, &v))) return -1;
                seen |= 1;
            } else if (str_is(key, kn, "events")) {
                if (seen & 2) return -1;
                events = r;
                if (skip(&r, 0)) return -1;
                seen |= 2;
            } else if (str_is(key, kn, "data_parallel_rank")) {
                if (seen & 4 || skip_opt_int(&r)) return -1;
                seen |= 4;
            } else if (skip(&r, 0)) {
                return -1;
            }
        }
        if ((seen & 3) != 3) return -1;
    } else {
        uint64_t v;
        if (rd_array(&r, &n) || n < 2) return -1;
        if (rd_float(&r) && rd_int(&r, &v)) return -1;
        events = r;
        if (skip(&r, 0)) return -1;
        if (n > 2 && skip_opt_int(&r)) return -1;
        for (uint32_t i = 3; i < n; i++)
            if (skip(&r, 0)) return -1;
    }
    if (r.p != r.end) return -1; /* trailing bytes: msgpack's decoder rejects the batch */
    *out = events;
    return 0;
}

static int batch(const char *data, Py_ssize_t len, Batch *b) {
    Reader events;
    uint32_t n;
    if (envelope(data, len, &events)) return -1;
    if (rd_array(&events, &n)) return -1;
    if (b->one_pass && n != 1) { /* a later event could decline after an earlier one changed the tables */
        b->several = 1;
        return -1;
    }
    for (uint32_t i = 0; i < n; i++)
        if (event(&events, b)) return -1;
    return 0;
}

/* scan_batch(payload) -> None | (stored_events, stored_blocks, removed_events, removed_blocks,
 *                                 block_size, medium, LoRA keys of chain-starting stores)
 * None: the batch is not in the fast path's shape (or not valid), take the general path.
 * Fast path shape: BlockStored and BlockRemoved events only, int or bin block hashes, ASCII LoRA names, KV cache
 * group 0, one medium and one block size for the whole batch, no unknown fields, ASCII strs. */
static PyObject *py_scan_batch(PyObject *Py_UNUSED(self), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Batch b;
    memset(&b, 0, sizeof b);
    b.loras = PySet_New(NULL);
    if (!b.loras) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int rc = batch(view.buf, view.len, &b);
    PyObject *out;
    if (rc) {
        PyErr_Clear(); /* a failed allocation while scanning only declines the batch */
        out = Py_NewRef(Py_None);
    } else {
        PyObject *medium = b.medium ? PyUnicode_DecodeASCII(b.medium, b.medium_len, NULL) : Py_NewRef(Py_None);
        out = medium ? Py_BuildValue("nnnnLNO", b.stored_events, b.stored_blocks, b.removed_events,
                                     b.removed_blocks, (long long)b.block_size, medium, b.loras)
                     : NULL;
    }
    Py_DECREF(b.loras);
    PyBuffer_Release(&view);
    return out;
}

/* ---- cutting a batch (split_batch) ---------------------------------------------------------- */

typedef struct {
    uint8_t *p;
    Py_ssize_t len, cap;
} Buf;

static int buf_put(Buf *b, const void *src, Py_ssize_t n) {
    if (b->len + n > b->cap) {
        Py_ssize_t cap = b->cap ? b->cap : 1024;
        while (cap < b->len + n) cap *= 2;
        uint8_t *p = PyMem_RawRealloc(b->p, (size_t)cap);
        if (!p) {
            PyErr_NoMemory();
            return -1;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, src, (size_t)n);
    b->len += n;
    return 0;
}

/* The shortest msgpack array header (fix 0x90, m16 0xdc) of n entries, into h; its length. */
static Py_ssize_t array_header(uint8_t h[5], uint32_t n) {
    if (n < 16) {
        h[0] = (uint8_t)(0x90 | n);
        return 1;
    }
    if (n <= 0xFFFF) {
        h[0] = 0xdc;
        h[1] = (uint8_t)(n >> 8);
        h[2] = (uint8_t)n;
        return 3;
    }
    h[0] = 0xdd;
    h[1] = (uint8_t)(n >> 24);
    h[2] = (uint8_t)(n >> 16);
    h[3] = (uint8_t)(n >> 8);
    h[4] = (uint8_t)n;
    return 5;
}

static int buf_array(Buf *b, uint32_t n) {
    uint8_t h[5];
    return buf_put(b, h, array_header(h, n));
}

/* A piece of the batch's events array: buf's bytes [off, off + len), holding `blocks` blocks. */
typedef struct {
    Py_ssize_t off, len, blocks;
} Unit;

typedef struct {
    Unit *u;
    Py_ssize_t n, cap;
} Units;

static int units_add(Units *us, Py_ssize_t off, Py_ssize_t len, Py_ssize_t blocks) {
    if (us->n == us->cap) {
        Py_ssize_t cap = us->cap ? 2 * us->cap : 64;
        Unit *u = PyMem_RawRealloc(us->u, sizeof *u * (size_t)cap);
        if (!u) {
            PyErr_NoMemory();
            return -1;
        }
        us->u = u;
        us->cap = cap;
    }
    us->u[us->n++] = (Unit){off, len, blocks};
    return 0;
}

/* One field of an event a cut rewrites: its value's bytes [at, end) and which it is. */
enum { CUT_HASHES, CUT_PARENT, CUT_TOKENS };
typedef struct {
    const uint8_t *at, *end;
    int kind;
} CutField;

/* Cuts the event at [p, end), one the fast path accepts (scanned whole before), into events of at
 * most max_blocks blocks each, appended to buf and us in order: a BlockStored's block hashes and
 * their tokens cut at the same block, each piece after the first chained to the block before it
 * (its parent: that block's hash, as the engine wrote it), every other field as it was; a
 * BlockRemoved's hashes cut. Applying the pieces in order is applying the event (one recency tick
 * each instead of one for all). 1: left whole (a field the cut would have to split that it does
 * not model: extra_keys or lookahead_token_ids set, or a map-form store without parent_block_hash);
 * 0: cut; -1: a Python error. */
static int cut_event(const uint8_t *p, const uint8_t *end, Py_ssize_t max_blocks, Buf *buf, Units *us) {
    Reader r = {p, end};
    CutField f[3];
    int nf = 0, stored = 0, removed = 0;
    uint64_t bs = 0;
    uint32_t n, fields;
    const char *s;
    if (at_map(&r)) {
        if (rd_map(&r, &fields)) return 1;
        for (uint32_t i = 0; i < fields; i++) {
            if (rd_str(&r, &s, &n)) return 1;
            const uint8_t *at = r.p;
            int kind = -1;
            if (str_is(s, n, "type")) {
                if (rd_str(&r, &s, &n)) return 1;
                stored = str_is(s, n, "BlockStored");
                removed = str_is(s, n, "BlockRemoved");
                continue;
            } else if (str_is(s, n, "block_hashes")) {
                kind = CUT_HASHES;
            } else if (str_is(s, n, "parent_block_hash")) {
                kind = CUT_PARENT;
            } else if (str_is(s, n, "token_ids")) {
                kind = CUT_TOKENS;
            } else if (str_is(s, n, "block_size")) {
                if (rd_int(&r, &bs)) return 1;
                continue;
            } else if ((str_is(s, n, "extra_keys") || str_is(s, n, "lookahead_token_ids")) && *at != 0xc0) {
                return 1;
            }
            if (skip(&r, 0)) return 1;
            if (kind >= 0 && nf < 3) f[nf++] = (CutField){at, r.p, kind};
        }
    } else {
        if (rd_array(&r, &fields) || rd_str(&r, &s, &n)) return 1;
        stored = str_is(s, n, "BlockStored");
        removed = str_is(s, n, "BlockRemoved");
        for (uint32_t i = 1; i < fields; i++) { /* stores: hashes, parent, tokens, block_size, ... */
            const uint8_t *at = r.p;
            if (stored && i == 4 && rd_int(&r, &bs)) return 1;
            if (stored && i == 8 && *at != 0xc0) return 1; /* extra_keys */
            if (!(stored && i == 4) && skip(&r, 0)) return 1;
            if (i == 1) f[nf++] = (CutField){at, r.p, CUT_HASHES};
            else if (stored && i == 2) f[nf++] = (CutField){at, r.p, CUT_PARENT};
            else if (stored && i == 3) f[nf++] = (CutField){at, r.p, CUT_TOKENS};
        }
    }
    if (!(stored ? nf == 3 && bs : removed && nf == 1)) return 1;
    for (int i = 1; i < nf; i++) /* by position: the map form may order them any way */
        for (int j = i; j > 0 && f[j].at < f[j - 1].at; j--) {
            CutField t = f[j];
            f[j] = f[j - 1];
            f[j - 1] = t;
        }
    const uint8_t *hashes = NULL, *tokens = NULL, *parent = NULL, *parent_end = NULL;
    for (int i = 0; i < nf; i++) {
        if (f[i].kind == CUT_HASHES) hashes = f[i].at;
        else if (f[i].kind == CUT_TOKENS) tokens = f[i].at;
        else parent = f[i].at, parent_end = f[i].end;
    }
    /* the hashes' element starts (n + 1) and the tokens' at each block's first (n + 1) */
    Reader h = {hashes, end}, t = {tokens, end};
    uint32_t nt = 0;
    if (rd_array(&h, &n) || (stored && (rd_array(&t, &nt) || (uint64_t)nt != (uint64_t)n * bs))) return 1;
    const uint8_t **hs = PyMem_RawMalloc(sizeof *hs * ((size_t)n + 1) * (stored ? 2 : 1));
    if (!hs) {
        PyErr_NoMemory();
        return -1;
    }
    const uint8_t **ts = hs + n + 1;
    int rc = 0;
    for (uint32_t i = 0; i < n && !rc; i++) {
        hs[i] = h.p;
        rc = skip(&h, 0);
    }
    hs[n] = h.p;
    for (uint32_t i = 0; stored && i < n && !rc; i++) {
        ts[i] = t.p;
        for (uint64_t j = 0; j < bs && !rc; j++) rc = skip(&t, 0);
    }
    if (stored) ts[n] = t.p;
    if (rc) {
        PyMem_RawFree(hs);
        return 1;
    }
    for (uint32_t i = 0; i < n && !rc; i += (uint32_t)max_blocks) {
        uint32_t j = n - i > (uint64_t)max_blocks ? i + (uint32_t)max_blocks : n;
        Py_ssize_t off = buf->len;
        const uint8_t *from = p;
        for (int k = 0; k < nf && !rc; k++) {
            rc = buf_put(buf, from, f[k].at - from);
            if (rc) break;
            if (f[k].kind == CUT_HASHES) {
                rc = buf_array(buf, j - i) || buf_put(buf, hs[i], hs[j] - hs[i]);
            } else if (f[k].kind == CUT_TOKENS) {
                rc = buf_array(buf, (uint32_t)((j - i) * bs)) || buf_put(buf, ts[i], ts[j] - ts[i]);
            } else {
                rc = i ? buf_put(buf, hs[i - 1], hs[i] - hs[i - 1]) : buf_put(buf, parent, parent_end - parent);
            }
            from = f[k].end;
        }
        if (!rc) rc = buf_put(buf, from, end - from) || units_add(us, off, buf->len - off, j - i);
    }
    PyMem_RawFree(hs);
    return rc ? -1 : 0;
}

/* split_batch(payload, max_blocks) -> None | [payload, ...]
 * A batch scan_batch accepts, cut into batches of at most `max_blocks` blocks stored and removed,
 * each the same envelope (timestamp, rank) around its events, in order: cut between events, and an
 * event of more than max_blocks blocks cut into pieces of at most that many (cut_event; one it
 * leaves whole is a part of its own). None when it is not in the fast path's shape or already
 * within the bound. Applying the parts in order is applying the batch; the subscriber applies them
 * one hold of the index lock each, so that one large batch does not hold the request path. */
static PyObject *py_split_batch(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer view;
    Py_ssize_t max_blocks;
    if (!PyArg_ParseTuple(args, "y*n", &view, &max_blocks)) return NULL;
    PyObject *out = NULL;
    Buf buf = {0};
    Units us = {0};
    Batch b;
    memset(&b, 0, sizeof b);
    b.loras = PySet_New(NULL);
    if (!b.loras) goto done;
    Reader events;
    uint32_t n = 0;
    const uint8_t *data = view.buf, *end = data + view.len, *head = NULL;
    int whole = max_blocks < 1 || batch(view.buf, view.len, &b) || b.stored_blocks + b.removed_blocks <= max_blocks
                || envelope(view.buf, view.len, &events);
    if (!whole) {
        head = events.p;
        whole = rd_array(&events, &n) || n < 1;
    }
    for (uint32_t i = 0; i < n && !whole; i++) { /* scanned whole above: cannot fail */
        Batch one;
        memset(&one, 0, sizeof one);
        one.loras = b.loras;
        Reader probe = events;
        const uint8_t *at = events.p;
        whole = event(&probe, &one) || skip(&events, 0);
        Py_ssize_t blocks = one.stored_blocks + one.removed_blocks;
        int rc = whole || blocks <= max_blocks ? 1 : cut_event(at, events.p, max_blocks, &buf, &us);
        if (rc < 0) goto done;
        if (rc && !whole) {
            Py_ssize_t off = buf.len;
            if (buf_put(&buf, at, events.p - at) || units_add(&us, off, events.p - at, blocks)) goto done;
        }
    }
    if (whole || us.n < 2) { /* declined (a failed allocation while scanning too): the caller applies it whole */
        PyErr_Clear();
        out = Py_NewRef(Py_None);
        goto done;
    }
    out = PyList_New(0);
    if (!out) goto done;
    Py_ssize_t before = head - data, after = end - events.p;
    for (Py_ssize_t i = 0, j; i < us.n; i = j) {
        Py_ssize_t sum = us.u[i].blocks, body = us.u[i].len;
        for (j = i + 1; j < us.n && sum + us.u[j].blocks <= max_blocks; j++) sum += us.u[j].blocks, body += us.u[j].len;
        uint8_t hdr[5];
        Py_ssize_t hn = array_header(hdr, (uint32_t)(j - i));
        PyObject *part = PyBytes_FromStringAndSize(NULL, before + hn + body + after);
        if (!part) {
            Py_CLEAR(out);
            goto done;
        }
        char *w = PyBytes_AS_STRING(part);
        memcpy(w, data, (size_t)before);
        memcpy(w + before, hdr, (size_t)hn);
        memcpy(w + before + hn, buf.p + us.u[i].off, (size_t)body); /* units i..j are adjacent in buf */
        memcpy(w + before + hn + body, events.p, (size_t)after);
        int failed = PyList_Append(out, part) < 0;
        Py_DECREF(part);
        if (failed) {
            Py_CLEAR(out);
            goto done;
        }
    }
done:
    PyMem_RawFree(buf.p);
    PyMem_RawFree(us.u);
    Py_XDECREF(b.loras);
    PyBuffer_Release(&view);
    return out;
}

/* ---- ZMTP frames (kvcache/zmtp.py) ------------------------------------------------------------ */

/* zmtp_split(buffer, pos, end, limit, max_frame) -> (messages, pos)
 * The complete messages in buffer[pos:end] of a ZMTP 3 connection past its handshake, at most `limit`:
 * one of three frames whose second has 8 bytes as (seq, payload) (a live KV event batch: topic, seq,
 * payload), any other as a list of its frames. Stops before a command frame that starts a message (the
 * caller handles it) and before an incomplete message; pos is where it stopped. ValueError for a frame
 * of more than max_frame bytes or a command inside a message. One call per wake-up and engine instead of
 * a Python loop per frame. */
static PyObject *py_zmtp_split(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *obj;
    Py_ssize_t pos, end, limit;
    unsigned long long max_frame;
    if (!PyArg_ParseTuple(args, "OnnnK", &obj, &pos, &end, &limit, &max_frame)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *out = NULL, *item = NULL;
    if (pos < 0 || pos > end || end > view.len) {
        PyErr_SetString(PyExc_ValueError, "zmtp_split: bad range");
        goto done;
    }
    const uint8_t *b = view.buf;
    out = PyList_New(0);
    if (!out) goto done;
    while (PyList_GET_SIZE(out) < limit) {
        Py_ssize_t p = pos, start[3] = {0, 0, 0};
        uint64_t size[3] = {0, 0, 0};
        int frames = 0, complete = 0;
        for (;;) {
            if (end - p < 2) break;
            uint8_t flags = b[p];
            uint64_t n;
            Py_ssize_t head;
            if (flags & 0x02) {
                if (end - p < 9) break;
                n = be(b + p + 1, 8);
                head = 9;
            } else {
                n = b[p + 1];
                head = 2;
            }
            if (n > max_frame) {
                PyErr_Format(PyExc_ValueError, "frame of %llu bytes", (unsigned long long)n);
                goto fail;
            }
            if (flags & 0x04) {
                if (frames) {
                    PyErr_SetString(PyExc_ValueError, "command inside a message");
                    goto fail;
                }
                break; /* the caller's */
            }
            if ((uint64_t)(end - p - head) < n) break;
            if (frames < 3) {
                start[frames] = p + head;
                size[frames] = n;
            }
            frames++;
            p += head + (Py_ssize_t)n;
            if (!(flags & 0x01)) {
                complete = 1;
                break;
            }
        }
        if (!complete) break;
        if (frames == 3 && size[1] == 8) {
            item = Py_BuildValue("(Ky#)", (unsigned long long)be(b + start[1], 8), (const char *)b + start[2],
                                 (Py_ssize_t)size[2]);
        } else { /* walk it again, keeping every frame */
            item = PyList_New(0);
            for (Py_ssize_t q = pos; item && q < p;) {
                uint64_t n = (b[q] & 0x02) ? be(b + q + 1, 8) : b[q + 1];
                Py_ssize_t head = (b[q] & 0x02) ? 9 : 2;
                PyObject *frame = PyBytes_FromStringAndSize((const char *)b + q + head, (Py_ssize_t)n);
                if (!frame || PyList_Append(item, frame) < 0) Py_CLEAR(item);
                Py_XDECREF(frame);
                q += head + (Py_ssize_t)n;
            }
        }
        if (!item || PyList_Append(out, item) < 0) goto fail;
        Py_CLEAR(item);
        pos = p;
    }
    PyObject *res = Py_BuildValue("(Nn)", out, pos);
    out = res;
    goto done;
fail:
    Py_XDECREF(item);
    Py_CLEAR(out);
done:
    PyBuffer_Release(&view);
    return out;
}

/* ---- the Core type ------------------------------------------------------------------------ */

static int as_int(PyObject *o, int *out) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "an id out of range");
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int grow_slots(Core *c, Py_ssize_t cap) {
    int W = (int)(cap / 64), oldW = c->W;
    Py_ssize_t old = c->slot_cap;
#define GROW(field, type)                                                               \
    do {                                                                                \
        type *p = PyMem_RawRealloc(c->field, sizeof(type) * (size_t)cap);               \
        if (!p) return PyErr_NoMemory(), -1;                                            \
        c->field = p;                                                                   \
    } while (0)
    GROW(slot_group, int32_t);
    GROW(slot_next, int32_t);
    GROW(slot_state, uint8_t);
    GROW(slot_entries, int64_t);
    GROW(scratch, uint32_t);
#undef GROW
    for (Py_ssize_t s = old; s < cap; s++) {
        c->slot_group[s] = -1;
        c->slot_next[s] = -1;
        c->slot_state[s] = SLOT_FREE;
        c->slot_entries[s] = 0;
    }
    uint64_t **bits[3] = {&c->live_bits, &c->dead_bits, &c->pass_bits};
    for (int i = 0; i < 3; i++) {
        uint64_t *p = PyMem_RawRealloc(*bits[i], sizeof(uint64_t) * W);
        if (!p) return PyErr_NoMemory(), -1;
        memset(p + oldW, 0, sizeof(uint64_t) * (W - oldW));
        *bits[i] = p;
    }
    if (c->pool_cap) { /* every holder bitmask to the new width */
        uint64_t *p = PyMem_RawCalloc((size_t)c->pool_cap * W, sizeof(uint64_t));
        if (!p) return PyErr_NoMemory(), -1;
        for (Py_ssize_t i = 0; i < c->pool_top; i++) memcpy(p + i * W, c->pool + i * oldW, sizeof(uint64_t) * oldW);
        PyMem_RawFree(c->pool);
        c->pool = p;
    }
    c->slot_cap = cap;
    c->W = W;
    return 0;
}

static int core_init(Core *c, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"max_entries", NULL};
    long long max_entries;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L", kwlist, &max_entries)) return -1;
    if (max_entries <= 0) {
        PyErr_Format(PyExc_ValueError, "max_entries must be positive, got %lld", max_entries);
        return -1;
    }
    if (c->slot_cap) {
        PyErr_SetString(PyExc_RuntimeError, "Core is initialised once");
        return -1;
    }
    c->max_entries = max_entries;
    c->pool_free = -1;
    c->rng = 0x853C49E6748FEA9Bu;
    return grow_slots(c, 64);
}

static void core_dealloc(Core *c) {
    for (int m = 0; m < c->n_media; m++) {
        PyMem_RawFree(c->media[m].s);
        PyMem_RawFree(c->media[m].stamp);
    }
    for (int m = 0; m < c->n_models; m++) PyMem_RawFree(c->models[m].s);
    void *arrays[] = {c->media, c->models, c->slot_group, c->slot_next, c->slot_state, c->slot_entries,
                      c->live_bits, c->dead_bits, c->pass_bits, c->group_head, c->group_blocks, c->group_state,
                      c->group_mark, c->pool, c->scratch};
    for (size_t i = 0; i < sizeof arrays / sizeof *arrays; i++) PyMem_RawFree(arrays[i]);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int arg_medium(Core *c, int m, int allow_none) {
    if ((allow_none && m == -1) || (m >= 0 && m < c->n_media && c->media[m].used)) return 0;
    PyErr_Format(PyExc_ValueError, "no medium table %d", m);
    return -1;
}

static int arg_model(Core *c, int m) {
    if (m >= 0 && m < c->n_models) return 0;
    PyErr_Format(PyExc_ValueError, "no model %d", m);
    return -1;
}

static int arg_slot(Core *c, long s) {
    if (s >= 0 && s < c->slot_cap && c->slot_state[s] == SLOT_LIVE) return 0;
    PyErr_Format(PyExc_ValueError, "no live slot %ld", s);
    return -1;
}

/* new_medium() -> id: an empty key table (ids of freed ones are reused) */
/* Every method of Core starts with this: a call from another thread while a large rehash runs with
 * the GIL released (kt_reserve) is an error, not a read of half-built tables. */
#define CORE_ENTER(c)                                                                            \
    do {                                                                                         \
        if ((c)->rehashing) {                                                                    \
            PyErr_SetString(PyExc_RuntimeError,                                                  \
                            "prefix index: called from two threads at once (hold one lock)");    \
            return NULL;                                                                         \
        }                                                                                        \
    } while (0)

static PyObject *core_new_medium(Core *c, PyObject *Py_UNUSED(ignored)) {
    CORE_ENTER(c);
    int m = 0;
    while (m < c->n_media && c->media[m].used) m++;
    if (m == c->n_media) {
        KTable *p = PyMem_RawRealloc(c->media, sizeof(KTable) * (m + 1));
        if (!p) return PyErr_NoMemory();
        c->media = p;
        memset(&p[m], 0, sizeof(KTable));
        c->n_media++;
    }
    if (kt_alloc(&c->media[m], MIN_CAP) < 0) return NULL;
    c->media[m].used = 1;
    return PyLong_FromLong(m);
}

/* free_medium(id): drop an empty medium table */
static PyObject *core_free_medium(Core *c, PyObject *arg) {
    CORE_ENTER(c);
    int m;
    if (as_int(arg, &m) || arg_medium(c, m, 0)) return NULL;
    if (c->media[m].live) return PyErr_Format(PyExc_ValueError, "medium table %d is not empty", m);
    PyMem_RawFree(c->media[m].s);
    PyMem_RawFree(c->media[m].stamp);
    memset(&c->media[m], 0, sizeof(KTable));
    Py_RETURN_NONE;
}

/* new_model() -> id: an empty engine-hash map */
static PyObject *core_new_model(Core *c, PyObject *Py_UNUSED(ignored)) {
    CORE_ENTER(c);
    HTable *p = PyMem_RawRealloc(c->models, sizeof(HTable) * (c->n_models + 1));
    if (!p) return PyErr_NoMemory();
    c->models = p;
    if (ht_alloc(&p[c->n_models], MIN_CAP) < 0) return NULL;
    return PyLong_FromLong(c->n_models++);
}

/* new_group() -> id: a pod */
static PyObject *core_new_group(Core *c, PyObject *Py_UNUSED(ignored)) {
    CORE_ENTER(c);
    Py_ssize_t g = 0;
    while (g < c->group_cap && c->group_state[g]) g++;
    if (g == c->group_cap) {
        Py_ssize_t cap = c->group_cap ? 2 * c->group_cap : 64;
        int32_t *head = PyMem_RawRealloc(c->group_head, sizeof(int32_t) * cap);
        if (head) c->group_head = head;
        int64_t *blocks = PyMem_RawRealloc(c->group_blocks, sizeof(int64_t) * cap);
        if (blocks) c->group_blocks = blocks;
        uint8_t *state = PyMem_RawRealloc(c->group_state, cap);
        if (state) c->group_state = state;
        uint32_t *mark = PyMem_RawRealloc(c->group_mark, sizeof(uint32_t) * cap);
        if (mark) c->group_mark = mark;
        if (!head || !blocks || !state || !mark) return PyErr_NoMemory();
        for (Py_ssize_t i = c->group_cap; i < cap; i++) {
            c->group_head[i] = -1;
            c->group_blocks[i] = 0;
            c->group_state[i] = 0;
            c->group_mark[i] = 0;
        }
        c->group_cap = cap;
    }
    c->group_state[g] = 1;
    c->group_head[g] = -1;
    c->group_blocks[g] = 0;
    return PyLong_FromSsize_t(g);
}

static void kill_slot(Core *c, int32_t s) {
    c->entries -= c->slot_entries[s];
    c->slot_entries[s] = 0;
    c->slot_state[s] = SLOT_DEAD;
    c->live_bits[s >> 6] &= ~(UINT64_C(1) << (s & 63));
    c->dead_bits[s >> 6] |= UINT64_C(1) << (s & 63);
    c->n_dead++;
}

/* new_slot(group) -> id: the lowest free slot number */
static PyObject *core_new_slot(Core *c, PyObject *arg) {
    CORE_ENTER(c);
    Py_ssize_t g = PyLong_AsSsize_t(arg);
    if (g == -1 && PyErr_Occurred()) return NULL;
    if (g < 0 || g >= c->group_cap || c->group_state[g] != 1) return PyErr_Format(PyExc_ValueError, "no group %zd", g);
    Py_ssize_t s = 0;
    while (s < c->slot_cap && c->slot_state[s] != SLOT_FREE) s++;
    if (s >= MAX_SLOTS) return PyErr_Format(PyExc_OverflowError, "more than %d pod-ranks", MAX_SLOTS);
    if (s == c->slot_cap && grow_slots(c, 2 * c->slot_cap) < 0) return NULL;
    c->slot_state[s] = SLOT_LIVE;
    c->slot_group[s] = (int32_t)g;
    c->slot_next[s] = c->group_head[g];
    c->group_head[g] = (int32_t)s;
    c->slot_entries[s] = 0;
    c->live_bits[s >> 6] |= UINT64_C(1) << (s & 63);
    return PyLong_FromSsize_t(s);
}

/* kill_slot(id): the slot holds nothing from now on (its marks go in the background) */
static PyObject *core_kill_slot(Core *c, PyObject *arg) {
    CORE_ENTER(c);
    long s = PyLong_AsLong(arg);
    if ((s == -1 && PyErr_Occurred()) || arg_slot(c, s)) return NULL;
    kill_slot(c, (int32_t)s);
    Py_RETURN_NONE;
}

/* remove_group(id): kill its slots; the id is reused once they are gone */
static PyObject *core_remove_group(Core *c, PyObject *arg) {
    CORE_ENTER(c);
    Py_ssize_t g = PyLong_AsSsize_t(arg);
    if (g == -1 && PyErr_Occurred()) return NULL;
    if (g < 0 || g >= c->group_cap || c->group_state[g] != 1) return PyErr_Format(PyExc_ValueError, "no group %zd", g);
    for (int32_t s = c->group_head[g]; s >= 0; s = c->slot_next[s])
        if (c->slot_state[s] == SLOT_LIVE) kill_slot(c, s);
    c->group_state[g] = 2;
    if (c->group_head[g] < 0) {
        c->group_state[g] = 0;
        c->group_blocks[g] = 0;
    }
    Py_RETURN_NONE;
}

/* key_of(model, folded_hash) -> key | None */
static PyObject *core_key_of(Core *c, PyObject *args) {
    CORE_ENTER(c);
    int model;
    unsigned long long h;
    if (!PyArg_ParseTuple(args, "iK", &model, &h) || arg_model(c, model)) return NULL;
    Py_ssize_t s = ht_find(&c->models[model], h);
    if (s < 0) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(c->models[model].s[s].key);
}

/* store(model, medium, slot, folded_hashes, keys) -> entries added
 * One BlockStored's blocks (native uint64 bytes, pairwise), stamped with one new tick. */
static PyObject *core_store(Core *c, PyObject *args) {
    CORE_ENTER(c);
    int model, m;
    long slot;
    Py_buffer hv, kv;
    if (!PyArg_ParseTuple(args, "iily*y*", &model, &m, &slot, &hv, &kv)) return NULL;
    PyObject *out = NULL;
    if (arg_model(c, model) || arg_medium(c, m, 0) || arg_slot(c, slot)) goto done;
    if (hv.len != kv.len || hv.len % 8) {
        PyErr_SetString(PyExc_ValueError, "store: as many hashes as keys, uint64 each");
        goto done;
    }
    Py_ssize_t n = hv.len / 8, added = 0;
    uint32_t tick = ++c->tick;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h, k;
        memcpy(&h, (char *)hv.buf + 8 * i, 8);
        memcpy(&k, (char *)kv.buf + 8 * i, 8);
        int r = store_pair(c, model, m, h, k & KEY_MASK, (uint32_t)slot, tick);
        if (r < 0) goto done;
        added += r;
    }
    out = PyLong_FromSsize_t(added);
done:
    PyBuffer_Release(&hv);
    PyBuffer_Release(&kv);
    return out;
}

/* release(model, medium, slot, folded_hashes) -> (entries removed, hashes unknown)
 * medium -1: a medium without a table (only unknown hashes are counted). */
static PyObject *core_release(Core *c, PyObject *args) {
    CORE_ENTER(c);
    int model, m;
    long slot;
    Py_buffer hv;
    if (!PyArg_ParseTuple(args, "iily*", &model, &m, &slot, &hv)) return NULL;
    PyObject *out = NULL;
    if (arg_model(c, model) || arg_medium(c, m, 1) || arg_slot(c, slot)) goto done;
    if (hv.len % 8) {
        PyErr_SetString(PyExc_ValueError, "release: uint64 hashes");
        goto done;
    }
    Py_ssize_t removed = 0, unknown = 0;
    for (Py_ssize_t i = 0; i < hv.len / 8; i++) {
        uint64_t h;
        memcpy(&h, (char *)hv.buf + 8 * i, 8);
        int r = release_one(c, model, m, h, (uint32_t)slot);
        if (r >= R_FREED) removed++;
        else if (r == R_UNKNOWN) unknown++;
    }
    out = Py_BuildValue("nn", removed, unknown);
done:
    PyBuffer_Release(&hv);
    return out;
}

/* apply_batch(payload, model, medium, slot, root, roots)
 *   -> (entries added, entries removed, unknown-parent blocks, unknown removed blocks)
 * Applies a batch scan_batch accepted (medium -1: a removals-only batch in a medium without a
 * table); `roots` maps each LoRA key scan_batch listed to its root key. */
static PyObject *core_apply_batch(Core *c, PyObject *args) {
    CORE_ENTER(c);
    Py_buffer payload;
    int model, m;
    long slot;
    unsigned long long root;
    PyObject *roots;
    if (!PyArg_ParseTuple(args, "y*iilKO!", &payload, &model, &m, &slot, &root, &PyDict_Type, &roots)) return NULL;
    PyObject *out = NULL;
    if (arg_model(c, model) || arg_medium(c, m, 1) || arg_slot(c, slot)) goto done;
    Batch b;
    memset(&b, 0, sizeof b);
    b.applying = 1;
    b.c = c;
    b.model = model;
    b.mid = m;
    b.slot = (uint32_t)slot;
    b.root = root;
    b.roots = roots;
    if (batch(payload.buf, payload.len, &b)) {
        if (!PyErr_Occurred()) /* scan_batch accepted these bytes: only a changed buffer gets here */
            PyErr_SetString(PyExc_ValueError, "apply_batch: payload is not in the fast path's shape (scan it first)");
        goto done;
    }
    out = Py_BuildValue("nnnn", b.added, b.removed, b.unknown_parent, b.unknown_removed);
done:
    PyBuffer_Release(&payload);
    return out;
}

/* A bounded step of the background passes (dead slots' marks, stamp ages, engine hashes nobody's
 * key uses): once per hold of the caller's lock, since its budgets are per call. */
static void passes(Core *c) {
    Py_ssize_t cap = total_cap(c);
    Py_ssize_t budget = c->n_dead ? PASS_BUDGET
                                  : (Py_ssize_t)(((uint64_t)(uint32_t)(c->tick - c->maint_tick) * (uint64_t)cap) >> 22) + 16;
    c->maint_tick = c->tick;
    pass_step(c, budget);
    if (!c->h_active) {
        int64_t hashes = 0;
        for (int i = 0; i < c->n_models; i++) hashes += c->models[i].live;
        int64_t keys = total_keys(c);
        if (hashes > keys + keys / 4 + 4096) {
            c->h_active = 1;
            c->h_model = 0;
            c->h_pos = 0;
        }
    }
    if (c->h_active) orphan_step(c, ORPHAN_BUDGET);
}

/* maintain(): evict down to the bound, then a step of the passes. Call after every batch. */
static int maintain(Core *c) {
    if (evict(c) < 0) return -1;
    passes(c);
    return 0;
}

static PyObject *core_maintain(Core *c, PyObject *Py_UNUSED(ignored)) {
    CORE_ENTER(c);
    if (maintain(c)) return NULL;
    Py_RETURN_NONE;
}

/* The id of the medium named s[:n] in `media` (name -> id, index.py's _media); -1 if absent. */
static int medium_in(PyObject *media, const char *s, uint32_t n, long *id) {
    PyObject *k, *v;
    Py_ssize_t pos = 0, kn;
    *id = -1;
    while (PyDict_Next(media, &pos, &k, &v)) {
        if (!PyUnicode_Check(k)) continue;
        const char *ks = PyUnicode_AsUTF8AndSize(k, &kn);
        if (!ks) return -1;
        if ((uint64_t)kn == n && !memcmp(ks, s, n)) {
            *id = PyLong_AsLong(v);
            return *id == -1 && PyErr_Occurred() ? -1 : 0;
        }
    }
    return 0;
}

/* The pending exception as an object (a new reference), cleared. */
static PyObject *fetch_error(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value && tb) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value ? value : Py_NewRef(PyExc_MemoryError);
}

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The blocks a batch of one event in vLLM's array envelope ([ts, [event], ...]) stores or removes,
 * read off the event's headers (an array event's, or a map event's up to its block_hashes: vLLM
 * writes it second); -1 in another shape (the caller then learns the count once the batch is
 * applied). Nothing is validated: the apply that follows does. */
static Py_ssize_t peek_blocks(const char *data, Py_ssize_t len) {
    Reader r = {(const uint8_t *)data, (const uint8_t *)data + len};
    uint32_t n, fields;
    uint64_t v;
    const char *s;
    if (rd_array(&r, &n) || n < 2 || (rd_float(&r) && rd_int(&r, &v)) || rd_array(&r, &n) || n != 1) return -1;
    if (at_map(&r)) {
        if (rd_map(&r, &fields)) return -1;
        for (uint32_t i = 0; i < fields; i++) {
            if (rd_str(&r, &s, &n)) return -1;
            if (str_is(s, n, "block_hashes")) return rd_array(&r, &n) ? -1 : (Py_ssize_t)n;
            if (skip(&r, 0)) return -1;
        }
        return -1;
    }
    if (rd_array(&r, &fields) || fields < 2 || rd_str(&r, &s, &n)) return -1;
    if (!str_is(s, n, "BlockStored") && !str_is(s, n, "BlockRemoved")) return -1;
    return rd_array(&r, &n) ? -1 : (Py_ssize_t)n;
}

/* apply_run(messages, start, seq, model, slot, root, block_size, media, roots, max_batches, max_events,
 *           bounds, counts, max_blocks=0)
 *   -> (batches, stored events, removed events, unknown-parent blocks, unknown removed blocks, seconds,
 *       error | None)
 * A subscriber's live batches without a Python call each: applies messages[start:] (a list of
 * (seq, payload) pairs, kvcache/zmtp.py's) one by one, each as scan_batch + apply_batch + evict
 * would (the background passes once, after the last), while the next one is the pair of seq `seq`
 * + the batches applied so far and in the fast path's shape with nothing for Python to add: its
 * stores in a medium of `media` (name -> id) and of `block_size`, their LoRA keys in `roots`
 * (removals in another medium go to medium -1, as apply_payload does). Stops before the first
 * other message, after max_batches batches, once max_events events are applied, and (max_blocks
 * > 0) before a batch holding more than max_blocks blocks, even the first (the caller cuts it,
 * split_batch), or one that would take the blocks stored and removed in this call past max_blocks:
 * one call is one hold of the caller's lock, and this bounds it (a one-event batch outside vLLM's
 * array envelope is counted once applied). Each batch's decode-and-apply time (s) is counted into
 * counts (int64 buffer, len(bounds) + 1) at bisect_left(bounds (doubles), time). A batch that fails
 * (no memory while applying) ends the run: `error` is its exception, the batch is not counted in
 * `batches`, and what it changed stays (as with apply_batch). */
static PyObject *core_apply_run(Core *c, PyObject *args) {
    CORE_ENTER(c);
    PyObject *msgs, *media, *roots;
    Py_ssize_t start, block_size, max_batches, max_events, max_blocks = 0;
    unsigned long long seq, root;
    int model;
    long slot;
    Py_buffer bounds, counts;
    if (!PyArg_ParseTuple(args, "O!nKilKnO!O!nny*w*|n", &PyList_Type, &msgs, &start, &seq, &model, &slot, &root,
                          &block_size, &PyDict_Type, &media, &PyDict_Type, &roots, &max_batches, &max_events,
                          &bounds, &counts, &max_blocks))
        return NULL;
    PyObject *out = NULL, *error = NULL;
    Py_ssize_t nb = (Py_ssize_t)(bounds.len / (Py_ssize_t)sizeof(double));
    if (bounds.len % (Py_ssize_t)sizeof(double) || counts.len != (nb + 1) * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "apply_run: counts must hold len(bounds) + 1 int64s");
        goto done;
    }
    if (arg_model(c, model) || arg_slot(c, slot)) goto done;
    const double *bound = bounds.buf;
    int64_t *count = counts.buf;
    Py_ssize_t n = 0, events = 0, stored = 0, removed = 0, unknown_parent = 0, unknown_removed = 0;
    double seconds = 0.0, t = now_s();
    Py_ssize_t blocks = 0; /* stored and removed in this call: max_blocks bounds them (a hold of the lock) */
    for (Py_ssize_t i = start; i < PyList_GET_SIZE(msgs) && n < max_batches
                               && (n == 0 || (events < max_events && (max_blocks <= 0 || blocks < max_blocks))); i++) {
        PyObject *item = PyList_GET_ITEM(msgs, i);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2) break;
        PyObject *so = PyTuple_GET_ITEM(item, 0), *payload = PyTuple_GET_ITEM(item, 1);
        if (!PyLong_CheckExact(so) || !PyBytes_CheckExact(payload)) break;
        unsigned long long s = PyLong_AsUnsignedLongLong(so);
        if (s == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            break;
        }
        if (s != seq + (unsigned long long)n) break;
        const char *data = PyBytes_AS_STRING(payload);
        Py_ssize_t len = PyBytes_GET_SIZE(payload);
        /* A batch that would take this call past max_blocks waits for the next (blocks is 0 before the
         * first batch: one larger than max_blocks alone is the caller's to cut). */
        if (max_blocks > 0 && blocks + peek_blocks(data, len) > max_blocks) break;
        /* A batch of one event (vLLM's common case) in one pass: checked and applied as it is read. */
        Batch a;
        memset(&a, 0, sizeof a);
        a.applying = 1;
        a.one_pass = 1;
        a.c = c;
        a.model = model;
        a.mid = -2;
        a.slot = (uint32_t)slot;
        a.root = root;
        a.roots = roots;
        a.media = media;
        a.expect_bs = block_size;
        Batch b; /* what the batch holds (the scan, or the one pass itself) */
        if (!batch(data, len, &a)) {
            b = a;
        } else if (PyErr_Occurred()) {
            error = fetch_error();
            break;
        } else if (!a.several) {
            break; /* declined before changing anything */
        } else { /* several events: checked whole first, then applied */
            memset(&b, 0, sizeof b);
            b.roots = roots; /* loras NULL: a LoRA key without a root declines */
            if (batch(data, len, &b)) {
                PyErr_Clear(); /* a failed allocation while scanning only declines the batch */
                break;
            }
            long mid;
            if (medium_in(media, b.medium ? b.medium : "GPU", b.medium ? b.medium_len : 3, &mid)) {
                error = fetch_error();
                break;
            }
            if (b.stored_events && (mid < 0 || b.block_size != block_size)) break; /* Python learns them first */
            if (max_blocks > 0 && blocks + b.stored_blocks + b.removed_blocks > max_blocks) break; /* as above */
            if (mid < -1 || mid >= c->n_media || arg_medium(c, (int)mid, 1)) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "apply_run: bad medium id");
                error = fetch_error();
                break;
            }
            memset(&a, 0, sizeof a);
            a.applying = 1;
            a.c = c;
            a.model = model;
            a.mid = (int)mid;
            a.slot = (uint32_t)slot;
            a.root = root;
            a.roots = roots;
            if (batch(data, len, &a)) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "apply_run: the batch changed between scan and apply");
                error = fetch_error();
                break;
            }
        }
        if (evict(c) < 0) { /* to the bound after every batch, as apply_payload does */
            error = fetch_error();
            break;
        }
        n++;
        stored += b.stored_events;
        removed += b.removed_events;
        events += b.stored_events + b.removed_events;
        blocks += b.stored_blocks + b.removed_blocks;
        unknown_parent += a.unknown_parent;
        unknown_removed += a.unknown_removed;
        double t1 = now_s(), dt = t1 - t;
        t = t1;
        Py_ssize_t lo = 0, hi = nb; /* bisect_left */
        while (lo < hi) {
            Py_ssize_t mid_b = (lo + hi) / 2;
            if (bound[mid_b] < dt) lo = mid_b + 1;
            else hi = mid_b;
        }
        count[lo]++;
        seconds += dt;
    }
    /* The background passes once per call, not per batch: their budgets are per hold of the lock,
     * and a run of small batches would multiply them. */
    if (n) passes(c);
    seconds += now_s() - t;
    out = Py_BuildValue("nnnnndO", n, stored, removed, unknown_parent, unknown_removed, seconds,
                        error ? error : Py_None);
done:
    Py_XDECREF(error);
    PyBuffer_Release(&bounds);
    PyBuffer_Release(&counts);
    return out;
}

/* out[slot] = run for each bit of `bits` (word w); -1 with an exception on failure. */
static int record_runs(PyObject *out, int w, uint64_t bits, Py_ssize_t run) {
    PyObject *v = PyLong_FromSsize_t(run);
    if (!v) return -1;
    for (; bits; bits &= bits - 1) {
        PyObject *kb = PyLong_FromLong(w * 64 + __builtin_ctzll(bits));
        int rc = kb ? PyDict_SetItem(out, kb, v) : -1;
        Py_XDECREF(kb);
        if (rc < 0) {
            Py_DECREF(v);
            return -1;
        }
    }
    Py_DECREF(v);
    return 0;
}

/* match(token_ids, block_size, root, cand, media) -> ({slot: run}, [{slot: run} per medium] | None)
 * Per candidate slot (`cand`: a little-endian bitmask, bytes), how many leading full blocks of the
 * prompt it holds in any of `media` (medium ids), and with several media the same per medium
 * (runs of 0 left out). Stops probing once no candidate holds the next block; the matched keys
 * (the deepest run) are stamped as most recently used. */
static PyObject *core_match(Core *c, PyObject *args) {
    CORE_ENTER(c);
    PyObject *tokens, *media;
    Py_ssize_t bs;
    unsigned long long root;
    Py_buffer cb;
    if (!PyArg_ParseTuple(args, "OnKy*O!", &tokens, &bs, &root, &cb, &PyTuple_Type, &media)) return NULL;
    PyObject *out = NULL, *run_any = NULL, *run_med = NULL;
    Tokens toks;
    int toks_open = 0, W = c->W;
    Py_ssize_t nm = PyTuple_GET_SIZE(media);
    int mids[64];
    uint64_t *keys = NULL, *words = NULL;
    Py_ssize_t *slots = NULL;
    if (bs <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive, got %zd", bs);
        goto done;
    }
    if (nm > 64) {
        PyErr_SetString(PyExc_ValueError, "match: more than 64 media");
        goto done;
    }
    for (Py_ssize_t j = 0; j < nm; j++) {
        if (as_int(PyTuple_GET_ITEM(media, j), &mids[j]) || arg_medium(c, mids[j], 0)) goto done;
    }
    if (tokens_open(tokens, &toks) < 0) goto done;
    toks_open = 1;
    Py_ssize_t n = toks.n / bs;
    run_any = PyDict_New();
    if (!run_any) goto done;
    if (nm > 1) {
        run_med = PyList_New(nm);
        if (!run_med) goto done;
        for (Py_ssize_t j = 0; j < nm; j++) {
            PyObject *d = PyDict_New();
            if (!d) goto done;
            PyList_SET_ITEM(run_med, j, d);
        }
    }
    /* words: alive (any medium), held (any medium), one medium's holders, alive per medium */
    words = PyMem_RawCalloc((size_t)W * (3 + nm), sizeof(uint64_t));
    keys = PyMem_RawMalloc(sizeof(uint64_t) * (n ? n : 1));
    slots = PyMem_RawMalloc(sizeof(Py_ssize_t) * (n ? n : 1) * (nm ? nm : 1));
    if (!words || !keys || !slots) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *alive = words, *held = words + W, *hb = words + 2 * W, *alive_m = words + 3 * W;
    int any = 0;
    for (int w = 0; w < W && 8 * w < cb.len; w++) {
        uint64_t x = 0;
        memcpy(&x, (char *)cb.buf + 8 * w, cb.len - 8 * w < 8 ? (size_t)(cb.len - 8 * w) : 8);
        alive[w] = x & c->live_bits[w];
        any |= alive[w] != 0;
    }
    if (!any || !nm || !n) goto result;
    for (Py_ssize_t j = 0; j < nm; j++) memcpy(alive_m + j * W, alive, sizeof(uint64_t) * W);
    /* keys first, then the probes with prefetching: the tables are far larger than the caches,
     * so each probe is a memory miss; issuing them PREFETCH ahead overlaps them */
    if (block_hashes(&toks, n, bs, keys) < 0) goto done;
    uint64_t k = root;
    for (Py_ssize_t i = 0; i < n; i++) keys[i] = k = chain(k, keys[i]);
    enum { PREFETCH = 12 };
    for (Py_ssize_t i = 0; i < n && i < PREFETCH; i++)
        for (Py_ssize_t j = 0; j < nm; j++) {
            const KTable *t = &c->media[mids[j]];
            __builtin_prefetch(&t->s[kt_home(t->cap, keys[i])]);
        }
    /* only the words [lo, hi) can hold a live candidate: the walk narrows as candidates drop out */
    int lo = 0, hi = W;
    while (!alive[lo]) lo++;
    while (!alive[hi - 1]) hi--;
    Py_ssize_t i = 0, deepest = 0;
    for (; i < n && any; i++) {
        if (i + PREFETCH < n)
            for (Py_ssize_t j = 0; j < nm; j++) {
                const KTable *t = &c->media[mids[j]];
                __builtin_prefetch(&t->s[kt_home(t->cap, keys[i + PREFETCH])]);
            }
        if (nm > 1) memset(held + lo, 0, sizeof(uint64_t) * (hi - lo));
        for (Py_ssize_t j = 0; j < nm; j++) {
            const KTable *t = &c->media[mids[j]];
            Py_ssize_t s = kt_find(t, keys[i]);
            slots[i * nm + j] = s;
            uint64_t *bits = nm > 1 ? hb : held;
            if (s >= 0) hold_bits_range(c, t->s[s].hold, bits, lo, hi);
            else memset(bits + lo, 0, sizeof(uint64_t) * (hi - lo));
            if (nm > 1) {
                uint64_t *am = alive_m + j * W;
                for (int w = lo; w < hi; w++) {
                    uint64_t now = am[w] & bits[w];
                    if (i && (am[w] & ~now) && record_runs(PyList_GET_ITEM(run_med, j), w, am[w] & ~now, i) < 0) goto done;
                    am[w] = now;
                    held[w] |= bits[w];
                }
            }
        }
        for (int w = lo; w < hi; w++) {
            uint64_t now = alive[w] & held[w];
            if (i && (alive[w] & ~now)) {
                if (record_runs(run_any, w, alive[w] & ~now, i) < 0) goto done;
                deepest = i;
            }
            alive[w] = now;
        }
        while (lo < hi && !alive[lo]) lo++;
        while (hi > lo && !alive[hi - 1]) hi--;
        any = lo < hi;
    }
    if (any) { /* held every block */
        deepest = n;
        for (int w = 0; w < W; w++)
            if (alive[w] && record_runs(run_any, w, alive[w], n) < 0) goto done;
        if (nm > 1)
            for (Py_ssize_t j = 0; j < nm; j++)
                for (int w = 0; w < W; w++)
                    if (alive_m[j * W + w] && record_runs(PyList_GET_ITEM(run_med, j), w, alive_m[j * W + w], n) < 0)
                        goto done;
    }
    if (deepest) {
        uint32_t tick = ++c->tick;
        for (Py_ssize_t x = 0; x < deepest * nm; x++)
            if (slots[x] >= 0) c->media[mids[x % nm]].stamp[slots[x]] = tick;
        if (!(tick & 0xFFFF)) pass_step(c, PASS_BUDGET); /* ages stay clamped without batches too */
    }
result:
    out = PyTuple_Pack(2, run_any, run_med ? run_med : Py_None);
done:
    Py_XDECREF(run_any);
    Py_XDECREF(run_med);
    PyMem_RawFree(words);
    PyMem_RawFree(keys);
    PyMem_RawFree(slots);
    if (toks_open) tokens_close(&toks);
    PyBuffer_Release(&cb);
    return out;
}

/* stats() -> (entries, evicted, engine hashes, bytes held, [keys per medium id or None]) */
static PyObject *core_stats(Core *c, PyObject *Py_UNUSED(ignored)) {
    CORE_ENTER(c);
    int64_t hashes = 0;
    Py_ssize_t bytes = (Py_ssize_t)(c->pool_cap * c->W * 8 + c->slot_cap * 21 + c->group_cap * 17);
    for (int i = 0; i < c->n_models; i++) {
        hashes += c->models[i].live;
        bytes += c->models[i].cap * (Py_ssize_t)sizeof(HSlot);
    }
    PyObject *keys = PyList_New(c->n_media);
    if (!keys) return NULL;
    for (int m = 0; m < c->n_media; m++) {
        PyObject *v = c->media[m].used ? PyLong_FromSsize_t(c->media[m].live) : Py_NewRef(Py_None);
        if (!v) {
            Py_DECREF(keys);
            return NULL;
        }
        PyList_SET_ITEM(keys, m, v);
        if (c->media[m].used) bytes += c->media[m].cap * (Py_ssize_t)(sizeof(KSlot) + sizeof(uint32_t));
    }
    return Py_BuildValue("LLLnN", (long long)c->entries, (long long)c->evicted, (long long)hashes, bytes, keys);
}

/* How far the entries of a table sit from their home positions (a lookup probes one more): their
 * total and the longest. Both kinds of slot are 16 bytes with the hashed word first (KSlot's key,
 * HSlot's engine hash); `keyed` picks the key table's home function. */
static void displacement(const uint64_t *slots, Py_ssize_t cap, int keyed, Py_ssize_t *total, Py_ssize_t *longest) {
    *total = *longest = 0;
    for (Py_ssize_t s = 0; s < cap; s++) {
        uint64_t x = slots[2 * s];
        if (x == EMPTY) continue;
        Py_ssize_t home = keyed ? kt_home(cap, x) : ht_home(cap, x);
        Py_ssize_t d = s >= home ? s - home : s + cap - home;
        *total += d;
        if (d > *longest) *longest = d;
    }
}

/* probes() -> [(cap, live, total displacement, longest displacement) per used medium, then per model]:
 * tests read it to hold probe lengths down under churn. */
static PyObject *core_probes(Core *c, PyObject *Py_UNUSED(ignored)) {
    _Static_assert(sizeof(KSlot) == 16 && sizeof(HSlot) == 16 && offsetof(KSlot, key) == 0 && offsetof(HSlot, h) == 0,
                   "displacement() reads slots as 2 words, the hashed one first");
    CORE_ENTER(c);
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int i = 0; i < c->n_media + c->n_models; i++) {
        Py_ssize_t cap, live, total, longest;
        if (i < c->n_media) {
            const KTable *t = &c->media[i];
            if (!t->used) continue;
            cap = t->cap, live = t->live;
            displacement(&t->s[0].key, cap, 1, &total, &longest);
        } else {
            const HTable *t = &c->models[i - c->n_media];
            cap = t->cap, live = t->live;
            displacement(&t->s[0].h, cap, 0, &total, &longest);
        }
        PyObject *row = Py_BuildValue("(nnnn)", cap, live, total, longest);
        if (!row || PyList_Append(out, row) < 0) {
            Py_XDECREF(row);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(row);
    }
    return out;
}

/* group_blocks(id) -> distinct blocks the group's slots hold over every medium */
static PyObject *core_group_blocks(Core *c, PyObject *arg) {
    CORE_ENTER(c);
    Py_ssize_t g = PyLong_AsSsize_t(arg);
    if (g == -1 && PyErr_Occurred()) return NULL;
    if (g < 0 || g >= c->group_cap || !c->group_state[g]) return PyErr_Format(PyExc_ValueError, "no group %zd", g);
    return PyLong_FromLongLong(c->group_blocks[g]);
}

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            PyErr_Format(PyExc_AssertionError, __VA_ARGS__);                               \
            goto fail;                                                                     \
        }                                                                                  \
    } while (0)

/* check(): every invariant of the tables and counts, recomputed the slow way (for tests) */
static PyObject *core_check(Core *c, PyObject *Py_UNUSED(ignored)) {
    CORE_ENTER(c);
    int64_t entries = 0;
    int64_t *slot_entries = PyMem_RawCalloc(c->slot_cap, sizeof(int64_t));
    int64_t *group_blocks = PyMem_RawCalloc(c->group_cap ? c->group_cap : 1, sizeof(int64_t));
    if (!slot_entries || !group_blocks) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t pool_used = 0;
    for (int m = 0; m < c->n_media; m++) {
        const KTable *t = &c->media[m];
        if (!t->used) continue;
        Py_ssize_t live = 0;
        for (Py_ssize_t s = 0; s < t->cap; s++) {
            uint64_t k = t->s[s].key, h = t->s[s].hold;
            if (k == EMPTY) continue;
            live++;
            CHECK(kt_find(t, k) == s, "medium %d: key at %zd not found from its home", m, s);
            CHECK(h != 0, "medium %d: key at %zd without holders", m, s);
            if (hold_ovf(h)) {
                pool_used++;
                int bits = 0;
                for (int w = 0; w < c->W; w++) bits += __builtin_popcountll(hold_words(c, h)[w]);
                CHECK(bits > 4, "medium %d: a bitmask of %d holders", m, bits);
            } else {
                for (int i = 0; i < 4; i++)
                    if (!((h >> (16 * i)) & 0xFFFF)) {
                        CHECK(!(h >> (16 * i)), "medium %d: holder fields not packed", m);
                        break;
                    }
            }
            Py_ssize_t n = hold_list(c, h);
            for (Py_ssize_t i = 0; i < n; i++) {
                uint32_t x = c->scratch[i];
                CHECK(x < c->slot_cap && c->slot_state[x] != SLOT_FREE, "medium %d: a free slot %u holds a key", m, x);
                if (c->slot_state[x] == SLOT_LIVE) {
                    entries++;
                    slot_entries[x]++;
                }
            }
            uint32_t mark = ++c->mark;
            for (Py_ssize_t i = 0; i < n; i++) {
                int32_t g = c->slot_group[c->scratch[i]];
                if (c->group_mark[g] == mark) continue;
                c->group_mark[g] = mark;
                int earlier = 0;
                for (int m2 = 0; m2 < m && !earlier; m2++) {
                    if (!c->media[m2].used) continue;
                    Py_ssize_t s2 = kt_find(&c->media[m2], k);
                    earlier = s2 >= 0 && hold_has_group(c, c->media[m2].s[s2].hold, g);
                }
                group_blocks[g] += !earlier;
            }
        }
        CHECK(live == t->live, "medium %d: %zd keys counted %zd", m, live, t->live);
    }
    CHECK(pool_used == c->pool_live, "holder bitmasks: %zd used, %zd counted", pool_used, c->pool_live);
    CHECK(entries == c->entries, "entries %lld counted %lld", (long long)entries, (long long)c->entries);
    for (Py_ssize_t s = 0; s < c->slot_cap; s++)
        CHECK(slot_entries[s] == c->slot_entries[s], "slot %zd: %lld entries counted %lld", s,
              (long long)slot_entries[s], (long long)c->slot_entries[s]);
    for (Py_ssize_t g = 0; g < c->group_cap; g++)
        CHECK(!c->group_state[g] || group_blocks[g] == c->group_blocks[g], "group %zd: %lld blocks counted %lld", g,
              (long long)group_blocks[g], (long long)c->group_blocks[g]);
    for (int i = 0; i < c->n_models; i++) {
        const HTable *t = &c->models[i];
        Py_ssize_t live = 0;
        for (Py_ssize_t s = 0; s < t->cap; s++) {
            if (t->s[s].h == EMPTY) continue;
            live++;
            CHECK(ht_find(t, t->s[s].h) == s, "model %d: hash at %zd not found from its home", i, s);
        }
        CHECK(live == t->live, "model %d: %zd hashes counted %zd", i, live, t->live);
    }
    PyMem_RawFree(slot_entries);
    PyMem_RawFree(group_blocks);
    Py_RETURN_NONE;
fail:
    PyMem_RawFree(slot_entries);
    PyMem_RawFree(group_blocks);
    return NULL;
}

static PyObject *core_get_tick(Core *c, void *Py_UNUSED(closure)) { return PyLong_FromUnsignedLong(c->tick); }

static int core_set_tick(Core *c, PyObject *v, void *Py_UNUSED(closure)) {
    unsigned long t = v ? PyLong_AsUnsignedLong(v) : 0;
    if (!v || (t == (unsigned long)-1 && PyErr_Occurred()) || t > UINT32_MAX) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "tick: a uint32");
        return -1;
    }
    c->tick = (uint32_t)t; /* the stamps stay: every key ages by the jump (tests move time this way) */
    return 0;
}

static PyObject *core_get_dead(Core *c, void *Py_UNUSED(closure)) { return PyLong_FromSsize_t(c->n_dead); }

static PyMethodDef core_methods[] = {
    {"new_medium", (PyCFunction)core_new_medium, METH_NOARGS, "new_medium() -> medium id"},
    {"free_medium", (PyCFunction)core_free_medium, METH_O, "free_medium(id): drop an empty medium table"},
    {"new_model", (PyCFunction)core_new_model, METH_NOARGS, "new_model() -> model id"},
    {"new_group", (PyCFunction)core_new_group, METH_NOARGS, "new_group() -> group (pod) id"},
    {"remove_group", (PyCFunction)core_remove_group, METH_O, "remove_group(id): kill its slots"},
    {"new_slot", (PyCFunction)core_new_slot, METH_O, "new_slot(group) -> slot id"},
    {"kill_slot", (PyCFunction)core_kill_slot, METH_O, "kill_slot(id): it holds nothing from now on"},
    {"key_of", (PyCFunction)core_key_of, METH_VARARGS, "key_of(model, folded hash) -> key | None"},
    {"store", (PyCFunction)core_store, METH_VARARGS, "store(model, medium, slot, hashes, keys) -> added"},
    {"release", (PyCFunction)core_release, METH_VARARGS, "release(model, medium, slot, hashes) -> (removed, unknown)"},
    {"apply_batch", (PyCFunction)core_apply_batch, METH_VARARGS,
     "apply_batch(payload, model, medium, slot, root, roots) -> (added, removed, unknown parent, unknown removed)"},
    {"apply_run", (PyCFunction)core_apply_run, METH_VARARGS,
     "apply_run(messages, start, seq, model, slot, root, block_size, media, roots, max_batches, max_events, "
     "bounds, counts) -> (batches, stored, removed, unknown parent, unknown removed, seconds, error)"},
    {"maintain", (PyCFunction)core_maintain, METH_NOARGS, "maintain(): evict to the bound, a step of the passes"},
    {"match", (PyCFunction)core_match, METH_VARARGS, "match(tokens, bs, root, cand, media) -> (runs, runs per medium)"},
    {"stats", (PyCFunction)core_stats, METH_NOARGS, "stats() -> (entries, evicted, hashes, bytes, keys per medium)"},
    {"group_blocks", (PyCFunction)core_group_blocks, METH_O, "group_blocks(id) -> distinct blocks held"},
    {"probes", (PyCFunction)core_probes, METH_NOARGS, "probes() -> [(cap, live, total, longest displacement)]"},
    {"check", (PyCFunction)core_check, METH_NOARGS, "check(): recompute every count and invariant (tests)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef core_getset[] = {
    {"tick", (getter)core_get_tick, (setter)core_set_tick, "the recency clock (uint32; stamps are compared by age)",
     NULL},
    {"dead_slots", (getter)core_get_dead, NULL, "slots cleared whose marks are not all gone yet", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcache._native.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The prefix index's tables (see kvcache/_native.c and kvcache/index.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
    .tp_getset = core_getset,
};

/* ==== tokenizer: byte-level BPE pre-tokenizer split on ASCII text (tokenizer/wordcache.py) ========
 * Nothing in this section touches the index. `split_bytelevel(text, kind)` cuts ASCII text into the
 * pre-tokens of one of three known regexes, exactly as the `tokenizers` library's (Oniguruma) regex
 * with "isolated" splits does; tokenizer/wordcache.py compares it with the tokenizer at load and the
 * tests compare it with Python's `re` on the translated pattern:
 *   kind 0, GPT-2 (ByteLevel use_regex):  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   kind 1, Llama 3 (\p{N}{1,3}) and kind 2, Qwen 2/3 (\p{N}):
 *     (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * On ASCII: \p{L} = [A-Za-z], \p{N} = [0-9], \s = [\t\n\v\f\r ] (Unicode White_Space). Every character is
 * in one of the four classes L, N, S and O (the rest), and each class has an alternative that takes it,
 * so the matches tile the text. `concat_cached(words, cache)` joins the cached id lists of `words`, or
 * names the words not cached yet. */

enum { PT_GPT2 = 0, PT_LLAMA3 = 1, PT_QWEN2 = 2 };

static inline int pt_L(unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
static inline int pt_N(unsigned char c) { return c >= '0' && c <= '9'; }
static inline int pt_S(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
static inline int pt_O(unsigned char c) { return !pt_L(c) && !pt_N(c) && !pt_S(c); }
static inline int pt_CRLF(unsigned char c) { return c == '\r' || c == '\n'; }
static inline unsigned char pt_lower(unsigned char c) { return (c >= 'A' && c <= 'Z') ? (unsigned char)(c + 32) : c; }

/* The end of the run of class `cls` starting at p. */
static inline Py_ssize_t pt_run(int (*cls)(unsigned char), const unsigned char *s, Py_ssize_t p, Py_ssize_t n) {
    while (p < n && cls(s[p])) p++;
    return p;
}
#define PT_RUN(cls, s, p, n) pt_run(cls, s, p, n)

/* A contraction at p ('s 't 're 've 'm 'll 'd): its length, 0 when none. */
static Py_ssize_t pt_contraction(const unsigned char *s, Py_ssize_t p, Py_ssize_t n, int icase) {
    if (s[p] != '\'' || p + 1 >= n) return 0;
    unsigned char a = icase ? pt_lower(s[p + 1]) : s[p + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (p + 2 >= n) return 0;
    unsigned char b = icase ? pt_lower(s[p + 2]) : s[p + 2];
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* \s+(?!\S) then \s+, at p (s[p] in S): the longest whitespace run ending at the text's end or before
 * more whitespace, else the whole run. */
static Py_ssize_t pt_spaces(const unsigned char *s, Py_ssize_t p, Py_ssize_t n) {
    Py_ssize_t k = PT_RUN(pt_S, s, p, n) - p;
    if (p + k == n || k < 2) return k;
    return k - 1;
}

static Py_ssize_t pt_gpt2(const unsigned char *s, Py_ssize_t p, Py_ssize_t n) {
    Py_ssize_t k = pt_contraction(s, p, n, 0);
    if (k) return k;
    unsigned char c = s[p];
    if (c == ' ' && p + 1 < n) {  /* ` ?X+`: the space is taken when X's class follows it */
        unsigned char d = s[p + 1];
        if (pt_L(d)) return PT_RUN(pt_L, s, p + 1, n) - p;
        if (pt_N(d)) return PT_RUN(pt_N, s, p + 1, n) - p;
        if (pt_O(d)) return PT_RUN(pt_O, s, p + 1, n) - p;
    }
    if (pt_L(c)) return PT_RUN(pt_L, s, p, n) - p;
    if (pt_N(c)) return PT_RUN(pt_N, s, p, n) - p;
    if (pt_O(c)) return PT_RUN(pt_O, s, p, n) - p;
    return pt_spaces(s, p, n);
}

static Py_ssize_t pt_llama(const unsigned char *s, Py_ssize_t p, Py_ssize_t n, Py_ssize_t max_digits) {
    Py_ssize_t k = pt_contraction(s, p, n, 1);
    if (k) return k;
    unsigned char c = s[p];
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (!pt_CRLF(c) && !pt_L(c) && !pt_N(c) && p + 1 < n && pt_L(s[p + 1])) return PT_RUN(pt_L, s, p + 1, n) - p;
    if (pt_L(c)) return PT_RUN(pt_L, s, p, n) - p;
    /* \p{N}{1,max} */
    if (pt_N(c)) {
        k = PT_RUN(pt_N, s, p, n) - p;
        return k < max_digits ? k : max_digits;
    }
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    Py_ssize_t q = -1;
    if (c == ' ' && p + 1 < n && pt_O(s[p + 1])) q = PT_RUN(pt_O, s, p + 1, n);
    else if (pt_O(c)) q = PT_RUN(pt_O, s, p, n);
    if (q >= 0) return PT_RUN(pt_CRLF, s, q, n) - p;
    /* \s*[\r\n]+ : up to the run's last \r or \n (one of them; the next is not whitespace or not there) */
    Py_ssize_t end = PT_RUN(pt_S, s, p, n);
    for (Py_ssize_t j = end - 1; j >= p; j--)
        if (pt_CRLF(s[j])) return j + 1 - p;
    return pt_spaces(s, p, n);
}

static PyObject *py_split_bytelevel(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *text;
    int kind;
    if (!PyArg_ParseTuple(args, "Ui", &text, &kind)) return NULL;
    if (!PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "split_bytelevel takes ASCII text only");
        return NULL;
    }
    if (kind < PT_GPT2 || kind > PT_QWEN2) {
        PyErr_Format(PyExc_ValueError, "unknown pre-tokenizer kind %d", kind);
        return NULL;
    }
    const unsigned char *s = PyUnicode_1BYTE_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text), p = 0;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    while (p < n) {
        Py_ssize_t m = kind == PT_GPT2 ? pt_gpt2(s, p, n) : pt_llama(s, p, n, kind == PT_LLAMA3 ? 3 : 1);
        if (m < 1 || p + m > n) {  /* cannot happen: every class is taken by some alternative */
            Py_DECREF(out);
            PyErr_SetString(PyExc_RuntimeError, "split_bytelevel: no pre-token matched");
            return NULL;
        }
        PyObject *w = PyUnicode_FromStringAndSize((const char *)s + p, m);  /* ASCII: valid UTF-8 */
        if (!w || PyList_Append(out, w) < 0) {
            Py_XDECREF(w);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(w);
        p += m;
    }
    return out;
}

static PyObject *py_concat_cached(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *words, *cache;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &words, &PyDict_Type, &cache)) return NULL;
    Py_ssize_t nw = PyList_GET_SIZE(words), total = 0;
    PyObject *missing = NULL;  /* words not cached, in order (repeats kept): a tuple is returned then */
    PyObject **found = PyMem_Malloc((size_t)(nw ? nw : 1) * sizeof(PyObject *));
    if (!found) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < nw; i++) {
        PyObject *word = PyList_GET_ITEM(words, i);
        PyObject *ids = PyDict_GetItemWithError(cache, word);  /* borrowed */
        if (!ids) {
            if (PyErr_Occurred()) goto fail;
            if (!missing && !(missing = PyList_New(0))) goto fail;
            if (PyList_Append(missing, word) < 0) goto fail;
            continue;
        }
        if (!PyList_Check(ids)) {
            PyErr_SetString(PyExc_TypeError, "cached ids must be lists");
            goto fail;
        }
        found[i] = ids;
        total += PyList_GET_SIZE(ids);
    }
    if (missing) {
        PyMem_Free(found);
        PyObject *t = PyList_AsTuple(missing);
        Py_DECREF(missing);
        return t;
    }
    PyObject *out = PyList_New(total);
    if (!out) goto fail;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < nw; i++) {
        Py_ssize_t m = PyList_GET_SIZE(found[i]);
        for (Py_ssize_t j = 0; j < m; j++) {
            PyObject *id = PyList_GET_ITEM(found[i], j);
            Py_INCREF(id);
            PyList_SET_ITEM(out, k++, id);
        }
    }
    PyMem_Free(found);
    return out;
fail:
    Py_XDECREF(missing);
    PyMem_Free(found);
    return NULL;
}
/* ==== end of the tokenizer section ================================================================ */

static PyMethodDef methods[] = {
    {"chain_keys", py_chain_keys, METH_VARARGS, "chain_keys(parent, token_ids, block_size) -> bytes of uint64 keys"},
    {"scan_batch", py_scan_batch, METH_O, "scan_batch(payload) -> summary tuple, or None for the general path"},
    {"split_batch", py_split_batch, METH_VARARGS, "split_batch(payload, max_blocks) -> [payload, ...], or None"},
    {"zmtp_split", py_zmtp_split, METH_VARARGS, "zmtp_split(buffer, pos, end, limit, max_frame) -> (messages, pos)"},
    {"split_bytelevel", py_split_bytelevel, METH_VARARGS,
     "split_bytelevel(ascii_text, kind) -> pre-tokens (kind 0 GPT-2, 1 Llama 3, 2 Qwen 2; tokenizer/wordcache.py)"},
    {"concat_cached", py_concat_cached, METH_VARARGS,
     "concat_cached(words, cache) -> the cached id lists of words joined (a list), or the words not cached (a tuple)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvcache._native",
    .m_doc = "The prefix index's tables and hot loops in C (see kvcache/_native.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

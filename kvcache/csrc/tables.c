/* The key table and the hash map: allocation (huge pages for large tables), growth by rehash (without
 * the GIL for large ones), deletion and insertion. Part of kvcache._native (module.c). */
#include "tables.h"
#include "core.h"
#ifdef __linux__
#include <sys/mman.h>
#endif

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

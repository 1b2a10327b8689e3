/* Holder words and the pool of holder bitmasks; entries (a key of a medium gains or loses a holder,
 * counted per slot and per pod); the maintenance passes (dead slots' marks, stamp ages, engine hashes no
 * key uses) and eviction to the entry bound. Part of kvcache._native (module.c). */
#include "holders.h"

#define AGE_CLAMP (UINT32_C(1) << 30)
#define EXACT_KEYS 65536                /* up to this many keys the eviction threshold is exact */
#define SAMPLES 4096
#define ORPHAN_BUDGET 2048              /* engine-hash positions one call sweeps (each a probe: a cache miss) */

/* ---- holders ---- */

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

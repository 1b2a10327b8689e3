/* kvcache._native: the prefix index's hot loops in C.
 *
 * - chain_keys: kvgate's block keys (see kvcache/blockkeys.py for the definition).
 * - scan_batch / apply_batch: one vLLM KV event batch (msgpack bytes) checked, then applied to
 *   the index's tables without building a Python object per event or per token id. Anything
 *   outside the common shape (see scan_batch) is declined, and the caller takes the general
 *   path (kvcache.wire.decode_batch + PrefixIndex.apply), which handles and counts it.
 * - match_runs: one table's leading-run walk for a prompt (compute keys, probe, running AND).
 *
 * The tables are the numpy arrays of kvcache/table.py (open addressing, linear probing, EMPTY
 * and TOMB reserved keys); this file and table.py must agree on the slot arithmetic.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define EMPTY UINT64_MAX
#define TOMB (UINT64_MAX - 1)
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
    uint64_t k = parent;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = block_hash_init((uint64_t)bs), t;
        for (Py_ssize_t j = 0; j < bs; j++) {
            if (tokens_get(&tk, i * bs + j, &t) < 0) {
                tokens_close(&tk);
                Py_DECREF(out);
                return NULL;
            }
            h = block_hash_step(h, t);
        }
        k = chain(k, block_hash_final(h));
        keys[i] = k;
    }
    tokens_close(&tk);
    return out;
}

/* ---- tables (kvcache/table.py's layout) -------------------------------------------------- */

typedef struct {
    uint64_t *keys, *value;
    Py_ssize_t cap;
    Py_ssize_t live, used; /* deltas to hand back */
} HashMapView;

typedef struct {
    uint64_t *keys, *mask;
    uint32_t *stamp;
    Py_ssize_t cap;
    Py_ssize_t live, used;
} KeyTableView;

/* Home slots (table.py's _home): a HashMap keys on its top 32 bits, a KeyTable on bits 28..59. */
static inline Py_ssize_t hm_slot(uint64_t h, Py_ssize_t cap) { return (Py_ssize_t)(((h >> 32) * (uint64_t)cap) >> 32); }

static inline Py_ssize_t kt_slot(uint64_t k, Py_ssize_t cap) {
    return (Py_ssize_t)((((k >> 28) & 0xFFFFFFFFu) * (uint64_t)cap) >> 32);
}

static inline Py_ssize_t hm_home(const HashMapView *m, uint64_t h) { return hm_slot(h, m->cap); }

static inline Py_ssize_t kt_home(const KeyTableView *t, uint64_t k) { return kt_slot(k, t->cap); }

/* The slot holding key k, probing linearly from slot s; -1 at the first empty slot. */
static Py_ssize_t probe(const uint64_t *keys, Py_ssize_t cap, Py_ssize_t s, uint64_t k) {
    for (;;) {
        uint64_t x = keys[s];
        if (x == k) return s;
        if (x == EMPTY) return -1;
        if (++s == cap) s = 0;
    }
}

static inline Py_ssize_t hm_find(const HashMapView *m, uint64_t h) { return probe(m->keys, m->cap, hm_home(m, h), h); }

static inline Py_ssize_t kt_find(const KeyTableView *t, uint64_t k) { return probe(t->keys, t->cap, kt_home(t, k), k); }

/* Map engine hash h to key k (inserting h), set bit `one` on k (inserting k), stamp it.
 * Returns 1 if the bit was newly set. The caller guarantees room (no rebuild here). */
static int store_pair(HashMapView *m, KeyTableView *t, uint64_t h, uint64_t k, uint64_t one, uint32_t stamp) {
    Py_ssize_t s = hm_home(m, h), tomb = -1;
    for (;;) {
        uint64_t x = m->keys[s];
        if (x == h) break;
        if (x >= TOMB) {
            if (x == EMPTY) {
                if (tomb >= 0) s = tomb;
                else m->used++;
                m->keys[s] = h;
                m->live++;
                break;
            }
            if (tomb < 0) tomb = s;
        }
        if (++s == m->cap) s = 0;
    }
    m->value[s] = k;
    int added = 0;
    s = kt_home(t, k);
    tomb = -1;
    for (;;) {
        uint64_t x = t->keys[s];
        if (x == k) {
            if (!(t->mask[s] & one)) {
                t->mask[s] |= one;
                added = 1;
            }
            break;
        }
        if (x >= TOMB) {
            if (x == EMPTY) {
                if (tomb >= 0) s = tomb;
                else t->used++;
                t->keys[s] = k;
                t->mask[s] = one;
                t->live++;
                added = 1;
                break;
            }
            if (tomb < 0) tomb = s;
        }
        if (++s == t->cap) s = 0;
    }
    t->stamp[s] = stamp;
    return added;
}

enum { R_UNKNOWN = -2, R_NOT_HELD = -1, R_FREED = 0, R_STILL_HELD = 1 };

static inline void free_slot(uint64_t *keys, Py_ssize_t cap, Py_ssize_t s, Py_ssize_t *live, Py_ssize_t *used) {
    Py_ssize_t nxt = s + 1 < cap ? s + 1 : 0;
    if (keys[nxt] == EMPTY) {
        keys[s] = EMPTY;
        (*used)--;
    } else {
        keys[s] = TOMB;
    }
    (*live)--;
}

#define MAX_OTHERS 8

typedef struct {
    const uint64_t *keys;
    Py_ssize_t cap;
} OtherTable; /* another medium's KeyTable: only its keys are read */

static inline int other_holds(const OtherTable *o, uint64_t k) {
    return probe(o->keys, o->cap, kt_slot(k, o->cap), k) >= 0;
}

/* table.py's release() plus the index's _forget_hash_if_unheld(): unset bit `one` of the key
 * engine hash h maps to; free the key when no holder is left, and h's entry too when no other
 * medium table holds the key. */
static int release_one(HashMapView *m, KeyTableView *t, uint64_t h, uint64_t one, const OtherTable *others,
                       int n_others) {
    Py_ssize_t hs = hm_find(m, h);
    if (hs < 0) return R_UNKNOWN;
    uint64_t k = m->value[hs];
    Py_ssize_t s = kt_find(t, k);
    if (s < 0) return R_NOT_HELD;
    uint64_t msk = t->mask[s];
    if (!(msk & one)) return R_NOT_HELD;
    msk ^= one;
    t->mask[s] = msk;
    if (msk) return R_STILL_HELD;
    free_slot(t->keys, t->cap, s, &t->live, &t->used);
    for (int i = 0; i < n_others; i++)
        if (other_holds(&others[i], k)) return R_FREED;
    free_slot(m->keys, m->cap, hs, &m->live, &m->used);
    return R_FREED;
}

static inline uint64_t fold(uint64_t h) {
    h *= GOLDEN;
    return h >= TOMB ? h - 2 : h;
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
    if ((b & 0xf0) == 0x80 || b == 0xde || b == 0xdf) {
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
    HashMapView *m;
    KeyTableView *t;
    uint64_t root, one;
    uint32_t tick;
    PyObject *loras; /* scan: the set of LoRA keys of chain-starting stores */
    PyObject *roots; /* apply: LoRA key -> root key */
    const OtherTable *others;
    int n_others;
    Py_ssize_t added, removed, unknown_parent, unknown_removed;
} Batch;

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
 * "#lora_id=N" (vLLM before 0.14), else none (the base model). Scanning collects the keys;
 * applying looks up their root keys (computed in Python). -2: a Python error. */
static int chain_root(Batch *b, const Stored *st, uint64_t *root) {
    if (!st->lora_name && !st->has_lora_id) {
        *root = b->root;
        return 0;
    }
    PyObject *key = st->lora_name ? PyUnicode_DecodeASCII(st->lora_name, st->lora_name_len, NULL)
                                  : PyUnicode_FromFormat("#lora_id=%lld", (long long)st->lora_id);
    if (!key) return -2;
    int rc = 0;
    if (!b->applying) {
        rc = PySet_Add(b->loras, key) < 0 ? -2 : 0;
    } else {
        PyObject *v = PyDict_GetItemWithError(b->roots, key);
        if (!v) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
            rc = -2;
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
    if (st->has_parent) {
        Py_ssize_t s = hm_find(b->m, fold(st->parent));
        if (s < 0) { /* its chain is unknown: never guess a chain start */
            b->unknown_parent += st->n_hashes;
            return 0;
        }
        k = b->m->value[s];
    }
    b->tick++;
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
        b->added += store_pair(b->m, b->t, fold(h), k, b->one, b->tick);
    }
    return 0;
}

static int do_removed(Batch *b, Reader hashes, uint32_t n) {
    b->removed_events++;
    b->removed_blocks += n;
    if (!b->applying) return 0;
    uint64_t h;
    for (uint32_t i = 0; i < n; i++) {
        rd_hash(&hashes, &h);
        int res = release_one(b->m, b->t, fold(h), b->one, b->others, b->n_others);
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
    if (need(r, 1)) return -1;
    uint8_t c = *r->p;
    if ((c & 0xf0) == 0x80 || c == 0xde || c == 0xdf) {
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
static int batch(const char *data, Py_ssize_t len, Batch *b) {
    Reader r = {(const uint8_t *)data, (const uint8_t *)data + len};
    Reader events = {NULL, NULL};
    uint32_t n;
    if (!need(&r, 1) && ((*r.p & 0xf0) == 0x80 || *r.p == 0xde || *r.p == 0xdf)) {
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
    if (rd_array(&events, &n)) return -1;
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

/* A table column: a contiguous buffer of `itemsize`-byte items, at least one (a table of capacity 0
 * has no slot to probe: its home slot 0 would be read out of bounds). */
static int get_column(PyObject *o, Py_buffer *v, int writable, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(o, v, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (v->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: expected %zd-byte items, got %zd-byte ones", what, itemsize, v->itemsize);
        PyBuffer_Release(v);
        return -1;
    }
    if (v->len < itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: a table of capacity 0", what);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static int get_u64(PyObject *o, Py_buffer *v, int writable, const char *what) {
    return get_column(o, v, writable, 8, what);
}

/* apply_batch(payload, root, one, tick, hm_keys, hm_values, kt_keys, kt_masks, kt_stamps, others, roots)
 *   -> (added, removed, tick, hm_live, hm_used, kt_live, kt_used, unknown_parent, unknown_removed)
 * Applies a batch scan_batch accepted, for the holder bit `one`; `others` is a tuple of the other
 * media tables' key arrays (at most 8: a freed key's engine hash is kept while one holds it); `roots`
 * maps each LoRA key scan_batch listed to its root key. The caller made room for every
 * stored block in both tables (no rebuild happens here); live/used are deltas. */
static PyObject *py_apply_batch(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer payload, hk, hv, tk, tm, ts;
    unsigned long long root, one;
    unsigned long tick;
    PyObject *ohk, *ohv, *otk, *otm, *ots, *oothers, *oroots;
    if (!PyArg_ParseTuple(args, "y*KKkOOOOOO!O!", &payload, &root, &one, &tick, &ohk, &ohv, &otk, &otm, &ots,
                          &PyTuple_Type, &oothers, &PyDict_Type, &oroots))
        return NULL;
    int got = 0, n_others = 0;
    PyObject *out = NULL;
    Py_buffer other_bufs[MAX_OTHERS];
    OtherTable others[MAX_OTHERS];
    if (PyTuple_GET_SIZE(oothers) > MAX_OTHERS) {
        PyErr_SetString(PyExc_ValueError, "apply_batch: more than 8 other media tables");
        goto done;
    }
    for (; n_others < PyTuple_GET_SIZE(oothers); n_others++) {
        if (get_u64(PyTuple_GET_ITEM(oothers, n_others), &other_bufs[n_others], 0, "others")) goto done;
        others[n_others].keys = other_bufs[n_others].buf;
        others[n_others].cap = other_bufs[n_others].len / 8;
    }
    if (get_u64(ohk, &hk, 1, "hm_keys")) goto done;
    got = 1;
    if (get_u64(ohv, &hv, 1, "hm_values")) goto done;
    got = 2;
    if (get_u64(otk, &tk, 1, "kt_keys")) goto done;
    got = 3;
    if (get_u64(otm, &tm, 1, "kt_masks")) goto done;
    got = 4;
    if (get_column(ots, &ts, 1, 4, "kt_stamps")) goto done;
    got = 5;
    if (hk.len != hv.len || tk.len != tm.len || tk.len / 8 != ts.len / 4) {
        PyErr_SetString(PyExc_ValueError, "apply_batch: table arrays of mismatched sizes");
        goto done;
    }
    HashMapView m = {hk.buf, hv.buf, hk.len / 8, 0, 0};
    KeyTableView t = {tk.buf, tm.buf, ts.buf, tk.len / 8, 0, 0};
    Batch b;
    memset(&b, 0, sizeof b);
    b.applying = 1;
    b.m = &m;
    b.t = &t;
    b.root = root;
    b.one = one;
    b.tick = (uint32_t)tick;
    b.others = others;
    b.n_others = n_others;
    b.roots = oroots;
    if (batch(payload.buf, payload.len, &b)) {
        /* scan_batch accepted these bytes: only a changed buffer or missing roots get here */
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "apply_batch: payload is not in the fast path's shape (scan it first)");
        goto done;
    }
    out = Py_BuildValue("nnknnnnnn", b.added, b.removed, (unsigned long)b.tick, m.live, m.used, t.live, t.used,
                        b.unknown_parent, b.unknown_removed);
done:
    for (int i = 0; i < n_others; i++) PyBuffer_Release(&other_bufs[i]);
    PyBuffer_Release(&payload);
    if (got >= 1) PyBuffer_Release(&hk);
    if (got >= 2) PyBuffer_Release(&hv);
    if (got >= 3) PyBuffer_Release(&tk);
    if (got >= 4) PyBuffer_Release(&tm);
    if (got >= 5) PyBuffer_Release(&ts);
    return out;
}

/* ---- matching ------------------------------------------------------------------------------ */

/* out[bit] = run for each bit set in `bits`; -1 with an exception on failure. */
static int record_runs(PyObject *out, uint64_t bits, Py_ssize_t run) {
    PyObject *v = PyLong_FromSsize_t(run);
    if (!v) return -1;
    for (; bits; bits &= bits - 1) {
        PyObject *kb = PyLong_FromLong(__builtin_ctzll(bits));
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

/* match_runs(token_ids, block_size, root, cand, tick, kt_keys, kt_masks, kt_stamps)
 *   -> {bit: leading blocks held}
 * For one table: per holder bit of `cand` (< 2**64), how many leading full blocks of the prompt
 * it holds (runs of 0 left out). Stops probing once no candidate holds the next block. With
 * tick > 0 the matched keys (the deepest run) are stamped as most recently used. */
static PyObject *py_match_runs(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *tokens, *otk, *otm, *ots;
    Py_ssize_t bs;
    unsigned long long root, cand;
    unsigned long tick;
    if (!PyArg_ParseTuple(args, "OnKKkOOO", &tokens, &bs, &root, &cand, &tick, &otk, &otm, &ots)) return NULL;
    if (bs <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive, got %zd", bs);
        return NULL;
    }
    Py_buffer tk, tm, ts;
    if (get_u64(otk, &tk, 0, "kt_keys")) return NULL;
    if (get_u64(otm, &tm, 0, "kt_masks")) {
        PyBuffer_Release(&tk);
        return NULL;
    }
    if (get_column(ots, &ts, 1, 4, "kt_stamps")) {
        PyBuffer_Release(&tk);
        PyBuffer_Release(&tm);
        return NULL;
    }
    PyObject *out = NULL;
    Tokens toks;
    int toks_open = 0;
    Py_ssize_t *slots = NULL;
    if (tk.len != tm.len || tk.len / 8 != ts.len / 4) {
        PyErr_SetString(PyExc_ValueError, "match_runs: table arrays of mismatched sizes");
        goto done;
    }
    if (tokens_open(tokens, &toks) < 0) goto done;
    toks_open = 1;
    Py_ssize_t n = toks.n / bs;
    KeyTableView t = {tk.buf, tm.buf, ts.buf, tk.len / 8, 0, 0};
    slots = PyMem_Malloc(sizeof(Py_ssize_t) * (n ? n : 1));
    out = PyDict_New();
    if (!slots || !out) goto fail;
    /* keys first, then the probes with prefetching: the tables are far larger than the caches,
     * so each probe is a memory miss; issuing them PREFETCH ahead overlaps them */
    uint64_t *keys = PyMem_Malloc(sizeof(uint64_t) * (n ? n : 1));
    if (!keys) goto fail;
    uint64_t k = root, tok;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = block_hash_init((uint64_t)bs);
        for (Py_ssize_t j = 0; j < bs; j++) {
            if (tokens_get(&toks, i * bs + j, &tok) < 0) {
                PyMem_Free(keys);
                goto fail;
            }
            h = block_hash_step(h, tok);
        }
        k = chain(k, block_hash_final(h));
        keys[i] = k;
    }
    enum { PREFETCH = 12 };
    for (Py_ssize_t i = 0; i < n && i < PREFETCH; i++) {
        Py_ssize_t s = kt_home(&t, keys[i]);
        __builtin_prefetch(&t.keys[s]);
        __builtin_prefetch(&t.mask[s]);
    }
    uint64_t alive = cand;
    Py_ssize_t i = 0, deepest = 0;
    for (; i < n && alive; i++) {
        if (i + PREFETCH < n) {
            Py_ssize_t s = kt_home(&t, keys[i + PREFETCH]);
            __builtin_prefetch(&t.keys[s]);
            __builtin_prefetch(&t.mask[s]);
        }
        Py_ssize_t s = kt_find(&t, keys[i]);
        slots[i] = s;
        uint64_t held = s >= 0 ? t.mask[s] & alive : 0;
        if (held != alive) {
            uint64_t dropped = alive & ~held;
            if (i) {
                if (record_runs(out, dropped, i) < 0) {
                    PyMem_Free(keys);
                    goto fail;
                }
                if (i > deepest) deepest = i;
            }
            alive = held;
        }
    }
    PyMem_Free(keys);
    if (alive && n) { /* held every block */
        deepest = n;
        if (record_runs(out, alive, n) < 0) goto fail;
    }
    if (tick)
        for (Py_ssize_t j = 0; j < deepest; j++)
            if (slots[j] >= 0) t.stamp[slots[j]] = (uint32_t)tick;
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyMem_Free(slots);
    if (toks_open) tokens_close(&toks);
    PyBuffer_Release(&tk);
    PyBuffer_Release(&tm);
    PyBuffer_Release(&ts);
    return out;
}

static PyMethodDef methods[] = {
    {"chain_keys", py_chain_keys, METH_VARARGS, "chain_keys(parent, token_ids, block_size) -> bytes of uint64 keys"},
    {"scan_batch", py_scan_batch, METH_O, "scan_batch(payload) -> summary tuple, or None for the general path"},
    {"apply_batch", py_apply_batch, METH_VARARGS, "apply_batch(payload, root, one, tick, 5 table arrays) -> deltas"},
    {"match_runs", py_match_runs, METH_VARARGS, "match_runs(tokens, bs, root, cand, tick, 3 table arrays) -> {bit: run}"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvcache._native",
    .m_doc = "The prefix index's hot loops in C (see kvcache/_native.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }

/* KV event batches: the envelope, BlockStored and BlockRemoved in their array and map forms, scanned
 * (scan_batch) or applied to a Core's tables (Core.apply_batch, Core.apply_run in core.c), and the block
 * count of a one-event batch read off its headers. Part of kvcache._native (module.c). */
#include "events.h"
#include "blockkeys.h"
#include "holders.h"

/* extra_keys: nil, or an array of nils (no block carries extra keys). Anything else (a salt, media, a LoRA
 * name, prompt-embeds digests) declines the batch: the general path keys those blocks with their extras. */
static int rd_no_extras(Reader *r) {
    uint32_t n;
    if (is_nil(r)) return 0;
    if (rd_array(r, &n)) return -1;
    for (uint32_t i = 0; i < n; i++)
        if (!is_nil(r)) return -1;
    return 0;
}

/* kv_cache_spec_kind: nil or a full-attention kind (hit rule: every block from block 0). Other kinds
 * (sliding window, mamba, ...) decline the batch: the general path applies their groups' rules. */
static int rd_full_kind(Reader *r) {
    const char *s;
    uint32_t n;
    if (is_nil(r)) return 0;
    if (rd_str(r, &s, &n)) return -1;
    return str_is(s, n, "full_attention") ? 0 : -1;
}

/* nil or 0: KV cache group 0, the only one indexed */
static int rd_group(Reader *r) {
    uint64_t v;
    if (is_nil(r)) return 0;
    if (rd_int(r, &v) || v != 0) return -1;
    return 0;
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
        case 7: if (rd_no_extras(r)) return -1; break;      /* extra_keys */
        case 8: if (rd_group(r)) return -1; break;
        case 9: if (rd_full_kind(r)) return -1; break;
        case 10: if (!is_nil(r)) return -1; break;         /* a sliding window */
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
 * Known fields the index ignores (locality, ownership, session_id) are skipped; extra keys, a group
 * other than 0, a kind other than full attention, a window or lookahead tokens decline the batch (the
 * general path keys them), and so does any other key (the general path counts it). */
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
        case F_EXTRA: if (rd_no_extras(r)) return -1; break;
        case F_GROUP: if (rd_group(r)) return -1; break;
        case F_KIND: if (rd_full_kind(r)) return -1; break;
        case F_WINDOW: if (!is_nil(r)) return -1; break;
        case F_LOOKAHEAD: { /* nil or none: a lookahead changes the blocks' hashes */
            uint32_t n;
            if (!is_nil(r) && (rd_array(r, &n) || n)) return -1;
            break;
        }
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

/* Cutting a large batch (split_batch): between events, and an event of too many blocks into pieces
 * chained to the block before, so that each part is one short hold of the index lock. Part of
 * kvcache._native (module.c). */
#include "events.h"

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

/* The Core type, kvcache/index.py's only native object: ids of media, models, pods and slots handed out
 * and checked, stores and releases, batches and runs of batches applied, the match walk, stats and the
 * invariant check the tests run. Part of kvcache._native (module.c). */
#include "blockkeys.h"
#include "core.h"
#include "events.h"
#include "holders.h"
#include <time.h> /* after Python.h, as Python asks */

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

/* new_medium() -> id: an empty key table (ids of freed ones are reused) */
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

static PyObject *core_maintain(Core *c, PyObject *Py_UNUSED(ignored)) {
    CORE_ENTER(c);
    if (maintain(c)) return NULL;
    Py_RETURN_NONE;
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
    Py_buffer kb = {0};
    int toks_open = 0, W = c->W;
    Py_ssize_t nm = PyTuple_GET_SIZE(media);
    int mids[64];
    uint64_t *keys = NULL, *words = NULL;
    Py_ssize_t *slots = NULL;
    if (bs < 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive (0: the keys are given), got %zd", bs);
        goto done;
    }
    if (nm > 64) {
        PyErr_SetString(PyExc_ValueError, "match: more than 64 media");
        goto done;
    }
    for (Py_ssize_t j = 0; j < nm; j++) {
        if (as_int(PyTuple_GET_ITEM(media, j), &mids[j]) || arg_medium(c, mids[j], 0)) goto done;
    }
    Py_ssize_t n;
    if (bs) {
        if (tokens_open(tokens, &toks) < 0) goto done;
        toks_open = 1;
        n = toks.n / bs;
    } else { /* the keys themselves (uint64, native order): computed by the caller with extra keys */
        if (PyObject_GetBuffer(tokens, &kb, PyBUF_SIMPLE) < 0) goto done;
        n = kb.len / 8;
    }
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
    if (bs) {
        if (block_hashes(&toks, n, bs, keys) < 0) goto done;
        uint64_t k = root;
        for (Py_ssize_t i = 0; i < n; i++) keys[i] = k = chain(k, keys[i]);
    } else if (n) {
        memcpy(keys, kb.buf, sizeof(uint64_t) * n);
    }
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
    if (kb.obj) PyBuffer_Release(&kb);
    PyBuffer_Release(&cb);
    return out;
}

/* holders(keys, cand, media) -> [{slot: bitmap} per medium]: for each slot of `cand` holding any of
 * `keys` (uint64 bytes, in order) in that medium, a little-endian bitmap of the key positions it holds
 * (bit i: keys[i]), as bytes of (n + 7) / 8. For hit rules other than "every block from block 0"
 * (sliding windows, mamba states: kvcache/groups.py), which need every position, not leading runs.
 * Keys found are stamped recent, as match() stamps the blocks it matched. */
static PyObject *core_holders(Core *c, PyObject *args) {
    CORE_ENTER(c);
    Py_buffer kb, cb;
    PyObject *media;
    if (!PyArg_ParseTuple(args, "y*y*O!", &kb, &cb, &PyTuple_Type, &media)) return NULL;
    PyObject *out = NULL, *lists = NULL;
    Py_ssize_t nm = PyTuple_GET_SIZE(media), n = kb.len / 8, nbytes = (n + 7) / 8;
    int W = c->W, lo = 0, hi = 0;
    uint8_t **bufs = NULL;
    uint64_t *alive = PyMem_RawCalloc((size_t)W * 2, sizeof(uint64_t)), *tmp = alive + W;
    if (!alive) {
        PyErr_NoMemory();
        goto done;
    }
    for (int w = 0; w < W && 8 * w < cb.len; w++) {
        uint64_t x = 0;
        memcpy(&x, (char *)cb.buf + 8 * w, cb.len - 8 * w < 8 ? (size_t)(cb.len - 8 * w) : 8);
        alive[w] = x & c->live_bits[w];
    }
    hi = W;
    while (lo < hi && !alive[lo]) lo++;
    while (hi > lo && !alive[hi - 1]) hi--;
    Py_ssize_t nslots = (Py_ssize_t)(hi - lo) * 64;
    bufs = PyMem_RawCalloc(nslots ? (size_t)nslots : 1, sizeof(uint8_t *));
    lists = PyList_New(nm);
    if (!bufs || !lists) {
        if (!bufs) PyErr_NoMemory();
        goto done;
    }
    uint32_t tick = ++c->tick;
    for (Py_ssize_t j = 0; j < nm; j++) {
        int mid;
        if (as_int(PyTuple_GET_ITEM(media, j), &mid) || arg_medium(c, mid, 0)) goto done;
        PyObject *d = PyDict_New();
        if (!d) goto done;
        PyList_SET_ITEM(lists, j, d);
        if (lo == hi || !n) continue;
        KTable *t = &c->media[mid];
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t k;
            memcpy(&k, (char *)kb.buf + 8 * i, 8);
            Py_ssize_t s = kt_find(t, k);
            if (s < 0) continue;
            hold_bits_range(c, t->s[s].hold, tmp, lo, hi);
            int any = 0;
            for (int w = lo; w < hi; w++) {
                for (uint64_t x = tmp[w] & alive[w]; x; x &= x - 1) {
                    Py_ssize_t at = (Py_ssize_t)(w - lo) * 64 + __builtin_ctzll(x);
                    if (!bufs[at] && !(bufs[at] = PyMem_RawCalloc((size_t)nbytes, 1))) {
                        PyErr_NoMemory();
                        goto done;
                    }
                    bufs[at][i >> 3] |= (uint8_t)(1u << (i & 7));
                    any = 1;
                }
            }
            if (any) t->stamp[s] = tick;
        }
        for (Py_ssize_t at = 0; at < nslots; at++) {
            if (!bufs[at]) continue;
            PyObject *key = PyLong_FromSsize_t((Py_ssize_t)lo * 64 + at);
            PyObject *val = key ? PyBytes_FromStringAndSize((const char *)bufs[at], nbytes) : NULL;
            int rc = val ? PyDict_SetItem(d, key, val) : -1;
            Py_XDECREF(key);
            Py_XDECREF(val);
            PyMem_RawFree(bufs[at]);
            bufs[at] = NULL;
            if (rc < 0) goto done;
        }
    }
    if (!(tick & 0xFFFF)) pass_step(c, PASS_BUDGET);
    out = Py_NewRef(lists);
done:
    if (bufs)
        for (Py_ssize_t at = 0; at < (Py_ssize_t)(hi - lo) * 64; at++) PyMem_RawFree(bufs[at]);
    PyMem_RawFree(bufs);
    Py_XDECREF(lists);
    PyMem_RawFree(alive);
    PyBuffer_Release(&kb);
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
    {"match", (PyCFunction)core_match, METH_VARARGS, "match(tokens, bs, root, cand, media) -> (runs, runs per medium); bs 0: `tokens` is the keys (uint64 bytes)"},
    {"holders", (PyCFunction)core_holders, METH_VARARGS,
     "holders(keys, cand, media) -> [{slot: bitmap bytes} per medium]: the key positions each candidate holds"},
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
    .tp_doc = "The prefix index's tables (see kvcache/csrc/core.c and kvcache/index.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
    .tp_getset = core_getset,
};

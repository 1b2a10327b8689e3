/* vLLM KV event batches read straight from their msgpack bytes: scanned (is the batch in the fast path's
 * shape, and what does it hold) and applied to a Core without a Python object per event or token id.
 * A batch outside the common shape is declined: the caller takes the general path (kvcache.wire's
 * decode_batch + PrefixIndex.apply, which calls Core.store / Core.release), which handles and counts it. */
#ifndef KVGATE_NATIVE_EVENTS_H
#define KVGATE_NATIVE_EVENTS_H

#include "core.h"
#include "msgpack.h"

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

/* events.c */
static int envelope(const char *data, Py_ssize_t len, Reader *out); /* `out` at the events array's header */
static int event(Reader *r, Batch *b);
static int batch(const char *data, Py_ssize_t len, Batch *b); /* 0, or -1: declined (an error set if any) */
static int medium_in(PyObject *media, const char *s, uint32_t n, long *id);
static Py_ssize_t peek_blocks(const char *data, Py_ssize_t len);

#endif

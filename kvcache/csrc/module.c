/* kvcache._native: the prefix index's tables and hot loops in C, one part per file of kvcache/csrc/:
 *
 * - blockkeys.c: chain_keys, kvgate's block keys (see kvcache/blockkeys.py for the definition).
 * - tables.c, holders.c, core.c: Core, the index's tables (key tables per medium, engine-hash maps per
 *   model, slots and pods, counts, recency, eviction, background passes); kvcache/index.py is its only
 *   user and keeps names, logging and the per-pod answers. One implementation for every fleet shape.
 * - msgpack.c, events.c: scan_batch / Core.apply_batch / Core.apply_run: vLLM KV event batches (msgpack
 *   bytes) checked, then applied without building a Python object per event or per token id. Anything
 *   outside the common shape (see scan_batch) is declined, and the caller takes the general path
 *   (kvcache.wire.decode_batch + PrefixIndex.apply, which calls Core.store / Core.release).
 * - split.c: split_batch, a large batch cut into parts of a bounded number of blocks.
 * - zmtp.c: zmtp_split, a ZMTP connection's buffer split into whole messages (kvcache/zmtp.py).
 * - core.c also holds Core.match: the leading-run walk for a prompt (keys, probes, running AND of holders).
 *
 * One translation unit (a "unity build"): this file includes the parts, in the order they sat in the
 * one file they were split from, and is the only file compiled (setup.py lists the rest as `depends`).
 * Every helper stays `static`, so the compiler sees every call across parts (the batch apply's
 * store_pair and reader steps, the match walk's probes and holder reads) and inlines them as before:
 * the machine code is the one-file build's, which separate objects would not give without LTO. Each
 * part includes the headers of what it uses from the others; a part is not compiled on its own. */
#include "blockkeys.c"
#include "tables.c"
#include "holders.c"
#include "msgpack.c"
#include "events.c"
#include "split.c"
#include "zmtp.c"
#include "core.c"

static PyMethodDef methods[] = {
    {"chain_keys", py_chain_keys, METH_VARARGS, "chain_keys(parent, token_ids, block_size) -> bytes of uint64 keys"},
    {"scan_batch", py_scan_batch, METH_O, "scan_batch(payload) -> summary tuple, or None for the general path"},
    {"split_batch", py_split_batch, METH_VARARGS, "split_batch(payload, max_blocks) -> [payload, ...], or None"},
    {"zmtp_split", py_zmtp_split, METH_VARARGS, "zmtp_split(buffer, pos, end, limit, max_frame) -> (messages, pos)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvcache._native",
    .m_doc = "The prefix index's tables and hot loops in C (see kvcache/csrc/module.c).",
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

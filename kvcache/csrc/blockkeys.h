/* Block keys (kvcache/blockkeys.py defines them): a block's token ids hashed to 64 bits, chained to the
 * key of the block before it. The per-token steps and the token readers are inline here, since the
 * index's match (core.c) and the batch apply (events.c) hash prompts and events with them too. */
#ifndef KVGATE_NATIVE_BLOCKKEYS_H
#define KVGATE_NATIVE_BLOCKKEYS_H

#include "common.h"

#define KEY_MASK ((UINT64_C(1) << 60) - 1)
/* 2**64 / golden ratio, odd: the multiplier of the key chain and of the engine hash fold alike
 * (blockkeys.py's MULT, index.py's _MIX). */
#define GOLDEN UINT64_C(0x9E3779B97F4A7C15)

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

/* blockkeys.c */
static int tokens_open(PyObject *o, Tokens *t); /* -1 with an exception when o holds no token ids */
static void tokens_close(Tokens *t);
static int block_hashes(Tokens *tk, Py_ssize_t n, Py_ssize_t bs, uint64_t *out);

#endif

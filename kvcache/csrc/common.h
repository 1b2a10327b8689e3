/* What every part of kvcache._native includes: Python's API (sizes as Py_ssize_t), fixed-width integers,
 * and one byte helper both wire formats use (msgpack.c's reader and zmtp.c's frame headers). */
#ifndef KVGATE_NATIVE_COMMON_H
#define KVGATE_NATIVE_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* n bytes at p as a big-endian unsigned integer (n <= 8). */
static inline uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

#endif

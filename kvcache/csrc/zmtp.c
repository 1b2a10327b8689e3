/* ZMTP 3 frames (kvcache/zmtp.py's connection): a received buffer split into whole messages in one call.
 * Part of kvcache._native (module.c). */
#include "common.h"

/* zmtp_split(buffer, pos, end, limit, max_frame) -> (messages, pos)
 * The complete messages in buffer[pos:end] of a ZMTP 3 connection past its handshake, at most `limit`:
 * one of three frames whose second has 8 bytes as (seq, payload) (a live KV event batch: topic, seq,
 * payload), any other as a list of its frames. Stops before a command frame that starts a message (the
 * caller handles it) and before an incomplete message; pos is where it stopped. ValueError for a frame
 * of more than max_frame bytes or a command inside a message. One call per wake-up and engine instead of
 * a Python loop per frame. */
static PyObject *py_zmtp_split(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *obj;
    Py_ssize_t pos, end, limit;
    unsigned long long max_frame;
    if (!PyArg_ParseTuple(args, "OnnnK", &obj, &pos, &end, &limit, &max_frame)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *out = NULL, *item = NULL;
    if (pos < 0 || pos > end || end > view.len) {
        PyErr_SetString(PyExc_ValueError, "zmtp_split: bad range");
        goto done;
    }
    const uint8_t *b = view.buf;
    out = PyList_New(0);
    if (!out) goto done;
    while (PyList_GET_SIZE(out) < limit) {
        Py_ssize_t p = pos, start[3] = {0, 0, 0};
        uint64_t size[3] = {0, 0, 0};
        int frames = 0, complete = 0;
        for (;;) {
            if (end - p < 2) break;
            uint8_t flags = b[p];
            uint64_t n;
            Py_ssize_t head;
            if (flags & 0x02) {
                if (end - p < 9) break;
                n = be(b + p + 1, 8);
                head = 9;
            } else {
                n = b[p + 1];
                head = 2;
            }
            if (n > max_frame) {
                PyErr_Format(PyExc_ValueError, "frame of %llu bytes", (unsigned long long)n);
                goto fail;
            }
            if (flags & 0x04) {
                if (frames) {
                    PyErr_SetString(PyExc_ValueError, "command inside a message");
                    goto fail;
                }
                break; /* the caller's */
            }
            if ((uint64_t)(end - p - head) < n) break;
            if (frames < 3) {
                start[frames] = p + head;
                size[frames] = n;
            }
            frames++;
            p += head + (Py_ssize_t)n;
            if (!(flags & 0x01)) {
                complete = 1;
                break;
            }
        }
        if (!complete) break;
        if (frames == 3 && size[1] == 8) {
            item = Py_BuildValue("(Ky#)", (unsigned long long)be(b + start[1], 8), (const char *)b + start[2],
                                 (Py_ssize_t)size[2]);
        } else { /* walk it again, keeping every frame */
            item = PyList_New(0);
            for (Py_ssize_t q = pos; item && q < p;) {
                uint64_t n = (b[q] & 0x02) ? be(b + q + 1, 8) : b[q + 1];
                Py_ssize_t head = (b[q] & 0x02) ? 9 : 2;
                PyObject *frame = PyBytes_FromStringAndSize((const char *)b + q + head, (Py_ssize_t)n);
                if (!frame || PyList_Append(item, frame) < 0) Py_CLEAR(item);
                Py_XDECREF(frame);
                q += head + (Py_ssize_t)n;
            }
        }
        if (!item || PyList_Append(out, item) < 0) goto fail;
        Py_CLEAR(item);
        pos = p;
    }
    PyObject *res = Py_BuildValue("(Nn)", out, pos);
    out = res;
    goto done;
fail:
    Py_XDECREF(item);
    Py_CLEAR(out);
done:
    PyBuffer_Release(&view);
    return out;
}

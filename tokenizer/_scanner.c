/* tokenizer._scanner: the byte-level BPE pre-tokenizer split on ASCII text, and the join of cached
 * word ids, for tokenizer/wordcache.py's word-cached encoder. It knows nothing of the rest of kvgate.
 *
 * `split_bytelevel(text, kind)` cuts ASCII text into the pre-tokens of one of three known regexes,
 * exactly as the `tokenizers` library's (Oniguruma) regex with "isolated" splits does; wordcache.py
 * compares it with the tokenizer at load and the tests compare it with Python's `re` on the translated
 * pattern:
 *   kind 0, GPT-2 (ByteLevel use_regex):  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   kind 1, Llama 3 (\p{N}{1,3}) and kind 2, Qwen 2/3 (\p{N}):
 *     (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * On ASCII: \p{L} = [A-Za-z], \p{N} = [0-9], \s = [\t\n\v\f\r ] (Unicode White_Space). Every character is
 * in one of the four classes L, N, S and O (the rest), and each class has an alternative that takes it,
 * so the matches tile the text. `concat_cached(words, cache)` joins the cached id lists of `words`, or
 * names the words not cached yet. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

enum { PT_GPT2 = 0, PT_LLAMA3 = 1, PT_QWEN2 = 2 };

static inline int pt_L(unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
static inline int pt_N(unsigned char c) { return c >= '0' && c <= '9'; }
static inline int pt_S(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
static inline int pt_O(unsigned char c) { return !pt_L(c) && !pt_N(c) && !pt_S(c); }
static inline int pt_CRLF(unsigned char c) { return c == '\r' || c == '\n'; }
static inline unsigned char pt_lower(unsigned char c) { return (c >= 'A' && c <= 'Z') ? (unsigned char)(c + 32) : c; }

/* The end of the run of class `cls` starting at p. */
static inline Py_ssize_t pt_run(int (*cls)(unsigned char), const unsigned char *s, Py_ssize_t p, Py_ssize_t n) {
    while (p < n && cls(s[p])) p++;
    return p;
}
#define PT_RUN(cls, s, p, n) pt_run(cls, s, p, n)

/* A contraction at p ('s 't 're 've 'm 'll 'd): its length, 0 when none. */
static Py_ssize_t pt_contraction(const unsigned char *s, Py_ssize_t p, Py_ssize_t n, int icase) {
    if (s[p] != '\'' || p + 1 >= n) return 0;
    unsigned char a = icase ? pt_lower(s[p + 1]) : s[p + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (p + 2 >= n) return 0;
    unsigned char b = icase ? pt_lower(s[p + 2]) : s[p + 2];
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* \s+(?!\S) then \s+, at p (s[p] in S): the longest whitespace run ending at the text's end or before
 * more whitespace, else the whole run. */
static Py_ssize_t pt_spaces(const unsigned char *s, Py_ssize_t p, Py_ssize_t n) {
    Py_ssize_t k = PT_RUN(pt_S, s, p, n) - p;
    if (p + k == n || k < 2) return k;
    return k - 1;
}

static Py_ssize_t pt_gpt2(const unsigned char *s, Py_ssize_t p, Py_ssize_t n) {
    Py_ssize_t k = pt_contraction(s, p, n, 0);
    if (k) return k;
    unsigned char c = s[p];
    if (c == ' ' && p + 1 < n) {  /* ` ?X+`: the space is taken when X's class follows it */
        unsigned char d = s[p + 1];
        if (pt_L(d)) return PT_RUN(pt_L, s, p + 1, n) - p;
        if (pt_N(d)) return PT_RUN(pt_N, s, p + 1, n) - p;
        if (pt_O(d)) return PT_RUN(pt_O, s, p + 1, n) - p;
    }
    if (pt_L(c)) return PT_RUN(pt_L, s, p, n) - p;
    if (pt_N(c)) return PT_RUN(pt_N, s, p, n) - p;
    if (pt_O(c)) return PT_RUN(pt_O, s, p, n) - p;
    return pt_spaces(s, p, n);
}

static Py_ssize_t pt_llama(const unsigned char *s, Py_ssize_t p, Py_ssize_t n, Py_ssize_t max_digits) {
    Py_ssize_t k = pt_contraction(s, p, n, 1);
    if (k) return k;
    unsigned char c = s[p];
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (!pt_CRLF(c) && !pt_L(c) && !pt_N(c) && p + 1 < n && pt_L(s[p + 1])) return PT_RUN(pt_L, s, p + 1, n) - p;
    if (pt_L(c)) return PT_RUN(pt_L, s, p, n) - p;
    /* \p{N}{1,max} */
    if (pt_N(c)) {
        k = PT_RUN(pt_N, s, p, n) - p;
        return k < max_digits ? k : max_digits;
    }
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    Py_ssize_t q = -1;
    if (c == ' ' && p + 1 < n && pt_O(s[p + 1])) q = PT_RUN(pt_O, s, p + 1, n);
    else if (pt_O(c)) q = PT_RUN(pt_O, s, p, n);
    if (q >= 0) return PT_RUN(pt_CRLF, s, q, n) - p;
    /* \s*[\r\n]+ : up to the run's last \r or \n (one of them; the next is not whitespace or not there) */
    Py_ssize_t end = PT_RUN(pt_S, s, p, n);
    for (Py_ssize_t j = end - 1; j >= p; j--)
        if (pt_CRLF(s[j])) return j + 1 - p;
    return pt_spaces(s, p, n);
}

static PyObject *py_split_bytelevel(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *text;
    int kind;
    if (!PyArg_ParseTuple(args, "Ui", &text, &kind)) return NULL;
    if (!PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "split_bytelevel takes ASCII text only");
        return NULL;
    }
    if (kind < PT_GPT2 || kind > PT_QWEN2) {
        PyErr_Format(PyExc_ValueError, "unknown pre-tokenizer kind %d", kind);
        return NULL;
    }
    const unsigned char *s = PyUnicode_1BYTE_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text), p = 0;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    while (p < n) {
        Py_ssize_t m = kind == PT_GPT2 ? pt_gpt2(s, p, n) : pt_llama(s, p, n, kind == PT_LLAMA3 ? 3 : 1);
        if (m < 1 || p + m > n) {  /* cannot happen: every class is taken by some alternative */
            Py_DECREF(out);
            PyErr_SetString(PyExc_RuntimeError, "split_bytelevel: no pre-token matched");
            return NULL;
        }
        PyObject *w = PyUnicode_FromStringAndSize((const char *)s + p, m);  /* ASCII: valid UTF-8 */
        if (!w || PyList_Append(out, w) < 0) {
            Py_XDECREF(w);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(w);
        p += m;
    }
    return out;
}

static PyObject *py_concat_cached(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *words, *cache;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &words, &PyDict_Type, &cache)) return NULL;
    Py_ssize_t nw = PyList_GET_SIZE(words), total = 0;
    PyObject *missing = NULL;  /* words not cached, in order (repeats kept): a tuple is returned then */
    PyObject **found = PyMem_Malloc((size_t)(nw ? nw : 1) * sizeof(PyObject *));
    if (!found) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < nw; i++) {
        PyObject *word = PyList_GET_ITEM(words, i);
        PyObject *ids = PyDict_GetItemWithError(cache, word);  /* borrowed */
        if (!ids) {
            if (PyErr_Occurred()) goto fail;
            if (!missing && !(missing = PyList_New(0))) goto fail;
            if (PyList_Append(missing, word) < 0) goto fail;
            continue;
        }
        if (!PyList_Check(ids)) {
            PyErr_SetString(PyExc_TypeError, "cached ids must be lists");
            goto fail;
        }
        found[i] = ids;
        total += PyList_GET_SIZE(ids);
    }
    if (missing) {
        PyMem_Free(found);
        PyObject *t = PyList_AsTuple(missing);
        Py_DECREF(missing);
        return t;
    }
    PyObject *out = PyList_New(total);
    if (!out) goto fail;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < nw; i++) {
        Py_ssize_t m = PyList_GET_SIZE(found[i]);
        for (Py_ssize_t j = 0; j < m; j++) {
            PyObject *id = PyList_GET_ITEM(found[i], j);
            Py_INCREF(id);
            PyList_SET_ITEM(out, k++, id);
        }
    }
    PyMem_Free(found);
    return out;
fail:
    Py_XDECREF(missing);
    PyMem_Free(found);
    return NULL;
}

static PyMethodDef methods[] = {
    {"split_bytelevel", py_split_bytelevel, METH_VARARGS,
     "split_bytelevel(ascii_text, kind) -> pre-tokens (kind 0 GPT-2, 1 Llama 3, 2 Qwen 2; tokenizer/wordcache.py)"},
    {"concat_cached", py_concat_cached, METH_VARARGS,
     "concat_cached(words, cache) -> the cached id lists of words joined (a list), or the words not cached (a tuple)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "tokenizer._scanner",
    .m_doc = "The byte-level BPE pre-tokenizer split on ASCII text and the cached-ids join (see tokenizer/_scanner.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__scanner(void) { return PyModule_Create(&module); }

/* The sums and copies of the shared-memory exchanges, each in one pass over memory (see reduce.py).
 *
 * Every function works on float32 (dtype 1) or float64 (dtype 2) arrays given by integer address,
 * sums in rank order ((p0 + p1) + p2) + ..., and scales by a multiplication: the same operations,
 * in the same order, as the torch fallbacks, so the bits are the same. Work goes block by block
 * through an L1-sized buffer, and the GIL is released meanwhile.
 *
 * With `nontemporal`, results are written with streaming stores: they go to memory without first
 * reading the destination's lines into the cache (a third less traffic on a copy), which wins once
 * the exchange's bytes are larger than the cache would keep anyway (reduce.py decides).
 *
 * reduce_into_all(addresses, numel, dtype, scale, average): the all-reduce's chunk, into every array.
 * sum_own_chunk(out_a, out_b, own, addresses, numel, dtype, scale, rank, nontemporal): the split
 *   exchange's own chunk: term j is addresses[j], except this rank's, which is own * scale.
 * sum_segments(parts, segments, dtype, nontemporal): segments = (dst, offset, numel, ...) flat;
 *   dst[i] = sum over j of parts[j][offset + i]: the posted exchange's sum, straight into gradients.
 * copy_segments(segments, dtype, scale, multiply, nontemporal, check): segments = (dst, src, numel, ...);
 *   dst[i] = src[i] * scale (multiply) or src[i]: gradients into a bucket, or results out of one.
 *
 * With `check` (copy_segments, sum_own_chunk) the call returns whether every source element it read (the
 * gradients; sum_own_chunk: this rank's `own`) was finite, found on the way in the blocks already in L1: the
 * non-finite gradient check (engine/replicas/nonfinite.py) at no extra pass over memory. Without, None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

#define BLOCK 2048 /* elements: 8 or 16 KB, well inside L1 */
#define MAX_PARTS 256

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* Copy `nbytes` from src to dst; streaming stores when asked (SSE2 is in every x86-64). */
static void store(void *dst, const void *src, size_t nbytes, int nontemporal) {
#if HAVE_STREAM
    if (nontemporal && nbytes >= 64) {
        char *d = (char *)dst;
        const char *s = (const char *)src;
        size_t head = (16 - ((uintptr_t)d & 15)) & 15; /* element sizes are 4 or 8: head is whole elements */
        memcpy(d, s, head);
        d += head, s += head, nbytes -= head;
        size_t body = nbytes & ~(size_t)15;
        for (size_t i = 0; i < body; i += 16)
            _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
        memcpy(d + body, s + body, nbytes - body);
        return;
    }
#else
    (void)nontemporal;
#endif
    memcpy(dst, src, nbytes);
}

/* Streaming stores are weakly ordered: make them visible before the caller tells peers they are there. */
static void fence(int nontemporal) {
#if HAVE_STREAM
    if (nontemporal) _mm_sfence();
#else
    (void)nontemporal;
#endif
}

/* dst[i] = src[i] * s with streaming stores, without a pass through a buffer: the elements up to
 * dst's first 16-byte boundary one by one, then 16 bytes at a time. Only for a src aligned like dst:
 * otherwise the loads straddle cache lines and the buffered way is faster (measured). */
#if HAVE_STREAM
/* `bad`, when not NULL, is set to 1 if a source element was NaN or infinite: x - x is NaN exactly then (the
 * compare rides along the copy, which waits on memory anyway). */
#define DEFINE_STREAM_SCALED(SUFFIX, T, VECTOR, LANES, SET1, MUL, SUB, UNORD, OR, MASK, LOADU, STREAM)   \
    static void stream_scaled_##SUFFIX(T *dst, const T *src, T s, size_t m, int *bad) {          \
        size_t i = 0, head = ((16 - ((uintptr_t)dst & 15)) & 15) / sizeof(T);                   \
        int b = 0;                                                                               \
        T d;                                                                                     \
        for (; i < head && i < m; i++) {                                                         \
            dst[i] = src[i] * s;                                                                 \
            d = src[i] - src[i];                                                                 \
            b |= d != d;                                                                         \
        }                                                                                        \
        VECTOR scale = SET1(s), seen = SET1(0);                                                  \
        for (; i + LANES <= m; i += LANES) {                                                     \
            VECTOR x = LOADU(src + i), y = SUB(x, x);                                            \
            STREAM(dst + i, MUL(x, scale));                                                      \
            seen = OR(seen, UNORD(y, y));                                                        \
        }                                                                                        \
        for (; i < m; i++) {                                                                     \
            dst[i] = src[i] * s;                                                                 \
            d = src[i] - src[i];                                                                 \
            b |= d != d;                                                                         \
        }                                                                                        \
        if (bad) *bad |= b | (MASK(seen) != 0);                                                  \
    }
DEFINE_STREAM_SCALED(f32, float, __m128, 4, _mm_set1_ps, _mm_mul_ps, _mm_sub_ps, _mm_cmpunord_ps, _mm_or_ps,
                     _mm_movemask_ps, _mm_loadu_ps, _mm_stream_ps)
DEFINE_STREAM_SCALED(f64, double, __m128d, 2, _mm_set1_pd, _mm_mul_pd, _mm_sub_pd, _mm_cmpunord_pd, _mm_or_pd,
                     _mm_movemask_pd, _mm_loadu_pd, _mm_stream_pd)
#else
#define stream_scaled_f32(dst, src, s, m, bad) ((void)0)
#define stream_scaled_f64(dst, src, s, m, bad) ((void)0)
#endif

#define DEFINE_KERNELS(SUFFIX, T)                                                                 \
    VECTOR_CLONES static void add2_##SUFFIX(T *restrict out, const T *restrict a,               \
                                            const T *restrict b, size_t m) {                    \
        for (size_t i = 0; i < m; i++) out[i] = a[i] + b[i];                                   \
    }                                                                                            \
    VECTOR_CLONES static void add_##SUFFIX(T *restrict out, const T *restrict a, size_t m) {    \
        for (size_t i = 0; i < m; i++) out[i] += a[i];                                         \
    }                                                                                            \
    VECTOR_CLONES static void scale_##SUFFIX(T *restrict out, T s, size_t m) {                  \
        for (size_t i = 0; i < m; i++) out[i] *= s;                                            \
    }                                                                                            \
    /* 1 if an element is NaN or infinite (x - x is NaN exactly then); run on blocks in L1. */   \
    VECTOR_CLONES static int nonfinite_##SUFFIX(const T *restrict a, size_t m) {               \
        int bad = 0;                                                                             \
        for (size_t i = 0; i < m; i++) {                                                         \
            T d = a[i] - a[i];                                                                   \
            bad |= d != d;                                                                       \
        }                                                                                        \
        return bad;                                                                              \
    }                                                                                            \
    VECTOR_CLONES static void scaled_##SUFFIX(T *restrict out, const T *restrict a, T s,        \
                                              size_t m) {                                        \
        for (size_t i = 0; i < m; i++) out[i] = a[i] * s;                                       \
    }                                                                                            \
    /* scaled_, and 1 if an element of `a` is NaN or infinite, found in the same loop. */          \
    VECTOR_CLONES static int scaled_checked_##SUFFIX(T *restrict out, const T *restrict a, T s, \
                                                     size_t m) {                                 \
        int bad = 0;                                                                             \
        for (size_t i = 0; i < m; i++) {                                                         \
            T x = a[i], d = x - x;                                                               \
            out[i] = x * s;                                                                      \
            bad |= d != d;                                                                       \
        }                                                                                        \
        return bad;                                                                              \
    }                                                                                            \
    /* The product is rounded before the sum (-ffp-contract=off): the bits of a scale, then an add. */ \
    VECTOR_CLONES static void scaled_add2_##SUFFIX(T *restrict out, const T *restrict a, T s,   \
                                                   const T *restrict b, size_t m) {              \
        for (size_t i = 0; i < m; i++) out[i] = a[i] * s + b[i];                                \
    }                                                                                            \
    VECTOR_CLONES static void add2_scaled_##SUFFIX(T *restrict out, const T *restrict a,        \
                                                   const T *restrict b, T s, size_t m) {         \
        for (size_t i = 0; i < m; i++) out[i] = a[i] + b[i] * s;                                \
    }                                                                                            \
    VECTOR_CLONES static void add_scaled_##SUFFIX(T *restrict out, const T *restrict a, T s,    \
                                                  size_t m) {                                    \
        for (size_t i = 0; i < m; i++) out[i] += a[i] * s;                                      \
    }                                                                                            \
    static void reduce_##SUFFIX(T **parts, int count, size_t numel, T s, int average) {          \
        T total[BLOCK];                                                                          \
        for (size_t start = 0; start < numel; start += BLOCK) {                                  \
            size_t m = numel - start < BLOCK ? numel - start : BLOCK;                            \
            add2_##SUFFIX(total, parts[0] + start, parts[1] + start, m);                         \
            for (int j = 2; j < count; j++) add_##SUFFIX(total, parts[j] + start, m);            \
            if (average) scale_##SUFFIX(total, s, m);                                            \
            for (int j = 0; j < count; j++) memcpy(parts[j] + start, total, m * sizeof(T));      \
        }                                                                                        \
    }                                                                                            \
    /* out_a and out_b may be `own` itself: each block is read before it is written. */         \
    static void own_chunk_##SUFFIX(T *out_a, T *out_b, const T *own, T **others, int count,     \
                                   int rank, size_t numel, T s, int nt, int *bad) {              \
        T total[BLOCK];                                                                          \
        for (size_t start = 0; start < numel; start += BLOCK) {                                  \
            size_t m = numel - start < BLOCK ? numel - start : BLOCK;                            \
            if (bad) *bad |= nonfinite_##SUFFIX(own + start, m); /* this rank's term, before it is written */ \
            /* The first two terms in one pass, this rank's scaled on the way. */                \
            if (rank == 0) scaled_add2_##SUFFIX(total, own + start, s, others[1] + start, m);    \
            else if (rank == 1) add2_scaled_##SUFFIX(total, others[0] + start, own + start, s, m); \
            else add2_##SUFFIX(total, others[0] + start, others[1] + start, m);                  \
            for (int j = 2; j < count; j++) {                                                    \
                if (j == rank) add_scaled_##SUFFIX(total, own + start, s, m);                    \
                else add_##SUFFIX(total, others[j] + start, m);                                  \
            }                                                                                    \
            store(out_a + start, total, m * sizeof(T), nt);                                      \
            if (out_b != out_a) store(out_b + start, total, m * sizeof(T), nt);                  \
        }                                                                                        \
    }                                                                                            \
    static void sum_segment_##SUFFIX(T *dst, T **parts, int count, size_t offset, size_t numel, \
                                     int nt) {                                                   \
        T total[BLOCK];                                                                          \
        if (count == 1) {                                                                        \
            store(dst, parts[0] + offset, numel * sizeof(T), nt);                                \
            return;                                                                              \
        }                                                                                        \
        if (count == 2 && !nt) { /* straight into dst: no pass through a buffer */             \
            add2_##SUFFIX(dst, parts[0] + offset, parts[1] + offset, numel);                     \
            return;                                                                              \
        }                                                                                        \
        for (size_t start = 0; start < numel; start += BLOCK) {                                  \
            size_t m = numel - start < BLOCK ? numel - start : BLOCK;                            \
            size_t at = offset + start;                                                          \
            add2_##SUFFIX(total, parts[0] + at, parts[1] + at, m);                               \
            for (int j = 2; j < count; j++) add_##SUFFIX(total, parts[j] + at, m);               \
            store(dst + start, total, m * sizeof(T), nt);                                        \
        }                                                                                        \
    }                                                                                            \
    static void copy_segment_##SUFFIX(T *dst, const T *src, size_t numel, T s, int multiply,    \
                                      int nt, int *bad) {                                        \
        T total[BLOCK];                                                                          \
        if (!multiply) {                                                                         \
            store(dst, src, numel * sizeof(T), nt);                                              \
            if (bad) *bad |= nonfinite_##SUFFIX(dst, numel);                                     \
            return;                                                                              \
        }                                                                                        \
        /* Streaming: straight to memory when src and dst are aligned alike. Otherwise (and through \
         * the cache) a buffer, then store(): writing a shared-memory dst directly measured slower, \
         * as memcpy's string stores take the lines without reading them first. */              \
        if (nt && HAVE_STREAM && !(((uintptr_t)dst ^ (uintptr_t)src) & 15)) {                  \
            stream_scaled_##SUFFIX(dst, src, s, numel, bad);                                     \
            return;                                                                              \
        }                                                                                        \
        for (size_t start = 0; start < numel; start += BLOCK) {                                  \
            size_t m = numel - start < BLOCK ? numel - start : BLOCK;                            \
            if (bad)                                                                             \
                *bad |= scaled_checked_##SUFFIX(total, src + start, s, m);                       \
            else                                                                                 \
                scaled_##SUFFIX(total, src + start, s, m);                                       \
            store(dst + start, total, m * sizeof(T), nt);                                        \
        }                                                                                        \
    }

DEFINE_KERNELS(f32, float)
DEFINE_KERNELS(f64, double)

static int parse_addresses(PyObject *addresses, void **parts, Py_ssize_t *count, Py_ssize_t least) {
    *count = PyTuple_GET_SIZE(addresses);
    if (*count < least || *count > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "%zd arrays given, expected %zd..%d", *count, least, MAX_PARTS);
        return -1;
    }
    for (Py_ssize_t j = 0; j < *count; j++) {
        parts[j] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(addresses, j));
        if (parts[j] == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a null address");
            return -1;
        }
    }
    return 0;
}

/* A flat sequence of integer triples into a new array (PyMem_Free it); NULL with an error set. */
static Py_ssize_t *parse_triples(PyObject *sequence, Py_ssize_t *triples) {
    PyObject *fast = PySequence_Fast(sequence, "segments must be a sequence of integers");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n % 3) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "segments: %zd integers, expected triples", n);
        return NULL;
    }
    Py_ssize_t *values = PyMem_Malloc((n ? n : 1) * sizeof(Py_ssize_t));
    if (values == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        values[i] = PyLong_AsSsize_t(items[i]);
        if (values[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(values);
            Py_DECREF(fast);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i += 3) { /* a negative number, or a null destination for elements */
        if (values[i] < 0 || values[i + 1] < 0 || values[i + 2] < 0 || (values[i + 2] && !values[i])) {
            PyErr_Format(PyExc_ValueError, "segments: triple %zd is (%zd, %zd, %zd)", i / 3, values[i],
                         values[i + 1], values[i + 2]);
            PyMem_Free(values);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *triples = n / 3;
    return values;
}

static int check_dtype(int dtype) {
    if (dtype != 1 && dtype != 2) {
        PyErr_Format(PyExc_ValueError, "dtype code %d, expected 1 (float32) or 2 (float64)", dtype);
        return -1;
    }
    return 0;
}

static PyObject *sum_own_chunk(PyObject *self, PyObject *args) {
    Py_ssize_t out_a, out_b, own, numel, count;
    PyObject *addresses;
    int dtype, rank, nt = 0, check = 0, bad = 0;
    double scale;
    if (!PyArg_ParseTuple(args, "nnnO!nidi|pp", &out_a, &out_b, &own, &PyTuple_Type, &addresses, &numel, &dtype,
                          &scale, &rank, &nt, &check))
        return NULL;
    void *others[MAX_PARTS];
    if (parse_addresses(addresses, others, &count, 2) < 0) return NULL;
    if (numel < 0 || rank < 0 || rank >= count || check_dtype(dtype) < 0 || !out_a || !out_b || !own) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "sum_own_chunk: numel %zd, rank %d of %zd", numel, rank, count);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (dtype == 1)
        own_chunk_f32((float *)out_a, (float *)out_b, (const float *)own, (float **)others, (int)count, rank,
                      (size_t)numel, (float)scale, nt, check ? &bad : NULL);
    else
        own_chunk_f64((double *)out_a, (double *)out_b, (const double *)own, (double **)others, (int)count, rank,
                      (size_t)numel, scale, nt, check ? &bad : NULL);
    fence(nt);
    Py_END_ALLOW_THREADS
    if (check) return PyBool_FromLong(!bad);
    Py_RETURN_NONE;
}

static PyObject *sum_segments(PyObject *self, PyObject *args) {
    PyObject *addresses, *segments;
    int dtype, nt = 0;
    if (!PyArg_ParseTuple(args, "O!Oi|p", &PyTuple_Type, &addresses, &segments, &dtype, &nt)) return NULL;
    void *parts[MAX_PARTS];
    Py_ssize_t count, triples;
    if (parse_addresses(addresses, parts, &count, 1) < 0 || check_dtype(dtype) < 0) return NULL;
    Py_ssize_t *values = parse_triples(segments, &triples);
    if (values == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < triples; k++) {
        Py_ssize_t *v = values + 3 * k;
        if (dtype == 1)
            sum_segment_f32((float *)v[0], (float **)parts, (int)count, (size_t)v[1], (size_t)v[2], nt);
        else
            sum_segment_f64((double *)v[0], (double **)parts, (int)count, (size_t)v[1], (size_t)v[2], nt);
    }
    fence(nt);
    Py_END_ALLOW_THREADS
    PyMem_Free(values);
    Py_RETURN_NONE;
}

static PyObject *copy_segments(PyObject *self, PyObject *args) {
    PyObject *segments;
    int dtype, multiply, nt = 0, check = 0, bad = 0;
    double scale;
    if (!PyArg_ParseTuple(args, "Oidp|pp", &segments, &dtype, &scale, &multiply, &nt, &check)) return NULL;
    if (check_dtype(dtype) < 0) return NULL;
    Py_ssize_t triples;
    Py_ssize_t *values = parse_triples(segments, &triples);
    if (values == NULL) return NULL;
    for (Py_ssize_t k = 0; k < triples; k++) {
        if (values[3 * k + 1] == 0 && values[3 * k + 2] != 0) {
            PyMem_Free(values);
            PyErr_Format(PyExc_ValueError, "copy_segments: segment %zd has a null source", k);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < triples; k++) {
        Py_ssize_t *v = values + 3 * k;
        if (dtype == 1)
            copy_segment_f32((float *)v[0], (const float *)v[1], (size_t)v[2], (float)scale, multiply, nt,
                             check ? &bad : NULL);
        else
            copy_segment_f64((double *)v[0], (const double *)v[1], (size_t)v[2], scale, multiply, nt,
                             check ? &bad : NULL);
    }
    fence(nt);
    Py_END_ALLOW_THREADS
    PyMem_Free(values);
    if (check) return PyBool_FromLong(!bad);
    Py_RETURN_NONE;
}

static PyObject *reduce_into_all(PyObject *self, PyObject *args) {
    PyObject *addresses;
    Py_ssize_t numel;
    int dtype, average;
    double scale;
    if (!PyArg_ParseTuple(args, "O!nidp", &PyTuple_Type, &addresses, &numel, &dtype, &scale, &average))
        return NULL;
    void *parts[MAX_PARTS];
    Py_ssize_t count;
    if (parse_addresses(addresses, parts, &count, 2) < 0 || check_dtype(dtype) < 0) return NULL;
    if (numel < 0) {
        PyErr_Format(PyExc_ValueError, "reduce_into_all: numel %zd", numel);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (dtype == 1)
        reduce_f32((float **)parts, (int)count, (size_t)numel, (float)scale, average);
    else
        reduce_f64((double **)parts, (int)count, (size_t)numel, scale, average);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"reduce_into_all", reduce_into_all, METH_VARARGS,
     "reduce_into_all(addresses, numel, dtype, scale, average): sum in rank order, scale, write to all."},
    {"sum_own_chunk", sum_own_chunk, METH_VARARGS,
     "sum_own_chunk(out_a, out_b, own, addresses, numel, dtype, scale, rank, nontemporal=False, check=False): "
     "the split exchange's own chunk; with check, whether every element of own was finite."},
    {"sum_segments", sum_segments, METH_VARARGS,
     "sum_segments(parts, segments, dtype, nontemporal=False): rank-order sums of pieces of `parts`."},
    {"copy_segments", copy_segments, METH_VARARGS,
     "copy_segments(segments, dtype, scale, multiply, nontemporal=False, check=False): copies, optionally "
     "scaled; with check, whether every source element was finite."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "phalanx._reduce_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__reduce_kernels(void) { return PyModule_Create(&module); }

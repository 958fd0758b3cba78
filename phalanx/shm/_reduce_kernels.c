/* The sum of one shared-memory exchange chunk, in one pass (see shm_reduce.py).
 *
 * reduce_into_all(addresses, numel, dtype, scale, average): `addresses` are the integer addresses
 * of `len(addresses) >= 2` float32 (dtype 1) or float64 (dtype 2) arrays of `numel` elements. Each
 * element is summed in rank order ((p0 + p1) + p2) + ..., multiplied by `scale` if `average`, and
 * written back into every array: the same operations, in the same order, as the torch fallback,
 * so the bits are the same. Torch ops take a pass over memory each (sum, scale, one copy per
 * array) and a Python call per cache-sized block; here every block stays in L1 and the GIL is
 * released while it runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>

#define BLOCK 2048 /* elements: 8 or 16 KB, well inside L1 */
#define MAX_PARTS 256

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

#define DEFINE_REDUCE(SUFFIX, T)                                                                  \
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
    static void reduce_##SUFFIX(T **parts, int count, size_t numel, T s, int average) {          \
        T total[BLOCK];                                                                          \
        for (size_t start = 0; start < numel; start += BLOCK) {                                  \
            size_t m = numel - start < BLOCK ? numel - start : BLOCK;                            \
            add2_##SUFFIX(total, parts[0] + start, parts[1] + start, m);                         \
            for (int j = 2; j < count; j++) add_##SUFFIX(total, parts[j] + start, m);            \
            if (average) scale_##SUFFIX(total, s, m);                                            \
            for (int j = 0; j < count; j++) memcpy(parts[j] + start, total, m * sizeof(T));      \
        }                                                                                        \
    }

DEFINE_REDUCE(f32, float)
DEFINE_REDUCE(f64, double)

/* The split exchange's own chunk: term j is others[j], except this rank's, which is own * s; the
 * rank-order sum goes to out_a and out_b (either may be `own` itself: each block is read first). */
#define DEFINE_OWN_CHUNK(SUFFIX, T)                                                               \
    VECTOR_CLONES static void scaled_##SUFFIX(T *restrict out, const T *restrict a, T s,        \
                                              size_t m) {                                        \
        for (size_t i = 0; i < m; i++) out[i] = a[i] * s;                                       \
    }                                                                                            \
    static void own_chunk_##SUFFIX(T *out_a, T *out_b, const T *own, T **others, int count,     \
                                   int rank, size_t numel, T s) {                                \
        T total[BLOCK], term[BLOCK];                                                             \
        for (size_t start = 0; start < numel; start += BLOCK) {                                  \
            size_t m = numel - start < BLOCK ? numel - start : BLOCK;                            \
            if (rank == 0) scaled_##SUFFIX(total, own + start, s, m);                            \
            else memcpy(total, others[0] + start, m * sizeof(T));                                \
            for (int j = 1; j < count; j++) {                                                    \
                if (j == rank) {                                                                 \
                    scaled_##SUFFIX(term, own + start, s, m);                                    \
                    add_##SUFFIX(total, term, m);                                                \
                } else {                                                                         \
                    add_##SUFFIX(total, others[j] + start, m);                                   \
                }                                                                                \
            }                                                                                    \
            memcpy(out_a + start, total, m * sizeof(T));                                         \
            memcpy(out_b + start, total, m * sizeof(T));                                         \
        }                                                                                        \
    }

DEFINE_OWN_CHUNK(f32, float)
DEFINE_OWN_CHUNK(f64, double)

static int parse_addresses(PyObject *addresses, void **parts, Py_ssize_t *count) {
    *count = PyTuple_GET_SIZE(addresses);
    if (*count < 2 || *count > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "%zd arrays given, expected 2..%d", *count, MAX_PARTS);
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

static PyObject *sum_own_chunk(PyObject *self, PyObject *args) {
    Py_ssize_t out_a, out_b, own, numel, count;
    PyObject *addresses;
    int dtype, rank;
    double scale;
    if (!PyArg_ParseTuple(args, "nnnO!nidi", &out_a, &out_b, &own, &PyTuple_Type, &addresses, &numel, &dtype,
                          &scale, &rank))
        return NULL;
    void *others[MAX_PARTS];
    if (parse_addresses(addresses, others, &count) < 0) return NULL;
    if (numel < 0 || rank < 0 || rank >= count || (dtype != 1 && dtype != 2) || !out_a || !out_b || !own) {
        PyErr_Format(PyExc_ValueError, "sum_own_chunk: numel %zd, rank %d of %zd, dtype %d", numel, rank, count, dtype);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (dtype == 1)
        own_chunk_f32((float *)out_a, (float *)out_b, (const float *)own, (float **)others, (int)count, rank,
                      (size_t)numel, (float)scale);
    else
        own_chunk_f64((double *)out_a, (double *)out_b, (const double *)own, (double **)others, (int)count, rank,
                      (size_t)numel, scale);
    Py_END_ALLOW_THREADS
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
    if (parse_addresses(addresses, parts, &count) < 0) return NULL;
    if (numel < 0 || (dtype != 1 && dtype != 2)) {
        PyErr_Format(PyExc_ValueError, "reduce_into_all: numel %zd, dtype %d (1 or 2)", numel, dtype);
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
     "sum_own_chunk(out_a, out_b, own, addresses, numel, dtype, scale, rank): the split exchange's own chunk."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "phalanx._reduce_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__reduce_kernels(void) { return PyModule_Create(&module); }

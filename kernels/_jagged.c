/* The CPU bitmap kernel of deck.kernels.jagged_unique: mark, scan and clear in one native pass.
 *
 * numpy's version needs one fancy-index pass to mark, a flatnonzero over the whole map (a count
 * pass, then an index pass), a fancy-index pass to clear and a subtract per table to turn map
 * rows into ids. Here a table's ids are marked, then its slice of the map is scanned a 64-bit
 * word at a time -- zero words (most of a sparse map) cost one load -- and each set byte becomes
 * an output id and is cleared on the way, so the map is all zero again when the call returns.
 * The GIL is released: the Python side runs groups of tables on worker threads.
 *
 * mark_scan(values, itemsize, starts, row_starts, map, out, counts) -> (number of ids written,
 * bad table or -1). values holds ids of `itemsize` bytes (4 or 8) for tables t = 0..T-1 at
 * [starts[t], starts[t+1]); table t owns map bytes [row_starts[t], row_starts[t+1]). Ids of each
 * table are written to `out` (int64) ascending, back to back, and their count to counts[t]. An id
 * outside [0, row_starts[t+1] - row_starts[t]) stops the call: the map is cleared and the
 * table's index is returned as `bad` so that the caller can name it. `out` must hold one int64
 * per id of the group (the most ids it can produce).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Emit (ascending) and clear every set byte of map[0, rows); returns how many. */
static int64_t scan_clear(uint8_t *map, int64_t rows, int64_t *out)
{
    int64_t k = 0, r = 0;
    for (; r < rows && ((uintptr_t)(map + r) & 7); ++r)
        if (map[r]) { map[r] = 0; out[k++] = r; }
    for (; r + 8 <= rows; r += 8) {
        uint64_t word;
        memcpy(&word, map + r, 8);
        if (!word)
            continue;
        for (int b = 0; b < 8; ++b)
            if (map[r + b]) out[k++] = r + b;
        memset(map + r, 0, 8);
    }
    for (; r < rows; ++r)
        if (map[r]) { map[r] = 0; out[k++] = r; }
    return k;
}

/* Clear what a failed call had marked (tables [0, upto]). */
static void clear_tables(uint8_t *map, const int64_t *row_starts, int64_t upto)
{
    memset(map, 0, (size_t)(row_starts[upto + 1] - row_starts[0]));
}

#define MARK(TYPE)                                                            \
    do {                                                                      \
        const TYPE *ids = (const TYPE *)v + starts[t];                     \
        for (int64_t i = 0; i < count; ++i) {                                 \
            int64_t id = (int64_t)ids[i];                                     \
            if ((uint64_t)id >= (uint64_t)rows) { bad = t; break; }           \
            table_map[id] = 1;                                                \
        }                                                                     \
    } while (0)

static PyObject *mark_scan(PyObject *self, PyObject *args)
{
    Py_buffer values, starts_b, row_starts_b, map_b, out_b, counts_b;
    int itemsize;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iy*y*w*w*w*", &values, &itemsize, &starts_b, &row_starts_b,
                          &map_b, &out_b, &counts_b))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t num_tables = counts_b.len / (Py_ssize_t)sizeof(int64_t);
    if ((itemsize != 4 && itemsize != 8) ||
        starts_b.len != (num_tables + 1) * (Py_ssize_t)sizeof(int64_t) ||
        row_starts_b.len != starts_b.len) {
        PyErr_SetString(PyExc_ValueError, "mark_scan: inconsistent arguments");
        goto done;
    }
    const int64_t *starts = starts_b.buf, *row_starts = row_starts_b.buf;
    if (values.len < starts[num_tables] * itemsize ||
        map_b.len < row_starts[num_tables] - row_starts[0] ||
        out_b.len < (starts[num_tables] - starts[0]) * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "mark_scan: buffers too small");
        goto done;
    }
    const void *v = values.buf;
    uint8_t *map = map_b.buf;
    int64_t *out = out_b.buf, *counts = counts_b.buf;
    int64_t written = 0, bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < num_tables && bad < 0; ++t) {
        int64_t count = starts[t + 1] - starts[t];
        int64_t rows = row_starts[t + 1] - row_starts[t];
        uint8_t *table_map = map + (row_starts[t] - row_starts[0]);
        if (itemsize == 8)
            MARK(int64_t);
        else
            MARK(int32_t);
        if (bad >= 0) {
            clear_tables(map, row_starts, t);
            break;
        }
        counts[t] = count ? scan_clear(table_map, rows, out + written) : 0;
        written += counts[t];
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(LL)", (long long)written, (long long)bad);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&starts_b);
    PyBuffer_Release(&row_starts_b);
    PyBuffer_Release(&map_b);
    PyBuffer_Release(&out_b);
    PyBuffer_Release(&counts_b);
    return result;
}

static PyMethodDef methods[] = {
    {"mark_scan", mark_scan, METH_VARARGS,
     "Mark, scan and clear a group of tables' slices of a byte map (see the file's comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jagged", "Native CPU bitmap kernel of deck.kernels.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jagged(void) { return PyModule_Create(&module); }

/* deck's native CPU kernels (the extension deck.kernels._native; loaded by kernels/native.py).
 * Each function is called by one module of deck.kernels, on the training path:
 *
 *   claim_bit, claim_blocks  the tracker's claim over its byte map (kernels/claim.py)
 *   mark_rows, clear_rows    the tracker's compaction and its claim from the journal (claim.py)
 *   gather_rows              the snapshot's copy of rows into chunk buffers (kernels/gather.py)
 *   copy_once                a copy-on-write snapshot's copy: each row once, by whichever thread
 *                            claims it first (kernels/gather.py)
 *   copy_chunks              copy_once over several chunks at once, for the background copy
 *   pending_slots            the copy-on-write guard's lookup of the rows it must copy first
 *   bloom_fill               a chunk's row index: min, max, Bloom bits (kernels/bloom.py)
 *
 * Each checks its arguments (buffer sizes, the bit, row positions) and releases the GIL for its
 * loop. Without this extension (no C compiler at install) each caller runs its fallback: torch
 * for the claim and the copy, numpy for the row index (deck/format/rowindex.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>

/* Rows [i, hi) of a claim: with count_only, counts the rows whose byte has `bit` (changing
 * nothing); else writes them to out[k..] and clears the bit in them. Returns the new k; sets
 * *full and stops when out has no room for a row (the rows taken so far stay in out, cleared).
 * Eight bytes are tested per load, so a clean stretch costs one load per eight rows. */
static int64_t claim_range(uint8_t *map, int64_t i, const int64_t hi, const int bit,
                           const int count_only, int64_t *out, const int64_t room, int64_t k,
                           int *full)
{
    const uint64_t lanes = 0x0101010101010101ULL * (uint64_t)bit;
    for (; i + 8 <= hi; i += 8) {
        uint64_t w;
        memcpy(&w, map + i, 8);
        uint64_t hit = w & lanes;
        if (!hit)
            continue;
        if (count_only) {
            k += __builtin_popcountll(hit);
            continue;
        }
        if (k + __builtin_popcountll(hit) > room) {
            *full = 1;
            return k;
        }
        memcpy(map + i, &(uint64_t){w & ~lanes}, 8);
        do {
            out[k++] = i + (__builtin_ctzll(hit) >> 3);
            hit &= hit - 1;
        } while (hit);
    }
    for (; i < hi; ++i) {
        if (!(map[i] & bit))
            continue;
        if (!count_only) {
            if (k == room) {
                *full = 1;
                return k;
            }
            map[i] &= (uint8_t)~bit;
            out[k] = i;
        }
        ++k;
    }
    return k;
}

/* Undo a take that ran out of room: set the bit again in the k rows of out (and in their blocks'
 * summary bytes when there is a summary). */
static void claim_give_back(uint8_t *map, uint8_t *blocks, const int shift, const int bit,
                            const int64_t *out, const int64_t k)
{
    for (int64_t j = 0; j < k; ++j) {
        map[out[j]] |= (uint8_t)bit;
        if (blocks)
            blocks[out[j] >> shift] |= (uint8_t)bit;
    }
}

static int claim_bit_ok(const int bit)
{
    if (bit <= 0 || bit > 0x80 || (bit & (bit - 1))) {
        PyErr_SetString(PyExc_ValueError, "claim: bit must be one of 1, 2, 4, ..., 128");
        return 0;
    }
    return 1;
}

/* claim_bit(bytes, bit, out) -> n: the tracker's claim over the whole map (deck.kernels.claim;
 * the baseline of claim_blocks below).
 *   bytes  uint8 (N,): one byte per row, one bit per consumer
 *   bit    the consumer's bit (1 << c)
 *   out    int64 with room for every such row, or empty: then only count
 * Writes the rows whose byte has `bit`, ascending, to out and clears that bit in them, in one
 * pass; with an empty out only counts them and changes nothing. When out is too small, returns
 * -1 and changes nothing (the bits cleared so far are set again). */
static PyObject *claim_bit(PyObject *self, PyObject *args)
{
    Py_buffer map_b, out_b;
    int bit;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*iw*", &map_b, &bit, &out_b))
        return NULL;
    PyObject *result = NULL;
    if (!claim_bit_ok(bit))
        goto done;
    const int64_t n = map_b.len, room = out_b.len / (Py_ssize_t)sizeof(int64_t);
    const int count_only = out_b.len == 0;
    uint8_t *map = map_b.buf;
    int64_t *out = out_b.buf, k = 0;
    int full = 0;
    Py_BEGIN_ALLOW_THREADS
    k = claim_range(map, 0, n, bit, count_only, out, room, 0, &full);
    if (full) { /* the caller counted too few: give back what was taken */
        claim_give_back(map, NULL, 0, bit, out, k);
        k = -1;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong((long long)k);
done:
    PyBuffer_Release(&map_b);
    PyBuffer_Release(&out_b);
    return result;
}

static int summary_ok(const int64_t n, const int64_t nb, const int shift)
{
    if (shift < 0 || shift > 30 || nb != (n + ((int64_t)1 << shift) - 1) >> shift) {
        PyErr_SetString(PyExc_ValueError, "the tracker's summary must have one byte per 2**shift rows");
        return 0;
    }
    return 1;
}

/* CLAIM_DENSE: claim_blocks reads the whole map when more than 1 in CLAIM_DENSE blocks are
 * marked (measured: at a quarter of the blocks marked the two ways cost the same). */
enum { CLAIM_BATCH = 1024, CLAIM_AHEAD = 16, CLAIM_DENSE = 4 };

/* claim_blocks(bytes, blocks, shift, bit, out) -> n: claim_bit that reads only marked blocks.
 *   blocks  uint8 (ceil(N / 2**shift),): the summary; byte b has every bit that a row of block b
 *           (rows [b << shift, (b + 1) << shift)) has (more bits are allowed: they cost a scan)
 *   shift   log2 of the rows per block (0..30)
 * Same rows, same map after and same -1 as claim_bit; a take also clears `bit` in the summary
 * byte of every block it read (none of its rows has the bit any more; after a -1 the blocks of
 * the given-back rows have it again). The summary is tested eight blocks per load, then each
 * marked block's rows: the cost is N / 2**shift / 8 loads plus the marked blocks, whatever N
 * (when most blocks are marked the whole map is read in one sequential pass instead). */
static PyObject *claim_blocks(PyObject *self, PyObject *args)
{
    Py_buffer map_b, blocks_b, out_b;
    int shift, bit;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*w*iiw*", &map_b, &blocks_b, &shift, &bit, &out_b))
        return NULL;
    PyObject *result = NULL;
    if (!claim_bit_ok(bit))
        goto done;
    const int64_t n = map_b.len, nb = blocks_b.len;
    if (!summary_ok(n, nb, shift))
        goto done;
    const int64_t room = out_b.len / (Py_ssize_t)sizeof(int64_t), size = (int64_t)1 << shift;
    const int count_only = out_b.len == 0;
    const uint64_t lanes = 0x0101010101010101ULL * (uint64_t)bit;
    uint8_t *map = map_b.buf, *blocks = blocks_b.buf;
    int64_t *out = out_b.buf, k = 0;
    int full = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t batch[CLAIM_BATCH], marked = 0, b = 0;
    for (; b + 8 <= nb; b += 8) {
        uint64_t w;
        memcpy(&w, blocks + b, 8);
        marked += __builtin_popcountll(w & lanes);
    }
    for (; b < nb; ++b)
        marked += (blocks[b] & bit) != 0;
    const int dense = marked * CLAIM_DENSE > nb;
    if (dense) { /* many blocks marked: one sequential pass is cheaper */
        k = claim_range(map, 0, n, bit, count_only, out, room, 0, &full);
        for (b = 0; !count_only && !full && b < nb; ++b)
            blocks[b] &= (uint8_t)~bit;
    }
    /* Marked blocks are gathered a batch at a time, then read with the block CLAIM_AHEAD places
     * on prefetched: they lie anywhere in a map far larger than the cache, so reading them one
     * miss after another would leave the memory system idle. */
    for (b = dense ? nb : 0; b < nb && !full;) {
        int m = 0;
        while (b < nb && m <= CLAIM_BATCH - 8) {
            if (b + 8 <= nb) { /* eight clean blocks: one load */
                uint64_t w;
                memcpy(&w, blocks + b, 8);
                if (!(w & lanes)) {
                    b += 8;
                    continue;
                }
            }
            for (const int64_t end = b + 8 < nb ? b + 8 : nb; b < end; ++b)
                if (blocks[b] & bit)
                    batch[m++] = b;
        }
        for (int j = 0; j < m; ++j) {
            if (j + CLAIM_AHEAD < m)
                __builtin_prefetch(map + (batch[j + CLAIM_AHEAD] << shift), 1);
            const int64_t lo = batch[j] << shift, hi = lo + size < n ? lo + size : n;
            k = claim_range(map, lo, hi, bit, count_only, out, room, k, &full);
            if (full)
                break;
            if (!count_only)
                blocks[batch[j]] &= (uint8_t)~bit;
        }
    }
    if (full) { /* the caller counted too few: give back what was taken */
        claim_give_back(map, blocks, shift, bit, out, k);
        k = -1;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong((long long)k);
done:
    PyBuffer_Release(&map_b);
    PyBuffer_Release(&blocks_b);
    PyBuffer_Release(&out_b);
    return result;
}

/* Rows given by position must all lie in the map (or table): ids[i] - base in [0, n). Checked
 * before anything changes, so a bad position leaves the map, the summary and the caller's journal
 * (or the chunk buffer) as they were. One per width of position: int64, or int32 (a journal of a
 * map under 2**31 rows: half the bytes to sort and read in the stall). */
#define ROWS_IN(NAME, T)                                                                           \
    static int NAME(const T *ids, const int64_t base, const int64_t m, const int64_t n)            \
    {                                                                                              \
        for (int64_t i = 0; i < m; ++i)                                                            \
            if ((uint64_t)((int64_t)ids[i] - base) >= (uint64_t)n)                                 \
                return 0;                                                                          \
        return 1;                                                                                  \
    }
ROWS_IN(rows_in64, int64_t)
ROWS_IN(rows_in32, int32_t)

/* mark_rows(bytes, blocks, shift, bits, ids, new_ids, new_old) -> k: the tracker's compaction.
 *   ids      int64 (M,): row positions, any order, duplicates allowed
 *   new_ids  int64 (M,), new_old uint8 (M,): out
 * Sets `bits` in the byte of every row of ids and in its block's summary byte. Each row whose
 * byte lacked one of `bits` is written once (at its first appearance) to new_ids[k], with its
 * byte before to new_old[k]: the rows that just became pending for some consumer, so the tracker
 * can journal them and claim them later without reading the map. Returns k, or -1 (nothing
 * changed) when a position is outside the map. */
static PyObject *mark_rows(PyObject *self, PyObject *args)
{
    Py_buffer map_b, blocks_b, ids_b, new_b, old_b;
    int shift, bits;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*w*iiy*w*w*", &map_b, &blocks_b, &shift, &bits, &ids_b, &new_b,
                          &old_b))
        return NULL;
    PyObject *result = NULL;
    const int64_t n = map_b.len, m = ids_b.len / (Py_ssize_t)sizeof(int64_t);
    if (!summary_ok(n, blocks_b.len, shift))
        goto done;
    if (bits <= 0 || bits > 0xFF || ids_b.len % (Py_ssize_t)sizeof(int64_t) ||
        new_b.len < ids_b.len || old_b.len < m) {
        PyErr_SetString(PyExc_ValueError, "mark_rows: inconsistent arguments");
        goto done;
    }
    uint8_t *map = map_b.buf, *blocks = blocks_b.buf, *old = old_b.buf;
    const int64_t *ids = ids_b.buf;
    int64_t *out = new_b.buf, k = 0;
    const uint8_t all = (uint8_t)bits;
    Py_BEGIN_ALLOW_THREADS
    if (!rows_in64(ids, 0, m, n)) {
        k = -1;
    } else {
        for (int64_t i = 0; i < m; ++i) {
            const int64_t r = ids[i];
            const uint8_t before = map[r];
            if ((before & all) == all)
                continue; /* its block's summary already has these bits */
            map[r] = before | all;
            blocks[r >> shift] |= all;
            out[k] = r;
            old[k++] = before;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong((long long)k);
done:
    PyBuffer_Release(&map_b);
    PyBuffer_Release(&blocks_b);
    PyBuffer_Release(&ids_b);
    PyBuffer_Release(&new_b);
    PyBuffer_Release(&old_b);
    return result;
}

/* The loop of clear_rows for one width of row position. Returns the rows lacking the bit, or -1
 * (nothing changed) when a position is outside the map. */
#define CLEAR_ROWS_LOOP(NAME, T, IN)                                                               \
    static int64_t NAME(uint8_t *map, uint8_t *blocks, const int shift, const uint8_t bit,         \
                        const T *rows, const int64_t m, const int64_t n)                           \
    {                                                                                              \
        if (!IN(rows, 0, m, n))                                                                    \
            return -1;                                                                             \
        int64_t lacking = 0;                                                                       \
        const uint8_t keep = (uint8_t)~bit;                                                        \
        for (int64_t i = 0; i < m; ++i) {                                                          \
            const int64_t r = rows[i];                                                             \
            lacking += !(map[r] & bit);                                                            \
            map[r] &= keep;                                                                        \
            blocks[r >> shift] &= keep;                                                            \
        }                                                                                          \
        return lacking;                                                                            \
    }
CLEAR_ROWS_LOOP(clear_rows64, int64_t, rows_in64)
CLEAR_ROWS_LOOP(clear_rows32, int32_t, rows_in32)

/* clear_rows(bytes, blocks, shift, bit, rows, width) -> lacking: a claim from the tracker's
 * journal. Clears `bit` in the byte of every row of rows (int64, or int32 when width is 4) and in
 * its block's summary byte (the caller claims every row that has the bit, so none of the block's
 * rows keeps it). Returns how many rows did not have the bit (a journal out of step with the map:
 * 0 when all is well), or -1 (nothing changed) when a position is outside the map. */
static PyObject *clear_rows(PyObject *self, PyObject *args)
{
    Py_buffer map_b, blocks_b, rows_b;
    int shift, bit, width;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*w*iiy*i", &map_b, &blocks_b, &shift, &bit, &rows_b, &width))
        return NULL;
    PyObject *result = NULL;
    const int64_t n = map_b.len;
    if (!summary_ok(n, blocks_b.len, shift) || !claim_bit_ok(bit))
        goto done;
    if ((width != 4 && width != 8) || rows_b.len % width) {
        PyErr_SetString(PyExc_ValueError, "rows must be int32 (width 4) or int64 (width 8)");
        goto done;
    }
    const int64_t m = rows_b.len / width;
    int64_t lacking;
    Py_BEGIN_ALLOW_THREADS
    lacking = width == 8 ? clear_rows64(map_b.buf, blocks_b.buf, shift, (uint8_t)bit, rows_b.buf, m, n)
                         : clear_rows32(map_b.buf, blocks_b.buf, shift, (uint8_t)bit, rows_b.buf, m, n);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong((long long)lacking);
done:
    PyBuffer_Release(&map_b);
    PyBuffer_Release(&blocks_b);
    PyBuffer_Release(&rows_b);
    return result;
}

/* GATHER_AHEAD: rows prefetched ahead of the copy. A delta's rows lie pages apart in tables far
 * larger than the cache, so each row is a cache (and TLB) miss; issuing the misses of the next
 * rows while copying this one overlaps them (measured 1.3x over torch.index_select at 2% of a
 * 1M x 64 fp32 table; 8 to 32 ahead cost the same). */
enum { GATHER_AHEAD = 16 };

enum { GATHER_STATES = 16 };

/* The copy of gather_rows (arguments checked), for one width of row position T: row ids[i] - base
 * of every state. Its shape is measured, not incidental: with the pointers in locals, the first
 * line of each row prefetched unconditionally and the first state (the weights: the widest)
 * copied outside the loop over states, 80k rows of 4 x 1M x 64 fp32 tables + a rowwise state take
 * 2.15 ms instead of 3.05 ms when the tables sit in huge pages (one process, cold caches); on
 * 4 KiB pages the TLB misses bound both shapes (2.5-2.8 ms). A row of 4 bytes (a rowwise
 * optimizer state) is one load and store. */
#define GATHER_LOOP(NAME, T)                                                                       \
    static void NAME(const T *ids, const int64_t base, const int64_t m, const Py_ssize_t k,        \
                     const Py_buffer *src_b, const Py_ssize_t *row_bytes, const Py_buffer *dst_b)  \
    {                                                                                              \
        const char *src[GATHER_STATES];                                                            \
        char *dst[GATHER_STATES];                                                                  \
        Py_ssize_t rb[GATHER_STATES];                                                              \
        for (Py_ssize_t s = 0; s < k; ++s) {                                                       \
            src[s] = src_b[s].buf;                                                                 \
            dst[s] = dst_b[s].buf;                                                                 \
            rb[s] = row_bytes[s];                                                                  \
        }                                                                                          \
        for (int64_t i = 0; i < m; ++i) {                                                          \
            if (i + GATHER_AHEAD < m) {                                                            \
                const int64_t ahead = (int64_t)ids[i + GATHER_AHEAD] - base;                       \
                for (Py_ssize_t s = 0; s < k; ++s) {                                               \
                    const char *next = src[s] + ahead * rb[s];                                     \
                    __builtin_prefetch(next, 0, 0);                                                \
                    for (Py_ssize_t o = 64; o < rb[s]; o += 64)                                    \
                        __builtin_prefetch(next + o, 0, 0);                                        \
                }                                                                                  \
            }                                                                                      \
            const int64_t row = (int64_t)ids[i] - base;                                            \
            memcpy(dst[0] + i * rb[0], src[0] + row * rb[0], (size_t)rb[0]);                       \
            for (Py_ssize_t s = 1; s < k; ++s) {                                                   \
                const Py_ssize_t b = rb[s];                                                        \
                if (b == 4)                                                                        \
                    memcpy(dst[s] + i * 4, src[s] + row * 4, 4);                                   \
                else                                                                               \
                    memcpy(dst[s] + i * b, src[s] + row * b, (size_t)b);                           \
            }                                                                                      \
        }                                                                                          \
    }
GATHER_LOOP(gather64, int64_t)
GATHER_LOOP(gather32, int32_t)

/* The (src, row_bytes, dst) items of `seq` (k of them, at most GATHER_STATES) of gather_rows
 * and copy_once: src rows of row_bytes bytes each, dst writable. Sets *parsed to how many hold
 * buffers (release them with release_states, whatever the outcome), *n to the fewest rows of
 * any src and *rows_out to the fewest of any dst. Returns 0 with an exception set when an item
 * is malformed. */
static int parse_states(PyObject *seq, const Py_ssize_t k, const char *bad, Py_buffer *src_b,
                        Py_ssize_t *row_bytes, Py_buffer *dst_b, Py_ssize_t *parsed, int64_t *n,
                        int64_t *rows_out)
{
    *n = *rows_out = INT64_MAX;
    for (*parsed = 0; *parsed < k; ++*parsed) {
        const Py_ssize_t s = *parsed;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, s);
        if (!PyArg_ParseTuple(item, "y*nw*", &src_b[s], &row_bytes[s], &dst_b[s]))
            return 0;
        const Py_ssize_t rb = row_bytes[s];
        if (rb <= 0 || src_b[s].len % rb) {
            ++*parsed;
            PyErr_SetString(PyExc_ValueError, bad);
            return 0;
        }
        if (src_b[s].len / rb < *n)
            *n = src_b[s].len / rb;
        if (dst_b[s].len / rb < *rows_out)
            *rows_out = dst_b[s].len / rb;
    }
    return 1;
}

static void release_states(Py_buffer *src_b, Py_buffer *dst_b, const Py_ssize_t parsed)
{
    for (Py_ssize_t s = 0; s < parsed; ++s) {
        PyBuffer_Release(&src_b[s]);
        PyBuffer_Release(&dst_b[s]);
    }
}

/* gather_rows(ids, states, width=8, base=0): the snapshot's copy, for every (src, row_bytes, dst)
 * in `states` dst row i = src row ids[i] - base, in one pass over ids (the misses of every
 * state's next rows are issued together, GATHER_AHEAD rows ahead).
 *   ids     int64 (M,), or int32 when width is 4: row positions, any order; ids[i] - base must be
 *           a row of every src (checked first: a bad one raises IndexError and nothing is copied)
 *   states  a sequence of at most GATHER_STATES (src, row_bytes, dst): src C-contiguous rows of
 *           row_bytes bytes each (a table state), dst writable, at least M * row_bytes bytes
 *   base    subtracted from every id: ids may be positions in a larger space (the tracker's flat
 *           positions of every shard), read in place instead of made relative in a copy */
static PyObject *gather_rows(PyObject *self, PyObject *args)
{
    Py_buffer ids_b, src_b[GATHER_STATES], dst_b[GATHER_STATES];
    Py_ssize_t row_bytes[GATHER_STATES];
    PyObject *states;
    int width = 8;
    long long base = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O|iL", &ids_b, &states, &width, &base))
        return NULL;
    PyObject *result = NULL, *seq = PySequence_Fast(states, "gather_rows: states must be a sequence");
    Py_ssize_t k = 0, parsed = 0;
    if (seq == NULL)
        goto done;
    k = PySequence_Fast_GET_SIZE(seq);
    if (k > GATHER_STATES || (width != 4 && width != 8) || ids_b.len % width) {
        PyErr_SetString(PyExc_ValueError, "gather_rows: inconsistent arguments");
        goto done;
    }
    const int64_t m = ids_b.len / width;
    int64_t n, rows_out;
    if (!parse_states(seq, k, "gather_rows: inconsistent arguments", src_b, row_bytes, dst_b,
                      &parsed, &n, &rows_out))
        goto done;
    if (rows_out < m) {
        PyErr_SetString(PyExc_ValueError, "gather_rows: inconsistent arguments");
        goto done;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    if (width == 8) {
        ok = rows_in64(ids_b.buf, base, m, n);
        if (ok && k > 0)
            gather64(ids_b.buf, base, m, k, src_b, row_bytes, dst_b);
    } else {
        ok = rows_in32(ids_b.buf, base, m, n);
        if (ok && k > 0)
            gather32(ids_b.buf, base, m, k, src_b, row_bytes, dst_b);
    }
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_SetString(PyExc_IndexError, "gather_rows: a row index is outside the table");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release_states(src_b, dst_b, parsed);
    Py_XDECREF(seq);
    PyBuffer_Release(&ids_b);
    return result;
}

/* A row another thread is copying takes a row's copy (well under a microsecond) unless that
 * thread lost its core: spin briefly, then give the core away. */
static void copy_once_wait(const int spins)
{
    if (spins < 256) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    } else {
        sched_yield();
    }
}

/* The loop of copy_once (arguments checked), for one width of row position T. A row's flag goes
 * 0 (pending) -> 1 (being copied) -> 2 (copied), or 0 -> 3 (saved aside before its dst existed,
 * under the caller's lock: skipped here). The thread that moves it from 0 copies it; any
 * other waits until it reads 2 (acquire: the copy is then complete, so writing the row after that
 * cannot reach the snapshot). */
#define COPY_ONCE_LOOP(NAME, T)                                                                    \
    static int64_t NAME(const T *ids, const int64_t base, const int64_t m, const Py_ssize_t k,     \
                        const Py_buffer *src_b, const Py_ssize_t *row_bytes,                       \
                        const Py_buffer *dst_b, uint8_t *flags, const int64_t *slots,              \
                        const int64_t slot0)                                                       \
    {                                                                                              \
        int64_t copied = 0;                                                                        \
        for (int64_t i = 0; i < m; ++i) {                                                          \
            if (i + GATHER_AHEAD < m) {                                                            \
                const int64_t ahead = (int64_t)ids[i + GATHER_AHEAD] - base;                       \
                for (Py_ssize_t s = 0; s < k; ++s)                                                 \
                    __builtin_prefetch((const char *)src_b[s].buf + ahead * row_bytes[s], 0, 0);   \
            }                                                                                      \
            const int64_t slot = slots ? slots[i] : slot0 + i;                                     \
            uint8_t *flag = flags + slot, pending = 0;                                             \
            if (!__atomic_compare_exchange_n(flag, &pending, 1, 0, __ATOMIC_ACQ_REL,               \
                                             __ATOMIC_ACQUIRE)) {                                  \
                if (pending == 3) /* saved aside by its caller: not this call's to copy */         \
                    continue;                                                                      \
                for (int spins = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) != 2; ++spins)         \
                    copy_once_wait(spins);                                                         \
                continue;                                                                          \
            }                                                                                      \
            const int64_t row = (int64_t)ids[i] - base, at = slot - slot0;                         \
            for (Py_ssize_t s = 0; s < k; ++s) {                                                   \
                const Py_ssize_t b = row_bytes[s];                                                 \
                memcpy((char *)dst_b[s].buf + at * b, (const char *)src_b[s].buf + row * b,        \
                       (size_t)b);                                                                 \
            }                                                                                      \
            __atomic_store_n(flag, 2, __ATOMIC_RELEASE);                                           \
            ++copied;                                                                              \
        }                                                                                          \
        return copied;                                                                             \
    }
COPY_ONCE_LOOP(copy_once64, int64_t)
COPY_ONCE_LOOP(copy_once32, int32_t)

/* copy_once(ids, states, width, base, flags, slots, slot0) -> copied: a copy-on-write
 * snapshot's copy. For every i, the row's slot is slots[i] (int64), or slot0 + i when slots is
 * empty; the thread that moves flags[slot] from 0 to 1 copies row ids[i] - base of every
 * (src, row_bytes, dst) of `states` into dst row slot - slot0 and sets the flag to 2; a thread
 * that finds it 1 waits for 2, one that finds it 2 goes on. Two threads may copy the same slots
 * at once (the background's copy and the training thread's copy-before-update): each row is
 * copied exactly once, and when a call returns every one of its rows is in its dst, except
 * those whose flag is 3 (saved aside by the caller before the dst existed: skipped).
 *   ids, width, base, states: as gather_rows (checked first: nothing is copied on a bad one)
 *   flags   uint8 (F,) shared by every call of one snapshot; slots in [slot0, F), and dst rows
 *           for slot - slot0 */
static PyObject *copy_once(PyObject *self, PyObject *args)
{
    Py_buffer ids_b, flags_b, slots_b, src_b[GATHER_STATES], dst_b[GATHER_STATES];
    Py_ssize_t row_bytes[GATHER_STATES];
    PyObject *states;
    int width;
    long long base, slot0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*OiLw*y*L", &ids_b, &states, &width, &base, &flags_b, &slots_b,
                          &slot0))
        return NULL;
    PyObject *result = NULL, *seq = PySequence_Fast(states, "copy_once: states must be a sequence");
    Py_ssize_t k = 0, parsed = 0;
    if (seq == NULL)
        goto done;
    k = PySequence_Fast_GET_SIZE(seq);
    if (k > GATHER_STATES || (width != 4 && width != 8) || ids_b.len % width ||
        slots_b.len % 8) {
        PyErr_SetString(PyExc_ValueError, "copy_once: inconsistent arguments");
        goto done;
    }
    const int64_t m = ids_b.len / width, f = flags_b.len;
    const int64_t *slots = slots_b.len ? (const int64_t *)slots_b.buf : NULL;
    if (slots && slots_b.len / 8 != m) {
        PyErr_SetString(PyExc_ValueError, "copy_once: one slot per id");
        goto done;
    }
    int64_t lo = slot0, hi = slot0 + m - 1; /* the slots used, to check once */
    for (int64_t i = 0; slots && i < m; ++i) {
        if (i == 0 || slots[i] < lo)
            lo = slots[i];
        if (i == 0 || slots[i] > hi)
            hi = slots[i];
    }
    int64_t n, rows_out;
    if (!parse_states(seq, k, "copy_once: inconsistent arguments", src_b, row_bytes, dst_b,
                      &parsed, &n, &rows_out))
        goto done;
    if (m > 0 && (lo < slot0 || hi >= f || hi - slot0 >= rows_out)) {
        PyErr_SetString(PyExc_IndexError, "copy_once: a slot is outside the flags or a dst");
        goto done;
    }
    int ok = 1;
    int64_t copied = 0;
    Py_BEGIN_ALLOW_THREADS
    if (width == 8) {
        ok = rows_in64(ids_b.buf, base, m, n);
        if (ok)
            copied = copy_once64(ids_b.buf, base, m, k, src_b, row_bytes, dst_b, flags_b.buf,
                                 slots, slot0);
    } else {
        ok = rows_in32(ids_b.buf, base, m, n);
        if (ok)
            copied = copy_once32(ids_b.buf, base, m, k, src_b, row_bytes, dst_b, flags_b.buf,
                                 slots, slot0);
    }
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_SetString(PyExc_IndexError, "copy_once: a row index is outside the table");
        goto done;
    }
    result = PyLong_FromLongLong((long long)copied);
done:
    release_states(src_b, dst_b, parsed);
    Py_XDECREF(seq);
    PyBuffer_Release(&ids_b);
    PyBuffer_Release(&flags_b);
    PyBuffer_Release(&slots_b);
    return result;
}

/* One chunk of copy_chunks, parsed: what it holds (have_*, parsed) is released whatever the
 * outcome. */
typedef struct {
    Py_buffer ids_b, out_b, src_b[GATHER_STATES], dst_b[GATHER_STATES];
    Py_ssize_t row_bytes[GATHER_STATES], k, parsed;
    int width, have_ids;
    long long base, slot0, id_offset;
    int64_t m, n;
} chunk_copy_t;

/* Parses and checks one (ids, states, width, base, slot0, out_ids, id_offset) of copy_chunks
 * against `f` flags; 0 with an exception set when it is malformed. */
static int parse_chunk(PyObject *item, chunk_copy_t *c, const int64_t f)
{
    PyObject *states;
    if (!PyArg_ParseTuple(item, "y*OiLLw*L", &c->ids_b, &states, &c->width, &c->base, &c->slot0,
                          &c->out_b, &c->id_offset))
        return 0;
    c->have_ids = 1;
    PyObject *seq = PySequence_Fast(states, "copy_chunks: states must be a sequence");
    if (seq == NULL)
        return 0;
    c->k = PySequence_Fast_GET_SIZE(seq);
    int64_t rows_out = 0;
    int ok = c->k <= GATHER_STATES && (c->width == 4 || c->width == 8) &&
             c->ids_b.len % c->width == 0;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "copy_chunks: inconsistent arguments");
    else
        ok = parse_states(seq, c->k, "copy_chunks: inconsistent arguments", c->src_b, c->row_bytes,
                          c->dst_b, &c->parsed, &c->n, &rows_out);
    Py_DECREF(seq); /* (each state's buffer holds its own reference) */
    if (!ok)
        return 0;
    c->m = c->ids_b.len / c->width;
    if (c->out_b.len < c->m * 8 || (c->k > 0 && rows_out < c->m)) {
        PyErr_SetString(PyExc_ValueError, "copy_chunks: an out is shorter than the chunk's rows");
        return 0;
    }
    if (c->m > 0 && (c->slot0 < 0 || c->slot0 + c->m > f)) {
        PyErr_SetString(PyExc_IndexError, "copy_chunks: a slot is outside the flags");
        return 0;
    }
    return 1;
}

static void release_chunk(chunk_copy_t *c)
{
    release_states(c->src_b, c->dst_b, c->parsed);
    if (c->have_ids) {
        PyBuffer_Release(&c->ids_b);
        PyBuffer_Release(&c->out_b);
    }
}

/* Whether every row of chunk c lies in its sources; then its ids segment (ids[i] + id_offset,
 * int64) and its rows (copy_once), GIL released. */
static int chunk_rows_in(const chunk_copy_t *c)
{
    return c->width == 8 ? rows_in64(c->ids_b.buf, c->base, c->m, c->n)
                         : rows_in32(c->ids_b.buf, c->base, c->m, c->n);
}

static int64_t copy_chunk(const chunk_copy_t *c, uint8_t *flags)
{
    int64_t *out = c->out_b.buf;
    for (int64_t i = 0; i < c->m; ++i)
        out[i] = (c->width == 8 ? ((const int64_t *)c->ids_b.buf)[i]
                                : (int64_t)((const int32_t *)c->ids_b.buf)[i]) +
                 c->id_offset;
    if (c->width == 8)
        return copy_once64(c->ids_b.buf, c->base, c->m, c->k, c->src_b, c->row_bytes, c->dst_b,
                           flags, NULL, c->slot0);
    return copy_once32(c->ids_b.buf, c->base, c->m, c->k, c->src_b, c->row_bytes, c->dst_b, flags,
                       NULL, c->slot0);
}

/* copy_chunks(flags, chunks) -> copied: the background copy of several chunks of one
 * copy-on-write snapshot in one call, the GIL released once for them all (each release is a
 * chance for the training thread to find the GIL taken when it comes back). For every
 * (ids, states, width, base, slot0, out_ids, id_offset) of `chunks`: out_ids[i] = ids[i] +
 * id_offset (int64: the chunk's ids segment), then copy_once of ids into states with row i in
 * slot slot0 + i. Every chunk is checked before anything is written: a malformed one raises
 * ValueError, a slot outside `flags` or a row outside a source IndexError. */
static PyObject *copy_chunks(PyObject *self, PyObject *args)
{
    Py_buffer flags_b;
    PyObject *chunks;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*O", &flags_b, &chunks))
        return NULL;
    PyObject *result = NULL, *seq = PySequence_Fast(chunks, "copy_chunks: chunks must be a sequence");
    chunk_copy_t *c = NULL;
    Py_ssize_t nc = 0, parsed = 0;
    if (seq == NULL)
        goto done;
    nc = PySequence_Fast_GET_SIZE(seq);
    c = PyMem_Calloc(nc > 0 ? (size_t)nc : 1, sizeof *c);
    if (c == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    while (parsed < nc) {
        const int ok = parse_chunk(PySequence_Fast_GET_ITEM(seq, parsed), &c[parsed], flags_b.len);
        ++parsed; /* (released below, whatever it holds) */
        if (!ok)
            goto done;
    }
    int in = 1;
    int64_t copied = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; in && i < nc; ++i)
        in = chunk_rows_in(&c[i]);
    for (Py_ssize_t i = 0; in && i < nc; ++i)
        copied += copy_chunk(&c[i], flags_b.buf);
    Py_END_ALLOW_THREADS
    if (!in) {
        PyErr_SetString(PyExc_IndexError, "copy_chunks: a row index is outside the table");
        goto done;
    }
    result = PyLong_FromLongLong((long long)copied);
done:
    for (Py_ssize_t i = 0; i < parsed; ++i)
        release_chunk(&c[i]);
    PyMem_Free(c);
    Py_XDECREF(seq);
    PyBuffer_Release(&flags_b);
    return result;
}

/* A row found pending by pending_slots: its slot and its position. */
typedef struct {
    int64_t slot, pos;
} slot_pos_t;

static int by_slot(const void *a, const void *b)
{
    const int64_t x = ((const slot_pos_t *)a)->slot, y = ((const slot_pos_t *)b)->slot;
    return (x > y) - (x < y);
}

/* The first index of rows[0, n) (ascending, int64 or int32 by width) not below p. */
static int64_t lower_bound(const void *rows, const int width, int64_t n, const int64_t p)
{
    int64_t lo = 0;
    while (n > 0) {
        const int64_t half = n / 2;
        const int64_t v = width == 8 ? ((const int64_t *)rows)[lo + half]
                                     : (int64_t)((const int32_t *)rows)[lo + half];
        if (v < p) {
            lo += half + 1;
            n -= half + 1;
        } else {
            n = half;
        }
    }
    return lo;
}

/* One delta shard's claim of pending_slots: its rows (ascending) and the slot of the first. */
typedef struct {
    Py_buffer rows_b;
    int width;
    long long slot0;
    int64_t n, first, last;
} claim_rows_t;

/* pending_slots(positions, claims, spans, flags, out_slots, out_pos) -> n: the copy-on-write
 * guard's lookup (deck/trainer/cow.py), in one call with the GIL released. The slots of the
 * snapshot's rows among `positions` (int64, any order, repeats) whose flag is still below 2
 * (pending or being copied) go to out_slots[:n], ascending and each once, their positions to
 * out_pos[:n] (int64, each at least as long as positions).
 *   claims  a delta's shards, by first row: (rows, width, slot0), rows ascending int64 or int32
 *           (width 8 or 4): a position found there at index i is slot slot0 + i
 *   spans   int64 (S, 3) by first position: (first, count, slot0), a full's chunks: position p
 *           in [first, first + count) is slot slot0 + p - first
 * A slot outside the flags raises IndexError. */
static PyObject *pending_slots(PyObject *self, PyObject *args)
{
    Py_buffer pos_b, spans_b, flags_b, out_s_b, out_p_b;
    PyObject *claims;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*Oy*y*w*w*", &pos_b, &claims, &spans_b, &flags_b, &out_s_b,
                          &out_p_b))
        return NULL;
    PyObject *result = NULL, *seq = PySequence_Fast(claims, "pending_slots: claims must be a sequence");
    claim_rows_t *c = NULL;
    slot_pos_t *found = NULL;
    Py_ssize_t nc = 0, parsed = 0;
    const int64_t m = pos_b.len / 8, ns = spans_b.len / 24, f = flags_b.len;
    if (seq == NULL)
        goto done;
    if (pos_b.len % 8 || spans_b.len % 24 || out_s_b.len < pos_b.len || out_p_b.len < pos_b.len) {
        PyErr_SetString(PyExc_ValueError, "pending_slots: inconsistent arguments");
        goto done;
    }
    nc = PySequence_Fast_GET_SIZE(seq);
    c = PyMem_Calloc(nc > 0 ? (size_t)nc : 1, sizeof *c);
    found = PyMem_Malloc((m > 0 ? (size_t)m : 1) * sizeof *found);
    if (c == NULL || found == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; parsed < nc; ++parsed) {
        claim_rows_t *r = &c[parsed];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, parsed), "y*iL", &r->rows_b, &r->width,
                              &r->slot0))
            goto done;
        if ((r->width != 4 && r->width != 8) || r->rows_b.len % r->width || r->slot0 < 0) {
            ++parsed;
            PyErr_SetString(PyExc_ValueError, "pending_slots: inconsistent arguments");
            goto done;
        }
        r->n = r->rows_b.len / r->width;
        if (r->n > 0) {
            r->first = r->width == 8 ? ((const int64_t *)r->rows_b.buf)[0]
                                     : ((const int32_t *)r->rows_b.buf)[0];
            r->last = r->width == 8 ? ((const int64_t *)r->rows_b.buf)[r->n - 1]
                                    : ((const int32_t *)r->rows_b.buf)[r->n - 1];
        }
    }
    int64_t k = 0, bad = 0;
    Py_BEGIN_ALLOW_THREADS
    const int64_t *pos = pos_b.buf, *spans = spans_b.buf;
    const uint8_t *flags = flags_b.buf;
    for (int64_t i = 0; i < m && !bad; ++i) {
        const int64_t p = pos[i];
        int64_t slot = -1;
        for (Py_ssize_t j = 0; j < nc && slot < 0; ++j) { /* (a few shards) */
            const claim_rows_t *r = &c[j];
            if (r->n == 0 || p < r->first || p > r->last)
                continue;
            const int64_t at = lower_bound(r->rows_b.buf, r->width, r->n, p);
            const int64_t v = r->width == 8 ? ((const int64_t *)r->rows_b.buf)[at]
                                            : ((const int32_t *)r->rows_b.buf)[at];
            if (v == p)
                slot = r->slot0 + at;
        }
        if (slot < 0 && ns > 0) { /* the last span whose first is at most p */
            int64_t lo = 0, hi = ns;
            while (lo < hi) {
                const int64_t mid = (lo + hi) / 2;
                if (spans[3 * mid] <= p)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            if (lo > 0 && p < spans[3 * (lo - 1)] + spans[3 * (lo - 1) + 1])
                slot = spans[3 * (lo - 1) + 2] + p - spans[3 * (lo - 1)];
        }
        if (slot < 0)
            continue;
        if (slot >= f) {
            bad = 1;
            break;
        }
        /* (a snapshot of the flag: a row seen pending is then copied once by copy_once) */
        if (__atomic_load_n(flags + slot, __ATOMIC_RELAXED) < 2)
            found[k++] = (slot_pos_t){slot, p};
    }
    if (!bad && k > 1)
        qsort(found, (size_t)k, sizeof *found, by_slot);
    int64_t n = 0;
    for (int64_t i = 0; !bad && i < k; ++i) {
        if (n > 0 && ((int64_t *)out_s_b.buf)[n - 1] == found[i].slot)
            continue;
        ((int64_t *)out_s_b.buf)[n] = found[i].slot;
        ((int64_t *)out_p_b.buf)[n] = found[i].pos;
        ++n;
    }
    k = n;
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "pending_slots: a slot is outside the flags");
        goto done;
    }
    result = PyLong_FromLongLong((long long)k);
done:
    for (Py_ssize_t i = 0; i < parsed; ++i)
        PyBuffer_Release(&c[i].rows_b);
    PyMem_Free(c);
    PyMem_Free(found);
    Py_XDECREF(seq);
    PyBuffer_Release(&pos_b);
    PyBuffer_Release(&spans_b);
    PyBuffer_Release(&flags_b);
    PyBuffer_Release(&out_s_b);
    PyBuffer_Release(&out_p_b);
    return result;
}

/* Standard base64 (RFC 4648, '=' padding) of src[0:n] into dst (4 * ceil(n / 3) bytes). */
static void base64_encode(const uint8_t *src, size_t n, uint8_t *dst)
{
    static const char digits[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t i = 0;
    for (; i + 3 <= n; i += 3) {
        const uint32_t v = (uint32_t)src[i] << 16 | (uint32_t)src[i + 1] << 8 | src[i + 2];
        *dst++ = digits[v >> 18];
        *dst++ = digits[(v >> 12) & 63];
        *dst++ = digits[(v >> 6) & 63];
        *dst++ = digits[v & 63];
    }
    if (i < n) {
        const uint32_t v = (uint32_t)src[i] << 16 | (i + 1 < n ? (uint32_t)src[i + 1] << 8 : 0);
        *dst++ = digits[v >> 18];
        *dst++ = digits[(v >> 12) & 63];
        *dst++ = i + 1 < n ? digits[(v >> 6) & 63] : '=';
        *dst++ = '=';
    }
}

/* bloom_fill(ids, out, bits, k[, b64]) -> (min, max, filled): a chunk's row index
 * (deck.format.rowindex) in one pass with the GIL released. ids: int64; out: bits / 8 zeroed
 * bytes. Unless the ids are exactly [min, max] (a full's chunk: no filter), sets the k bits of
 * every id, each the splitmix64 finaliser of id + GOLDEN * (i + 1) mapped onto [0, bits) by a
 * multiply-shift of its top 32 bits, little-endian bit order: bit for bit what
 * rowindex._positions and numpy's packbits(bitorder="little") make. b64 (4 * ceil(bits / 24)
 * bytes): the filter's base64 as the manifest holds it, made here too (base64.b64encode holds
 * the GIL, on the thread writing a delta's records beside training). */
static PyObject *bloom_fill(PyObject *self, PyObject *args)
{
    Py_buffer ids_b, out_b, b64_b = {0};
    unsigned long long bits;
    int k;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*Ki|w*", &ids_b, &out_b, &bits, &k, &b64_b))
        return NULL;
    PyObject *result = NULL;
    const int64_t n = ids_b.len / 8;
    if (ids_b.len % 8 || n == 0 || k < 1 || bits == 0 || bits % 8 || bits >= ((uint64_t)1 << 32)
        || (uint64_t)out_b.len < bits / 8
        || (b64_b.buf != NULL && (uint64_t)b64_b.len != 4 * ((bits / 8 + 2) / 3))) {
        PyErr_SetString(PyExc_ValueError,
                        "bloom_fill: ids must be a non-empty int64 array, bits a multiple of 8 "
                        "below 2**32 with bits / 8 output bytes (and 4 * ceil(bits / 24) base64 "
                        "bytes), k >= 1");
        goto done;
    }
    const int64_t *ids = ids_b.buf;
    uint8_t *out = out_b.buf;
    int64_t lo, hi;
    int filled = 0;
    Py_BEGIN_ALLOW_THREADS
    lo = hi = ids[0];
    for (int64_t i = 1; i < n; ++i) {
        lo = ids[i] < lo ? ids[i] : lo;
        hi = ids[i] > hi ? ids[i] : hi;
    }
    if ((uint64_t)hi - (uint64_t)lo + 1 != (uint64_t)n) {
        filled = 1;
        for (int64_t i = 0; i < n; ++i) {
            const uint64_t x = (uint64_t)ids[i];
            for (int h = 0; h < k; ++h) {
                uint64_t z = x + 0x9E3779B97F4A7C15ULL * (uint64_t)(h + 1);
                z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
                z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
                z ^= z >> 31;
                const uint64_t pos = ((z >> 32) * (uint64_t)bits) >> 32;
                out[pos >> 3] |= (uint8_t)(1u << (pos & 7));
            }
        }
        if (b64_b.buf != NULL)
            base64_encode(out, bits / 8, b64_b.buf);
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("LLO", (long long)lo, (long long)hi, filled ? Py_True : Py_False);
done:
    PyBuffer_Release(&ids_b);
    PyBuffer_Release(&out_b);
    if (b64_b.buf != NULL)
        PyBuffer_Release(&b64_b);
    return result;
}

static PyMethodDef methods[] = {
    {"claim_bit", claim_bit, METH_VARARGS,
     "The tracker's claim: rows whose byte has a bit, ascending, and clear it (see above)."},
    {"claim_blocks", claim_blocks, METH_VARARGS,
     "The tracker's claim reading only the blocks its summary marks (see above)."},
    {"mark_rows", mark_rows, METH_VARARGS,
     "The tracker's compaction: set bits in rows and their summary, return the newly set rows."},
    {"gather_rows", gather_rows, METH_VARARGS,
     "The snapshot's copy: rows of a table by index into a buffer, prefetching ahead."},
    {"copy_once", copy_once, METH_VARARGS,
     "A copy-on-write snapshot's copy: each row once, by whichever thread claims it first."},
    {"pending_slots", pending_slots, METH_VARARGS,
     "The copy-on-write guard's lookup: the pending slots of positions, ascending, GIL released."},
    {"copy_chunks", copy_chunks, METH_VARARGS,
     "copy_once over several chunks of one snapshot, ids segments written, GIL released once."},
    {"bloom_fill", bloom_fill, METH_VARARGS,
     "A chunk's row index: min, max and its ids' bloom filter bits in one pass."},
    {"clear_rows", clear_rows, METH_VARARGS,
     "A claim from the tracker's journal: clear a bit in given rows and their summary."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "Native CPU kernels of deck.kernels.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }

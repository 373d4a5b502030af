/* kvq.runtime.kernels.cpu._ops: the checked pool's slot stamps (kvq/runtime/kernels/integrity/stamp_check.py
   is the spec). Included by _ops.c after its helpers.

   check_stamps(stamps, num_slot_pages, page_size, num_layers, block_tables, bt_stride, bt_int64,
                writers, read_lens, B, M, out): stamps int64 [num_slot_pages, page_size, num_layers]
     (every layer's stamp of a slot side by side), block_tables [B, M] (int32 or int64, rows bt_stride
     apart), writers int64 [B, M] (the writer tag each logical page's slots must carry; 0: not checked),
     read_lens int64 [B] (row b reads positions [0, read_lens[b])). out int64 [B]: the first position of
     row b whose slot carries, in some layer, a stamp other than writers[b, p / page_size] ^ p (or whose
     page is outside the pool; M * page_size when it reads past the table), else -1. One pass over the stamps of the slots a step reads; the inner
     loop ORs the XOR of each layer's stamp with the expectation (vectorized), a slot at a time. */

/* Row b's answer of check_stamps: the first bad position, M * page_size past the table, or -1. */
static int64_t stamps_first_bad(const int64_t *stamps, int64_t num_slot_pages, int64_t page_size, int64_t L,
                                uintptr_t bt_p, int64_t bt_stride, int bt_int64, const int64_t *writers,
                                int64_t read_len, int64_t b, int64_t M) {
    int64_t is_past = read_len > M * page_size;
    if (is_past)
        read_len = M * page_size;
    for (int64_t p0 = 0; p0 < read_len; p0 += page_size) {
        int64_t j = p0 / page_size, writer = writers[b * M + j];
        if (writer == 0)
            continue;
        int64_t page = bt_int64 ? ((const int64_t *)bt_p)[b * bt_stride + j]
                                : ((const int32_t *)bt_p)[b * bt_stride + j];
        if (page < 0 || page >= num_slot_pages)
            return p0;
        int64_t end = p0 + page_size < read_len ? p0 + page_size : read_len;
        const int64_t *slot = stamps + page * page_size * L;
        for (int64_t p = p0; p < end; p++, slot += L) {
            uint64_t expected = (uint64_t)(writer ^ p), diff = 0;
            for (int64_t l = 0; l < L; l++)
                diff |= (uint64_t)slot[l] ^ expected;
            if (diff)
                return p;
        }
    }
    return is_past ? M * page_size : -1;  // reads past the table: bad there
}

PyDoc_STRVAR(check_stamps_doc, "The first slot of each row whose stamp is not its own.");
static PyObject *check_stamps(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long stamps_p, bt_p, writers_p, lens_p, out_p;
    long long num_slot_pages, page_size, num_layers, bt_stride, B, M;
    int bt_int64;
    if (!PyArg_ParseTuple(args, "KLLLKLiKKLLK", &stamps_p, &num_slot_pages, &page_size, &num_layers, &bt_p,
                          &bt_stride, &bt_int64, &writers_p, &lens_p, &B, &M, &out_p))
        return NULL;
    if (page_size <= 0 || num_layers <= 0 || B < 0 || M < 0)
        return PyErr_Format(PyExc_ValueError, "bad shape page_size=%lld num_layers=%lld", page_size,
                            num_layers);
    const int64_t *stamps = (const int64_t *)(uintptr_t)stamps_p;
    const int64_t *writers = (const int64_t *)(uintptr_t)writers_p, *lens = (const int64_t *)(uintptr_t)lens_p;
    int64_t *out = (int64_t *)(uintptr_t)out_p;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t b = 0; b < B; b++)
        out[b] = stamps_first_bad(stamps, num_slot_pages, page_size, num_layers, (uintptr_t)bt_p, bt_stride,
                                  bt_int64, writers, lens[b], b, M);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* check_step(page_tags, num_pages, block_tables, bt_stride, bt_int64, context_lens, cl_int64, B, M,
              positions, slot_mapping, expected_tags, expected_lens, token_rows, expected_positions, T,
              page_size, writers, is_bad, write_tags, slot_stamps): the step check of
     kvq/runtime/kernels/integrity/step_check.py (`check_step_reference` is the spec) in one pass, and, with
     writers (int64 [B, M]; 0 for none), each new token's slot stamp `writers[r, p / page_size] ^ p` (the
     entry clamped into the table, as `TagTracker.check_pages` does). Every tensor int64 and contiguous but
     block_tables (int32 or int64, rows bt_stride apart) and context_lens (int32 or int64). is_bad bool
     [B * M + B + T]: table entries, then rows, then tokens; write_tags int64 [T]. */

static inline int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

/* The step check's pass (check_step's spec), shared with check_batch: sets is_bad (when not NULL), the write
   tags and, with writers, the slot stamps; returns whether any flag is set. */
typedef struct {
    const int64_t *page_tags;
    int64_t num_pages;
    uintptr_t bt_p, cl_p;
    int64_t bt_stride;
    int bt_int64, cl_int64;
    int64_t B, M;
    const int64_t *positions, *slot_mapping;
    int64_t T, page_size;
} StepTensors;

static int step_check_pass(const StepTensors *s, const int64_t *expected_tags, const int64_t *expected_lens,
                           const int64_t *token_rows, const int64_t *expected_positions, const int64_t *writers,
                           uint8_t *is_bad, int64_t *write_tags, int64_t *slot_stamps) {
    const int64_t B = s->B, M = s->M, page_size = s->page_size, bt_stride = s->bt_stride;
    const uintptr_t bt_p = s->bt_p;
    const int bt_int64 = s->bt_int64;
    int any = 0, flag;
#define KVQ_TABLE(b, j)                                                                                            \
    (bt_int64 ? ((const int64_t *)bt_p)[(b) * bt_stride + (j)] : (int64_t)((const int32_t *)bt_p)[(b) * bt_stride + (j)])
#define KVQ_FLAG(k, value)                                                                                         \
    do {                                                                                                           \
        flag = (value);                                                                                            \
        any |= flag;                                                                                               \
        if (is_bad != NULL)                                                                                        \
            is_bad[k] = (uint8_t)flag;                                                                             \
    } while (0)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t j = 0; j < M; j++) {
            int64_t page = KVQ_TABLE(b, j), tag = expected_tags[b * M + j];
            KVQ_FLAG(b * M + j,
                     tag == 0 ? page != -1 : (page < 0 || page >= s->num_pages || s->page_tags[page] != tag));
        }
        int64_t context_len =
            s->cl_int64 ? ((const int64_t *)s->cl_p)[b] : (int64_t)((const int32_t *)s->cl_p)[b];
        KVQ_FLAG(B * M + b, context_len != expected_lens[b]);
    }
    for (int64_t t = 0; t < s->T; t++) {
        int64_t row = token_rows[t], position = expected_positions[t], index = floor_div(position, page_size);
        int64_t in_table = index < 0 ? 0 : (index > M - 1 ? (M > 0 ? M - 1 : 0) : index);
        int64_t in_rows = row < 0 ? 0 : (row > B - 1 ? (B > 0 ? B - 1 : 0) : row);
        int is_index = in_table == index && in_rows == row, has_table = B * M > 0;
        int64_t page = has_table ? KVQ_TABLE(in_rows, in_table) : -1;
        int64_t offset = position - index * page_size;
        KVQ_FLAG(B * M + B + t, !is_index || page < 0 || s->positions[t] != position ||
                                    s->slot_mapping[t] != page * page_size + offset);
        write_tags[t] = is_index && has_table ? expected_tags[in_rows * M + in_table] : 0;
        if (writers != NULL)
            slot_stamps[t] = (has_table ? writers[in_rows * M + in_table] : 0) ^ position;
    }
#undef KVQ_FLAG
#undef KVQ_TABLE
    return any;
}

PyDoc_STRVAR(check_step_doc, "The step check of tags, lengths and slots (and slot stamps).");
static PyObject *check_step(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long tags_p, bt_p, cl_p, pos_p, slots_p, etags_p, elens_p, rows_p, epos_p, writers_p, bad_p,
        wtags_p, stamps_p;
    long long num_pages, bt_stride, B, M, T, page_size;
    int bt_int64, cl_int64;
    if (!PyArg_ParseTuple(args, "KLKLiKiLLKKKKKKLLKKKK", &tags_p, &num_pages, &bt_p, &bt_stride, &bt_int64, &cl_p,
                          &cl_int64, &B, &M, &pos_p, &slots_p, &etags_p, &elens_p, &rows_p, &epos_p, &T,
                          &page_size, &writers_p, &bad_p, &wtags_p, &stamps_p))
        return NULL;
    if (page_size <= 0 || num_pages < 0 || B < 0 || M < 0 || T < 0)
        return PyErr_Format(PyExc_ValueError, "bad shape page_size=%lld B=%lld M=%lld T=%lld", page_size, B, M, T);
    StepTensors s = {(const int64_t *)(uintptr_t)tags_p, num_pages, (uintptr_t)bt_p, (uintptr_t)cl_p, bt_stride,
                     bt_int64, cl_int64, B, M, (const int64_t *)(uintptr_t)pos_p,
                     (const int64_t *)(uintptr_t)slots_p, T, page_size};
    step_check_pass(&s, (const int64_t *)(uintptr_t)etags_p, (const int64_t *)(uintptr_t)elens_p,
                    (const int64_t *)(uintptr_t)rows_p, (const int64_t *)(uintptr_t)epos_p,
                    (const int64_t *)(uintptr_t)writers_p, (uint8_t *)(uintptr_t)bad_p,
                    (int64_t *)(uintptr_t)wtags_p, (int64_t *)(uintptr_t)stamps_p);
    Py_RETURN_NONE;
}

/* guard_slots(page_tags, num_pages, slot_mapping, write_tags, T, page_size, out): `guard_slot_mapping` of
   step_check.py: out[t] = slot_mapping[t], or -1 where page_tags[slot / page_size] (clamped into the pool)
   is not write_tags[t]. All int64, contiguous. */
PyDoc_STRVAR(guard_slots_doc, "The slot mapping, -1 where a page moved on since its check.");
static PyObject *guard_slots(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long tags_p, slots_p, wtags_p, out_p;
    long long num_pages, T, page_size;
    if (!PyArg_ParseTuple(args, "KLKKLLK", &tags_p, &num_pages, &slots_p, &wtags_p, &T, &page_size, &out_p))
        return NULL;
    if (page_size <= 0 || num_pages <= 0 || T < 0)
        return PyErr_Format(PyExc_ValueError, "bad shape page_size=%lld num_pages=%lld", page_size, num_pages);
    const int64_t *page_tags = (const int64_t *)(uintptr_t)tags_p, *slots = (const int64_t *)(uintptr_t)slots_p;
    const int64_t *write_tags = (const int64_t *)(uintptr_t)wtags_p;
    int64_t *out = (int64_t *)(uintptr_t)out_p;
    for (int64_t t = 0; t < T; t++) {
        int64_t page = floor_div(slots[t], page_size);
        page = page < 0 ? 0 : (page > num_pages - 1 ? num_pages - 1 : page);
        out[t] = page_tags[page] == write_tags[t] ? slots[t] : -1;
    }
    Py_RETURN_NONE;
}

/* sampled_page_hash of each page: out[n] = the hash of pages[n] (int64, each in the pool), n < N. Layer by
   layer and part by part over the pages in address order, so each part's sampled bytes stream through memory
   (a bandwidth-bound pass: on a small model two samples per slot row touch most of a page's lines); integer
   sums below 2^63 (page_check.MAX_HASH_TERMS), so any order gives the same values. False: out of memory. */
#define HASH_PREFETCH_PAGES 4

typedef struct {
    int64_t page, n;
} PageOrder;

static int by_page(const void *a, const void *b) {
    int64_t x = ((const PageOrder *)a)->page, y = ((const PageOrder *)b)->page;
    return (x > y) - (x < y);
}

static int page_hashes(const uint8_t *pool, int64_t L, int64_t C, int64_t stride_l, int64_t stride_c,
                       int64_t stride_p, const int64_t *pages, int64_t N, const int64_t *offsets, int64_t S,
                       const int64_t *coeffs, int64_t *out) {
    PageOrder *order = malloc((size_t)(N > 0 ? N : 1) * sizeof *order);
    if (order == NULL)
        return 0;
    for (int64_t n = 0; n < N; n++) {
        order[n] = (PageOrder){pages[n], n};
        out[n] = 0;
    }
    qsort(order, (size_t)N, sizeof *order, by_page);
    for (int64_t l = 0; l < L; l++)
        for (int64_t c = 0; c < C; c++) {
            const uint8_t *part = pool + l * stride_l + c * stride_c;
            const int64_t *weights = coeffs + (l * C + c) * S;
            for (int64_t i = 0; i < N; i++) {
                const uint8_t *bytes = part + order[i].page * stride_p;
                if (i + HASH_PREFETCH_PAGES < N) {  // the sampled lines a few pages ahead: misses overlap
                    const uint8_t *ahead = part + order[i + HASH_PREFETCH_PAGES].page * stride_p;
                    for (int64_t s = 0; s < S; s++)
                        __builtin_prefetch(ahead + offsets[s]);
                }
                int64_t sum = 0;
                for (int64_t s = 0; s < S; s++)
                    sum += (int64_t)bytes[offsets[s]] * weights[s];
                out[order[i].n] += sum;
            }
        }
    free(order);
    return 1;
}

/* sampled_page_hash(pool, L, C, P1, stride_l, stride_c, stride_p, page_ids, ids_int64, N, offsets, S, coeffs, out):
   `sampled_page_hash_reference` of kvq/runtime/kernels/integrity/page_check.py: out[n] = sum over l, c, s of
   pool[l, c, page_ids[n], offsets[s]] * coeffs[l, c, s]. pool uint8 with strides in bytes (a part's bytes
   contiguous), page_ids int32/int64 [N], offsets int64 [S] (in range: checked where they are made), coeffs
   int64 [L, C, S] contiguous, out int64 [N]. The sum stays below 2^63 (page_check.MAX_HASH_TERMS). */
PyDoc_STRVAR(sampled_page_hash_doc, "Each page's sampled bytes, weighted and summed.");
static PyObject *sampled_page_hash(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pool_p, ids_p, offsets_p, coeffs_p, out_p;
    long long L, C, P1, stride_l, stride_c, stride_p, N, S;
    int ids_int64;
    if (!PyArg_ParseTuple(args, "KLLLLLLKiLKLKK", &pool_p, &L, &C, &P1, &stride_l, &stride_c, &stride_p, &ids_p,
                          &ids_int64, &N, &offsets_p, &S, &coeffs_p, &out_p))
        return NULL;
    if (L < 0 || C < 0 || P1 < 0 || N < 0 || S < 0)
        return PyErr_Format(PyExc_ValueError, "bad shape L=%lld C=%lld N=%lld S=%lld", L, C, N, S);
    const uint8_t *pool = (const uint8_t *)(uintptr_t)pool_p;
    const int64_t *offsets = (const int64_t *)(uintptr_t)offsets_p, *coeffs = (const int64_t *)(uintptr_t)coeffs_p;
    int64_t *out = (int64_t *)(uintptr_t)out_p;
    int64_t *pages = malloc((size_t)(N > 0 ? N : 1) * sizeof *pages);
    if (pages == NULL)
        return PyErr_NoMemory();
    for (int64_t n = 0; n < N; n++) {
        pages[n] = ids_int64 ? ((const int64_t *)(uintptr_t)ids_p)[n] : ((const int32_t *)(uintptr_t)ids_p)[n];
        if (pages[n] < 0 || pages[n] >= P1) {
            free(pages);
            return PyErr_Format(PyExc_IndexError, "page id %lld outside the pool's %lld pages", (long long)pages[n],
                                P1);
        }
    }
    int is_done;
    Py_BEGIN_ALLOW_THREADS
    is_done = page_hashes(pool, L, C, stride_l, stride_c, stride_p, pages, N, offsets, S, coeffs, out);
    Py_END_ALLOW_THREADS
    free(pages);
    if (!is_done)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* check_batch(page_tags, num_pages, page_size, stamps, num_slot_pages, num_layers, pool, L, C, P1, stride_l,
               stride_c, stride_p, offsets, S, coeffs, byte_hashes, block_tables, bt_stride, bt_int64, context_lens,
               cl_int64, B, M, positions, slot_mapping, T, expected, sealed, N, write_tags, slot_stamps) -> bool:
     a checked step's whole proof on CPU in one call (kvq/runtime/kernels/integrity/batch_check.py is the spec;
     the pool's arguments first, bound once, then the step's): check_step over `expected` (int64, flat as
     `TagTracker._expected` lays it out: tags [B, M], lens [B], token rows [T], positions [T], writers [B, M],
     read lens [B]), writing write_tags [T] and, with stamps (not 0), slot_stamps [T]; then with stamps,
     check_stamps; then with pool (not 0), the sampled-bytes hash of each of the N sealed pages (int64) against
     byte_hashes[page] (int64 [num_pages], -1: not hashed yet). True when anything failed, or a sealed page is
     outside [0, num_pages): the caller then runs the separate checks, which name what failed. The passing
     step, the hot path, writes only its two outputs. */
PyDoc_STRVAR(check_batch_doc, "A checked step's whole proof on CPU: True when any part failed.");
static PyObject *check_batch(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long tags_p, stamps_p, pool_p, offsets_p, coeffs_p, hashes_p, bt_p, cl_p, pos_p, slots_p,
        expected_p, sealed_p, wtags_p, sstamps_p;
    long long num_pages, page_size, num_slot_pages, num_layers, L, C, P1, stride_l, stride_c, stride_p, S,
        bt_stride, B, M, T, N;
    int bt_int64, cl_int64;
    if (!PyArg_ParseTuple(args, "KLLKLLKLLLLLLKLKKKLiKiLLKKLKKLKK", &tags_p, &num_pages, &page_size, &stamps_p,
                          &num_slot_pages, &num_layers, &pool_p, &L, &C, &P1, &stride_l, &stride_c, &stride_p,
                          &offsets_p, &S, &coeffs_p, &hashes_p, &bt_p, &bt_stride, &bt_int64, &cl_p, &cl_int64, &B,
                          &M, &pos_p, &slots_p, &T, &expected_p, &sealed_p, &N, &wtags_p, &sstamps_p))
        return NULL;
    if (page_size <= 0 || num_pages < 0 || B < 0 || M < 0 || T < 0 || N < 0 || (stamps_p && num_layers <= 0))
        return PyErr_Format(PyExc_ValueError, "bad shape page_size=%lld B=%lld M=%lld T=%lld", page_size, B, M, T);
    const int64_t *expected = (const int64_t *)(uintptr_t)expected_p;
    const int64_t *expected_lens = expected + B * M, *token_rows = expected_lens + B;
    const int64_t *expected_positions = token_rows + T, *writers = expected_positions + T;
    const int64_t *read_lens = writers + B * M;
    StepTensors s = {(const int64_t *)(uintptr_t)tags_p, num_pages, (uintptr_t)bt_p, (uintptr_t)cl_p, bt_stride,
                     bt_int64, cl_int64, B, M, (const int64_t *)(uintptr_t)pos_p,
                     (const int64_t *)(uintptr_t)slots_p, T, page_size};
    int is_bad = step_check_pass(&s, expected, expected_lens, token_rows, expected_positions,
                                 stamps_p ? writers : NULL, NULL, (int64_t *)(uintptr_t)wtags_p,
                                 (int64_t *)(uintptr_t)sstamps_p);
    const int64_t *stamps = (const int64_t *)(uintptr_t)stamps_p;
    for (int64_t b = 0; stamps && b < B && !is_bad; b++)
        is_bad = stamps_first_bad(stamps, num_slot_pages, page_size, num_layers, (uintptr_t)bt_p, bt_stride,
                                  bt_int64, writers, read_lens[b], b, M) >= 0;
    const int64_t *sealed = (const int64_t *)(uintptr_t)sealed_p, *hashes = (const int64_t *)(uintptr_t)hashes_p;
    for (int64_t n = 0; pool_p && n < N && !is_bad; n++)
        is_bad = sealed[n] < 0 || sealed[n] >= num_pages || sealed[n] >= P1;
    if (pool_p && N > 0 && !is_bad) {
        int64_t *found = malloc((size_t)N * sizeof *found);
        if (found == NULL || !page_hashes((const uint8_t *)(uintptr_t)pool_p, L, C, stride_l, stride_c, stride_p,
                                          sealed, N, (const int64_t *)(uintptr_t)offsets_p, S,
                                          (const int64_t *)(uintptr_t)coeffs_p, found)) {
            free(found);
            return PyErr_NoMemory();
        }
        for (int64_t n = 0; n < N && !is_bad; n++)
            is_bad = hashes[sealed[n]] != -1 && hashes[sealed[n]] != found[n];
        free(found);
    }
    return PyBool_FromLong(is_bad);
}

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
    const int64_t L = num_layers;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t b = 0; b < B; b++) {
        int64_t first_bad = -1, read_len = lens[b], is_past = read_len > M * page_size;
        if (is_past)
            read_len = M * page_size;
        for (int64_t p0 = 0; p0 < read_len && first_bad < 0; p0 += page_size) {
            int64_t j = p0 / page_size, writer = writers[b * M + j];
            if (writer == 0)
                continue;
            int64_t page = bt_int64 ? ((const int64_t *)(uintptr_t)bt_p)[b * bt_stride + j]
                                    : ((const int32_t *)(uintptr_t)bt_p)[b * bt_stride + j];
            if (page < 0 || page >= num_slot_pages) {
                first_bad = p0;
                break;
            }
            int64_t end = p0 + page_size < read_len ? p0 + page_size : read_len;
            const int64_t *slot = stamps + page * page_size * L;
            for (int64_t p = p0; p < end; p++, slot += L) {
                uint64_t expected = (uint64_t)(writer ^ p), diff = 0;
                for (int64_t l = 0; l < L; l++)
                    diff |= (uint64_t)slot[l] ^ expected;
                if (diff) {
                    first_bad = p;
                    break;
                }
            }
        }
        out[b] = first_bad < 0 && is_past ? M * page_size : first_bad;  // reads past the table: bad there
    }
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
    const int64_t *page_tags = (const int64_t *)(uintptr_t)tags_p, *positions = (const int64_t *)(uintptr_t)pos_p;
    const int64_t *slot_mapping = (const int64_t *)(uintptr_t)slots_p;
    const int64_t *expected_tags = (const int64_t *)(uintptr_t)etags_p;
    const int64_t *expected_lens = (const int64_t *)(uintptr_t)elens_p;
    const int64_t *token_rows = (const int64_t *)(uintptr_t)rows_p;
    const int64_t *expected_positions = (const int64_t *)(uintptr_t)epos_p;
    const int64_t *writers = (const int64_t *)(uintptr_t)writers_p;
    uint8_t *is_bad = (uint8_t *)(uintptr_t)bad_p;
    int64_t *write_tags = (int64_t *)(uintptr_t)wtags_p, *slot_stamps = (int64_t *)(uintptr_t)stamps_p;
#define KVQ_TABLE(b, j)                                                                                            \
    (bt_int64 ? ((const int64_t *)(uintptr_t)bt_p)[(b) * bt_stride + (j)]                                          \
              : (int64_t)((const int32_t *)(uintptr_t)bt_p)[(b) * bt_stride + (j)])
    for (int64_t b = 0; b < B; b++) {
        for (int64_t j = 0; j < M; j++) {
            int64_t page = KVQ_TABLE(b, j), tag = expected_tags[b * M + j];
            is_bad[b * M + j] =
                tag == 0 ? page != -1 : (page < 0 || page >= num_pages || page_tags[page] != tag);
        }
        int64_t context_len = cl_int64 ? ((const int64_t *)(uintptr_t)cl_p)[b]
                                       : (int64_t)((const int32_t *)(uintptr_t)cl_p)[b];
        is_bad[B * M + b] = context_len != expected_lens[b];
    }
    uint8_t *bad_tokens = is_bad + B * M + B;
    for (int64_t t = 0; t < T; t++) {
        int64_t row = token_rows[t], position = expected_positions[t], index = floor_div(position, page_size);
        int64_t in_table = index < 0 ? 0 : (index > M - 1 ? (M > 0 ? M - 1 : 0) : index);
        int64_t in_rows = row < 0 ? 0 : (row > B - 1 ? (B > 0 ? B - 1 : 0) : row);
        int is_index = in_table == index && in_rows == row, has_table = B * M > 0;
        int64_t page = has_table ? KVQ_TABLE(in_rows, in_table) : -1;
        int64_t offset = position - floor_div(position, page_size) * page_size;
        bad_tokens[t] = !is_index || page < 0 || positions[t] != position || slot_mapping[t] != page * page_size + offset;
        write_tags[t] = is_index && has_table ? expected_tags[in_rows * M + in_table] : 0;
        if (writers != NULL)
            slot_stamps[t] = (has_table ? writers[in_rows * M + in_table] : 0) ^ position;
    }
#undef KVQ_TABLE
    Py_RETURN_NONE;
}

/* guard_slots(page_tags, num_pages, slot_mapping, write_tags, T, page_size, out): `guard_slot_mapping` of
   step_check.py: out[t] = slot_mapping[t], or -1 where page_tags[slot / page_size] (clamped into the pool)
   is not write_tags[t]. All int64, contiguous. */
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

/* sampled_page_hash(pool, L, C, P1, stride_l, stride_c, stride_p, page_ids, ids_int64, N, offsets, S, coeffs, out):
   `sampled_page_hash_reference` of kvq/runtime/kernels/integrity/page_check.py: out[n] = sum over l, c, s of
   pool[l, c, page_ids[n], offsets[s]] * coeffs[l, c, s]. pool uint8 with strides in bytes (a part's bytes
   contiguous), page_ids int32/int64 [N], offsets int64 [S] (in range: checked where they are made), coeffs
   int64 [L, C, S] contiguous, out int64 [N]. The sum stays below 2^63 (page_check.MAX_HASH_TERMS). */
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
    for (int64_t n = 0; n < N; n++) {
        int64_t page = ids_int64 ? ((const int64_t *)(uintptr_t)ids_p)[n] : ((const int32_t *)(uintptr_t)ids_p)[n];
        if (page < 0 || page >= P1)
            return PyErr_Format(PyExc_IndexError, "page id %lld outside the pool's %lld pages", (long long)page, P1);
    }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t n = 0; n < N; n++) {
        int64_t page = ids_int64 ? ((const int64_t *)(uintptr_t)ids_p)[n] : ((const int32_t *)(uintptr_t)ids_p)[n];
        int64_t sum = 0;
        for (int64_t l = 0; l < L; l++)
            for (int64_t c = 0; c < C; c++) {
                const uint8_t *bytes = pool + l * stride_l + c * stride_c + page * stride_p;
                const int64_t *weights = coeffs + (l * C + c) * S;
                for (int64_t s = 0; s < S; s++)
                    sum += (int64_t)bytes[offsets[s]] * weights[s];
            }
        out[n] = sum;
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

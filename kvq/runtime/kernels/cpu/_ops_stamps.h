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

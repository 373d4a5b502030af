/* dequantize(isa, threads, packed, scale, scale_dtype, N, K, group, out): the weight as bf16, out [N, K] =
   bf16(q * scale), compressed-tensors' decompression (q * scale is exact in fp32, rounded once, to
   nearest even). Included by _linear.c. For batches of activations large enough (prefill) that a BF16
   GEMM (oneDNN, at the CPU's bf16 dot-product peak) over the decompressed weight outruns the W4A16 GEMM:
   kvq.runtime.kernels.cpu.linear chooses. Rows over the pool's threads; a table lookup (isa >= avx512bf16,
   which has AVX-512 BW), AVX-512 (avx512) or scalar loops, the same bits. */

typedef struct {
    int isa;
    const uint32_t *packed;
    const uint8_t *scale;
    int scale_dtype, scale_size;
    int64_t N, K, group;
    uint16_t *out;
} DequantJob;

static void dequantize_rows_scalar(const DequantJob *d, int64_t n0, int64_t n1) {
    const int64_t words_per_group = d->group / 8, num_groups = d->K / d->group;
    for (int64_t n = n0; n < n1; n++) {
        const uint32_t *w = d->packed + n * (d->K / 8);
        const uint8_t *srow = d->scale + n * num_groups * d->scale_size;
        for (int64_t g = 0; g < num_groups; g++) {
            float s = row_scale(srow, d->scale_dtype, g);
            for (int64_t i = g * words_per_group; i < (g + 1) * words_per_group; i++)
                for (int j = 0; j < 8; j++)
                    d->out[n * d->K + 8 * i + j] = f32_to_bf16((float)int4_unpack(w[i], j) * s);
        }
    }
}

#ifdef KVQ_X86
/* 16 finite fp32 as 16 bf16 bits, rounded to nearest even in integer arithmetic (denormals kept, no NaN case):
   the rounding of the scalar loop above. */
TARGET_AVX512 static inline __m256i bf16_bits_avx512(__m512 v) {
    const __m512i u = _mm512_castps_si512(v), odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* 16 elements (two words) at a time: each word broadcast to 8 lanes, shifted per lane, q to fp32, times
   the group's scale, rounded to bf16 in integer arithmetic (finite values: no NaN case). */
TARGET_AVX512 static void dequantize_rows_avx512(const DequantJob *d, int64_t n0, int64_t n1) {
    const int64_t words_per_group = d->group / 8, num_groups = d->K / d->group;
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i nibble = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
    for (int64_t n = n0; n < n1; n++) {
        const uint32_t *w = d->packed + n * (d->K / 8);
        const uint8_t *srow = d->scale + n * num_groups * d->scale_size;
        uint16_t *o = d->out + n * d->K;
        for (int64_t g = 0; g < num_groups; g++) {
            const __m512 scale = _mm512_set1_ps(row_scale(srow, d->scale_dtype, g));
            for (int64_t i = g * words_per_group; i < (g + 1) * words_per_group; i += 2) { /* group >= 32 */
                __m512i pair = _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)(w + i)));
                __m512i q = _mm512_sub_epi32(
                    _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(spread, pair), shifts), nibble), eight);
                __m256i halves = bf16_bits_avx512(_mm512_mul_ps(_mm512_cvtepi32_ps(q), scale));
                memcpy(o + 8 * i, &halves, sizeof halves);
            }
        }
    }
}

/* With AVX-512 BW (isa >= avx512bf16): per group a 16-entry table of bf16((u - 8) * scale), rounded as
   above, in both halves of a vector; per 32 elements (16 bytes) the bytes widen to dwords, byte t (elements
   2t, 2t + 1) in dword t, one shift and or put its high nibble in the dword's high half and one vpermw looks
   both nibbles up (it reads 5 index bits: bit 4 of the low half is the high nibble's, the table repeats):
   2.9x dequantize_rows_avx512 (SmolLM2's [3072, 576]: 245 -> 85 us on a Zen 4 core). */
TARGET_AVX512BF16 static void dequantize_rows_table(const DequantJob *d, int64_t n0, int64_t n1) {
    const int64_t num_groups = d->K / d->group, vectors_per_group = d->group / 32;
    const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = (const uint8_t *)(d->packed + n * (d->K / 8));
        const uint8_t *srow = d->scale + n * num_groups * d->scale_size;
        uint16_t *o = d->out + n * d->K;
        for (int64_t g = 0; g < num_groups; g++) {
            const __m512 values = _mm512_mul_ps(q, _mm512_set1_ps(row_scale(srow, d->scale_dtype, g)));
            const __m512i table = _mm512_broadcast_i64x4(bf16_bits_avx512(values));
            for (int64_t v = 0; v < vectors_per_group; v++, w += 16, o += 32) {
                __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)w));
                __m512i idx = _mm512_or_si512(bytes, _mm512_slli_epi32(bytes, 12));
                _mm512_storeu_si512(o, _mm512_permutexvar_epi16(idx, table));
            }
        }
    }
}
#endif

static void dequantize_rows(const DequantJob *d, int64_t n0, int64_t n1) {
#ifdef KVQ_X86
    if (d->isa >= ISA_AVX512BF16) {
        dequantize_rows_table(d, n0, n1);
        return;
    }
    if (d->isa >= ISA_AVX512) {
        dequantize_rows_avx512(d, n0, n1);
        return;
    }
#endif
    dequantize_rows_scalar(d, n0, n1);
}

static void dequantize_task(void *ctx, int64_t chunk, int64_t num_chunks) {
    const DequantJob *d = (const DequantJob *)ctx;
    dequantize_rows(d, d->N * chunk / num_chunks, d->N * (chunk + 1) / num_chunks);
}

static PyObject *dequantize(PyObject *self, PyObject *args) {
    (void)self;
    int isa, threads, scale_dtype, group;
    unsigned long long packed, scale, out;
    long long N, K;
    if (!PyArg_ParseTuple(args, "iiKKiLLiK", &isa, &threads, &packed, &scale, &scale_dtype, &N, &K, &group, &out))
        return NULL;
    if ((group != 32 && group != 64 && group != 128) || N < 0 || K <= 0 || K % group)
        return PyErr_Format(PyExc_ValueError, "bad shape N=%lld K=%lld group=%d", N, K, group);
    if (!isa_checked(isa))
        return NULL;
    if (scale_dtype != DTYPE_F32 && scale_dtype != DTYPE_BF16)
        return PyErr_Format(PyExc_ValueError, "bad scale dtype code %d", scale_dtype);
    DequantJob d = {
        .isa = isa,
        .packed = (const uint32_t *)(uintptr_t)packed,
        .scale = (const uint8_t *)(uintptr_t)scale,
        .scale_dtype = scale_dtype,
        .scale_size = scale_dtype == DTYPE_F32 ? 4 : 2,
        .N = N,
        .K = K,
        .group = group,
        .out = (uint16_t *)(uintptr_t)out,
    };
    int nt = threads < 1 ? 1 : threads;
    int64_t chunks = (int64_t)nt * CHUNKS_PER_THREAD < N ? (int64_t)nt * CHUNKS_PER_THREAD : N;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&call_lock);
    run_parallel(dequantize_task, &d, chunks, nt);
    pthread_mutex_unlock(&call_lock);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

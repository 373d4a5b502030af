/* W8A16's GEMM on the avx512bf16 path (w8_gemm_bf16, called from _w8a16.h). Included by _linear.c
   after _linear_bf16.h, whose as_bf16_pairs it uses. */

/* W8A16 (_w8a16.h) on avx512bf16: M >= 2 rows of bf16 activations, read as they lie (no conversion).
   Per tile of 4 rows x W8_BF_TILE_K inputs, the int8 weights go to bf16 once (exact: |w| <= 128 fits
   bf16's 8 bits), natural order; then each pair of activation rows takes one vdpbf16ps per 32 inputs
   and weight row: 8 sums, times the row's scale at the end. */

#define W8_BF_TILE_K 1024 /* inputs per tile: 4 rows x 2 KiB of bf16 */
#define W8_BF_M_BLOCK 64

/* 32 int8 weights at w (zero past `valid`, 1..32) as 32 bf16, in order (their fp32 values are integers,
   exact in bf16). */
TARGET_AVX512BF16 static inline __m512i w8_bf16_of(const int8_t *w, int64_t valid) {
    int8_t tail[32] = {0};
    if (valid < 32)
        w = memcpy(tail, w, (size_t)valid);
    __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
    __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 16))));
#if defined(KVQ_SIMDE_CHECK) /* SIMDe 0.7 has no vcvtne2ps2bf16: the top halves, which are exact here */
    uint32_t lanes[32];
    uint16_t halves[32];
    memcpy(lanes, &low, 64);
    memcpy(lanes + 16, &high, 64);
    for (int i = 0; i < 32; i++)
        halves[i] = (uint16_t)(lanes[i] >> 16);
    return _mm512_loadu_si512(halves);
#else
    __m512bh both = _mm512_cvtne2ps_pbh(high, low); /* low's 16 first, then high's */
    __m512i out;
    memcpy(&out, &both, sizeof out);
    return out;
#endif
}

/* 32 bf16 activations at x (zero past `valid`, 1..32) as bf16 pairs. */
TARGET_AVX512BF16 static inline __m512bh w8_x_pairs(const uint16_t *x, int64_t valid) {
    uint16_t tail[32] = {0};
    if (valid < 32)
        x = memcpy(tail, x, (size_t)valid * 2);
    return as_bf16_pairs(_mm512_loadu_si512(x));
}

/* sums[r] (and sums[4 + r]) += row xa (and xb, where two) . tile row r (vecs vectors of 32 weights, zero
   past K) over the `valid` inputs of this tile. */
TARGET_AVX512BF16 static inline __attribute__((always_inline)) void
w8_tile_dot_bf16(const uint16_t *xa, const uint16_t *xb, int two, const __m512i *tile, int64_t vecs,
                 int64_t valid, __m512 *sums) {
    __m512 a0 = sums[0], a1 = sums[1], a2 = sums[2], a3 = sums[3];
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    if (two)
        c0 = sums[4], c1 = sums[5], c2 = sums[6], c3 = sums[7];
    for (int64_t v = 0; v < vecs; v++) {
        __m512bh x = w8_x_pairs(xa + 32 * v, valid - 32 * v);
        __m512bh t0 = as_bf16_pairs(tile[v]), t1 = as_bf16_pairs(tile[vecs + v]);
        __m512bh t2 = as_bf16_pairs(tile[2 * vecs + v]), t3 = as_bf16_pairs(tile[3 * vecs + v]);
        a0 = _mm512_dpbf16_ps(a0, t0, x);
        a1 = _mm512_dpbf16_ps(a1, t1, x);
        a2 = _mm512_dpbf16_ps(a2, t2, x);
        a3 = _mm512_dpbf16_ps(a3, t3, x);
        if (two) {
            __m512bh y = w8_x_pairs(xb + 32 * v, valid - 32 * v);
            c0 = _mm512_dpbf16_ps(c0, t0, y);
            c1 = _mm512_dpbf16_ps(c1, t1, y);
            c2 = _mm512_dpbf16_ps(c2, t2, y);
            c3 = _mm512_dpbf16_ps(c3, t3, y);
        }
    }
    sums[0] = a0, sums[1] = a1, sums[2] = a2, sums[3] = a3;
    if (two)
        sums[4] = c0, sums[5] = c1, sums[6] = c2, sums[7] = c3;
}

TARGET_AVX512BF16 static void w8_gemm_bf16(const W8Job *job, int64_t n0, int64_t n1) {
    const int64_t K = job->K;
    const uint16_t *x = (const uint16_t *)job->x;
    __m512i tile[4 * W8_BF_TILE_K / 32];
    __m512 sums[W8_BF_M_BLOCK * 4];
    for (int64_t n = n0; n < n1; n += 4) {
        int rows = n1 - n < 4 ? (int)(n1 - n) : 4;
        for (int64_t m0 = 0; m0 < job->M; m0 += W8_BF_M_BLOCK) {
            int64_t mb = job->M - m0 < W8_BF_M_BLOCK ? job->M - m0 : W8_BF_M_BLOCK;
            for (int64_t i = 0; i < mb * 4; i++)
                sums[i] = _mm512_setzero_ps();
            for (int64_t k0 = 0; k0 < K; k0 += W8_BF_TILE_K) {
                int64_t valid = K - k0 < W8_BF_TILE_K ? K - k0 : W8_BF_TILE_K, vecs = (valid + 31) / 32;
                for (int r = 0; r < 4; r++) /* a missing row: zero weights */
                    for (int64_t v = 0; v < vecs; v++)
                        tile[r * vecs + v] = r < rows ? w8_bf16_of(job->w + (n + r) * K + k0 + 32 * v, valid - 32 * v)
                                                      : _mm512_setzero_si512();
                int64_t m = 0;
                for (; m + 1 < mb; m += 2) {
                    const uint16_t *xa = x + (m0 + m) * K + k0;
                    w8_tile_dot_bf16(xa, xa + K, 1, tile, vecs, valid, sums + m * 4);
                }
                if (m < mb)
                    w8_tile_dot_bf16(x + (m0 + m) * K + k0, NULL, 0, tile, vecs, valid, sums + m * 4);
            }
            for (int64_t m = 0; m < mb; m++)
                for (int r = 0; r < rows; r++)
                    w8_store(job, m0 + m, n + r, _mm512_reduce_add_ps(sums[m * 4 + r]));
        }
    }
}

#undef W8_BF_TILE_K
#undef W8_BF_M_BLOCK

/* The W4A8 kernel on AVX-512 VNNI (see _w4a8.h): a vector's nibbles (or, wide, its bytes) times a
   step's 4 activations is one vpdpbusd (64 products) with its broadcast folded in; the tile's chunk is
   unpacked into registers once and runs up to W4A8_MB activation rows, four at a time, two chains each
   (vpdpbusd's latency). */

/* 16 fp32 from element i of an fp32 or bf16 array (activations, scales; bf16 widened exactly). */
TARGET_AVX512VNNI static inline __m512 w4a8_load16_vnni(const void *p, int is_bf16, int64_t i) {
    if (!is_bf16)
        return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* max |x| over the chunk of row m from input k0, and in *special whether it holds inf or NaN. */
TARGET_AVX512VNNI static inline __attribute__((always_inline)) float
w4a8_chunk_amax_vnni(const W4A8Job *job, int64_t m, int64_t k0, int *special) {
    const int x_bf16 = job->x_dtype != DTYPE_F32;
    __m512 top = _mm512_setzero_ps();
    unsigned seen = 0; /* lanes that saw inf or NaN */
    for (int64_t k = k0; k < k0 + job->C; k += 16) {
        const __m512 a = _mm512_abs_ps(w4a8_load16_vnni(job->x, x_bf16, m * job->K + k));
        seen |= (unsigned)_mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
        top = _mm512_max_ps(a, top);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, top);
    *special = seen != 0;
    return w4a8_max_lanes(lanes, 16);
}

/* The chunk of row m from input k0 times inv, rounded to nearest even and clamped to -127..127, into xq
   (the row's, from input 0); returns their sum. */
TARGET_AVX512VNNI static inline __attribute__((always_inline)) int32_t
w4a8_chunk_quantize_vnni(const W4A8Job *job, int64_t m, int64_t k0, float inv, int8_t *xq) {
    const int x_bf16 = job->x_dtype != DTYPE_F32;
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = k0; k < k0 + job->C; k += 16) {
        __m512 scaled = _mm512_mul_ps(w4a8_load16_vnni(job->x, x_bf16, m * job->K + k), _mm512_set1_ps(inv));
        __m512i q = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
        _mm_storeu_si128((__m128i *)(xq + k), _mm512_cvtepi32_epi8(q));
        sum = _mm512_add_epi32(sum, q);
    }
    int32_t sums[16];
    _mm512_storeu_si512(sums, sum);
    return w4a8_sum_lanes(sums, 16);
}

/* 16 fp32 as bf16 bits: bf16_bits_avx512's rounding, a NaN kept and made quiet (as f32_to_bf16 does). */
TARGET_AVX512VNNI static inline __m256i w4a8_bf16_bits_vnni(__m512 v) {
    const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
    const __m256i quiet = _mm512_cvtepi32_epi16(_mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    return _mm256_mask_mov_epi16(bf16_bits_avx512(v), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
}

/* y[m, n0 .. n0 + lanes) = v in fp32 or bf16 (lanes <= 16: the last tile's rows past N are not stored). */
TARGET_AVX512VNNI static inline void w4a8_store_vnni(const W4A8Job *job, int64_t m, int64_t n0, __m512 v) {
    const int64_t lanes = job->N - n0 < 16 ? job->N - n0 : 16, size = job->y_dtype == DTYPE_F32 ? 4 : 2;
    uint8_t *out = (uint8_t *)job->y + (m * job->N + n0) * size, tail[64];
    uint8_t *to = lanes == 16 ? out : tail;
    if (job->y_dtype == DTYPE_F32)
        _mm512_storeu_ps(to, v);
    else
        _mm256_storeu_si256((__m256i *)to, w4a8_bf16_bits_vnni(v));
    if (lanes < 16)
        memcpy(out, tail, (size_t)(lanes * size));
}

/* acc + the lanes' u8 x s8 products of w and the 4 int8 at p broadcast to every lane: vpdpbusd with its
   broadcast folded into the instruction (GCC 12 loads it into a register first, an extra operation). */
TARGET_AVX512VNNI static inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t *p) {
#if defined(KVQ_SIMDE_CHECK)
    int32_t x;
    memcpy(&x, p, 4);
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x));
#else
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
#endif
}

/* One activation row's int32 sums over a chunk (xr: its xq from the chunk's first input), two chains. */
TARGET_AVX512VNNI static inline __attribute__((always_inline)) __m512i
w4a8_row_sums_vnni(const __m512i *lo, const __m512i *hi, const int8_t *xr, int32_t seed, int nv) {
    __m512i a = _mm512_set1_epi32(seed), b = _mm512_setzero_si512();
    for (int v = 0; v < nv; v++) {
        a = dpbusd_broadcast(a, lo[v], xr + 4 * v);
        b = dpbusd_broadcast(b, hi[v], xr + 4 * (v + nv));
    }
    return _mm512_add_epi32(a, b);
}

/* Tile t (output rows 16t ..) for activation rows [m0, m0 + mb): nv = C / 8 steps of 4 inputs in each half
   of a chunk; its vectors: nv (4-bit weights) or 2 nv (wide: 8-bit, taken as they are). */
TARGET_AVX512VNNI static inline __attribute__((always_inline)) void
w4a8_tile_vnni(const W4A8Job *job, int64_t t, int64_t m0, int64_t mb, int nv, int wide) {
    const int vectors = wide ? 2 * nv : nv;
    const uint8_t *wt = job->w + t * job->chunks * vectors * 64;
    __m512 acc[W4A8_MB];
    for (int64_t r = 0; r < mb; r++)
        acc[r] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int64_t c = 0; c < job->chunks; c++) {
        __m512i lo[8], hi[8];
        const uint8_t *wc = wt + c * vectors * 64;
        for (int v = 0; v < nv; v++) {
            const __m512i w = _mm512_loadu_si512(wc + v * 64);
            lo[v] = wide ? w : _mm512_and_si512(w, nibble);
            hi[v] = wide ? _mm512_loadu_si512(wc + (v + nv) * 64) : _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
        }
        if (mb > 4) /* a long pass: the next tile's chunk c, line by line (the stream's prefetcher lags) */
            for (int v = 0; v < vectors; v++)
                __builtin_prefetch(wc + job->chunks * vectors * 64 + v * 64, 0, 3);
        else
            __builtin_prefetch(wc + vectors * 64 + GEMV_PREFETCH_BYTES, 0, 3);
        const __m512 ws = w4a8_load16_vnni(job->scales, job->scale_bf16, w4a8_scale_index(job, t, c));
        for (int64_t r = 0; r < mb; r += 4) { /* four rows' chains side by side (a short last group) */
            __m512i s[4];
            const int64_t n = mb - r < 4 ? mb - r : 4;
            for (int64_t i = 0; i < n; i++) {
                const uint8_t *row = job->xp + (m0 + r + i) * job->xp_stride;
                const int8_t *xr = (const int8_t *)(row + 8 * job->chunks) + c * job->C;
                s[i] = w4a8_row_sums_vnni(lo, hi, xr, ((const int32_t *)(row + 4 * job->chunks))[c], nv);
            }
            for (int64_t i = 0; i < n; i++) {
                const float xs = ((const float *)(job->xp + (m0 + r + i) * job->xp_stride))[c];
                acc[r + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(ws, _mm512_set1_ps(xs)),
                                             acc[r + i]);
            }
        }
    }
    for (int64_t r = 0; r < mb; r++)
        w4a8_store_vnni(job, m0 + r, t * W4A8_ROWS, acc[r]);
}

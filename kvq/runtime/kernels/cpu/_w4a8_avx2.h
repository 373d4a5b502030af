/* The W4A8 kernel on AVX2 (see _w4a8.h), for CPUs without AVX-512 VNNI: a 64-byte weight vector is two
   256-bit halves, 8 rows each; vpmaddubsw multiplies a half's u8 nibbles by a step's 4 broadcast int8
   activations and adds pairs (|u * xq + u * xq| <= 3810), eight steps add up in int16 (<= 30480, no
   saturation), and vpmaddwd by ones (16 for the high nibbles of 8-bit weights) widens each row's pairs to
   its int32 sum. A tile's chunk is unpacked once into 1 KiB of L1 (2 KiB for 8-bit weights; AVX2 has 16
   registers: the VNNI kernel's 16 unpacked vectors do not fit) and runs up to W4A8_MB activation rows. */

/* 8 fp32 from element i of an fp32 or bf16 array (activations, scales; bf16 widened exactly). */
TARGET_AVX2 static inline __m256 w4a8_load8_avx2(const void *p, int is_bf16, int64_t i) {
    if (!is_bf16)
        return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* max |x| over the chunk of row m from input k0, and in *special whether it holds inf or NaN. */
TARGET_AVX2 static inline __attribute__((always_inline)) float
w4a8_chunk_amax_avx2(const W4A8Job *job, int64_t m, int64_t k0, int *special) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const int x_bf16 = job->x_dtype != DTYPE_F32;
    __m256 top = _mm256_setzero_ps();
    int seen = 0; /* lanes that saw inf or NaN */
    for (int64_t k = k0; k < k0 + job->C; k += 8) {
        const __m256 a = _mm256_and_ps(w4a8_load8_avx2(job->x, x_bf16, m * job->K + k), magnitude);
        seen |= _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ));
        top = _mm256_max_ps(a, top);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    *special = seen != 0;
    return w4a8_max_lanes(lanes, 8);
}

/* The chunk of row m from input k0 times inv, rounded to nearest even (MXCSR's default rounding) and
   clamped to -127..127, into xq (the row's, from input 0); returns their sum. */
TARGET_AVX2 static inline __attribute__((always_inline)) int32_t
w4a8_chunk_quantize_avx2(const W4A8Job *job, int64_t m, int64_t k0, float inv, int8_t *xq) {
    const int x_bf16 = job->x_dtype != DTYPE_F32;
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t k = k0; k < k0 + job->C; k += 16) {
        __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(w4a8_load8_avx2(job->x, x_bf16, m * job->K + k),
                                                      _mm256_set1_ps(inv)));
        __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(w4a8_load8_avx2(job->x, x_bf16, m * job->K + k + 8),
                                                      _mm256_set1_ps(inv)));
        q0 = _mm256_min_epi32(_mm256_max_epi32(q0, lo), hi);
        q1 = _mm256_min_epi32(_mm256_max_epi32(q1, lo), hi);
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(q0, q1));
        __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8); /* 16 int16 in order */
        _mm_storeu_si128((__m128i *)(xq + k),
                         _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
    }
    int32_t sums[8];
    _mm256_storeu_si256((__m256i *)sums, sum);
    return w4a8_sum_lanes(sums, 8);
}

/* 8 fp32 as bf16 bits in the low 16 bits of each 32-bit lane, rounded to nearest even, a NaN kept and made
   quiet (as f32_to_bf16 does). */
TARGET_AVX2 static inline __m256i w4a8_bf16_bits_avx2(__m256 v) {
    const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    const __m256i bits = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_castps_si256(v), _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(bits, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
}

/* y[m, n0 .. n0 + lanes) = the tile's rows 0-7 (a) and 8-15 (b) in fp32 or bf16 (rows past N not stored). */
TARGET_AVX2 static inline void w4a8_store_avx2(const W4A8Job *job, int64_t m, int64_t n0, __m256 a, __m256 b) {
    const int64_t lanes = job->N - n0 < 16 ? job->N - n0 : 16, size = job->y_dtype == DTYPE_F32 ? 4 : 2;
    uint8_t *out = (uint8_t *)job->y + (m * job->N + n0) * size, tail[64];
    uint8_t *to = lanes == 16 ? out : tail;
    if (job->y_dtype == DTYPE_F32) {
        _mm256_storeu_ps((float *)to, a);
        _mm256_storeu_ps((float *)to + 8, b);
    } else {
        __m256i words = _mm256_packus_epi32(w4a8_bf16_bits_avx2(a), w4a8_bf16_bits_avx2(b));
        _mm256_storeu_si256((__m256i *)to, _mm256_permute4x64_epi64(words, 0xD8));
    }
    if (lanes < 16)
        memcpy(out, tail, (size_t)(lanes * size));
}

/* Tile t for activation rows [m0, m0 + mb): nv = C / 8 steps of 4 inputs in each half of a chunk. Its
   vectors (nv, or 2 nv when wide) are unpacked by nibble into steps of `u8`: low nibbles of vector v at
   step v, high ones at v + nv (4-bit: the chunk's second half) or v + 2 nv (wide: the high nibbles of
   every step). Group g of nv steps pairs u8 steps g nv .. with the activations of half g % 2, and adds
   its sums once (g < 2) or 16 times (g >= 2: high nibbles of 8-bit weights). */
TARGET_AVX2 static inline __attribute__((always_inline)) void
w4a8_tile_avx2(const W4A8Job *job, int64_t t, int64_t m0, int64_t mb, int nv, int wide) {
    const int vectors = wide ? 2 * nv : nv, groups = wide ? 4 : 2;
    const uint8_t *wt = job->w + t * job->chunks * vectors * 64;
    __m256 acc[W4A8_MB][2];
    for (int64_t r = 0; r < mb; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    __m256i u8[32][2] __attribute__((aligned(32))); /* [step][half]: a chunk's unpacked weights, <= 2 KiB */
    const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
    for (int64_t c = 0; c < job->chunks; c++) {
        const uint8_t *wc = wt + c * vectors * 64;
        for (int v = 0; v < vectors; v++)
            for (int h = 0; h < 2; h++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wc + v * 64 + 32 * h));
                u8[v][h] = _mm256_and_si256(w, nibble);
                u8[v + vectors][h] = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
            }
        __builtin_prefetch(wc + vectors * 64 + GEMV_PREFETCH_BYTES, 0, 3);
        const int64_t si = w4a8_scale_index(job, t, c); /* a half's 8 lanes: rows 8h .. 8h + 7 */
        const __m256 ws0 = w4a8_load8_avx2(job->scales, job->scale_bf16, si);
        const __m256 ws1 = w4a8_load8_avx2(job->scales, job->scale_bf16, si + 8);
        for (int64_t r = 0; r < mb; r++) {
            const uint8_t *row = job->xp + (m0 + r) * job->xp_stride;
            const int8_t *xr = (const int8_t *)(row + 8 * job->chunks) + c * job->C;
            const __m256i seed = _mm256_set1_epi32(((const int32_t *)(row + 4 * job->chunks))[c]);
            __m256i sum[2] = {seed, seed};
            for (int g = 0; g < groups; g++) {
                __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256(); /* int16 pair sums */
                for (int v = 0; v < nv; v++) { /* nv <= 8 steps: within int16 */
                    int32_t four;
                    memcpy(&four, xr + 4 * (v + (g & 1) * nv), 4);
                    const __m256i x4 = _mm256_set1_epi32(four);
                    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(u8[g * nv + v][0], x4));
                    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(u8[g * nv + v][1], x4));
                }
                const __m256i times = g < 2 ? ones : sixteens;
                sum[0] = _mm256_add_epi32(sum[0], _mm256_madd_epi16(s0, times));
                sum[1] = _mm256_add_epi32(sum[1], _mm256_madd_epi16(s1, times));
            }
            const __m256 xs = _mm256_set1_ps(((const float *)row)[c]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[0]), _mm256_mul_ps(ws0, xs), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[1]), _mm256_mul_ps(ws1, xs), acc[r][1]);
        }
    }
    for (int64_t r = 0; r < mb; r++)
        w4a8_store_avx2(job, m0 + r, t * W4A8_ROWS, acc[r][0], acc[r][1]);
}

/* The avx512bf16 path's W4A16 GEMV and GEMM for bf16 activations (amx's below AMX_FROM_ROWS rows) on integer
   dot products, where vnni_wanted says (Intel CPUs, or $KVQ_CPU_DOT=vnni; else gemv_bf16 and gemm_bf16):
   AVX-512 VNNI's vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and adds each lane's four products
   to its int32, exactly. Included by _linear.c after _linear_bf16.h (its scale vectors and block loads
   are the AVX-512 path's); every CPU with AVX512_BF16 has AVX512_VNNI.

   Why: on Sapphire / Emerald Rapids vdpbf16ps issues once per two cycles (eight independent chains: 2.1
   cycles each; vpdpbusd 0.5 with twelve, vfmadd 0.5), so the GEMV on bf16 pairs spent ~17-20 cycles per block of 128
   weights. Here ~8.5-11 (stop 37; 11-13 at stop 36: 1.34-1.68x per call with the weights in L2); the GEMM
   1.35-1.49x.

   The activations, each row on its own: X = rint(x * 2^(22 - e)), one power of two with 2^e above its largest
   |x|, so |X| < 2^22, written as X = 65536 h + 256 m + l with h, m, l in -128..127 (signed bytes). A bf16 has
   8 significant bits, so every element within 2^-15 of the row's largest is exact; smaller ones are rounded
   to a multiple of 2^(e - 22), i.e. within 2^-23 of the largest, where fp32 sums round anyway. The weights: a
   block's 64 bytes as they are, low nibbles (w & 15) and high nibbles (w >> 4 & 15) as unsigned bytes u = q
   + 8. Lane i of a block is word i (inputs 8i..8i+7), so byte 4i + j of the low (high) nibble vector is input
   8i + 2j (8i + 2j + 1); the activations' planes hold the same inputs at the same bytes. Six vpdpbusd per
   block (h, m, l times both nibble vectors) give each lane's sum of u * X as 65536 H + 256 M + L in int32
   (|sum| < 2^29), the L sum seeded with -8 * (the lane's sum of X), so the result is the lane's sum of q * X,
   exact. It goes to fp32 (exact below 2^24, else rounded once), times the lane's group scale, into the fp32
   accumulator; the row's total times 2^(e - 22), in two exact halves (a factor below 2^-126 would flush). So
   each product and each lane's block sum are exact where the vdpbf16ps path rounded every other addition, and
   denormal activations are kept (it flushed them). A row holding inf or NaN gives NaN outputs (in its row of
   y). */

#define VNNI_HEADER_BYTES 64 /* the row's two scale halves (fp32), padded to a cache line */
#define VNNI_BLOCK_BYTES 512 /* h, m, l x (low, high nibble inputs) x 64 bytes, 16 int32 seeds, padding */
#define VNNI_SEEDS 384       /* offset of the seeds in a block */

/* Row xp's stride in 4-byte units for K inputs. */
static int64_t vnni_xp_stride(int64_t K) {
    return (VNNI_HEADER_BYTES + (K / 8 + 15) / 16 * VNNI_BLOCK_BYTES) / 4;
}

/* Pieces h, m, l of X (16 int32 lanes) as signed bytes into planes + 0, 128, 256 (the plane's offset
   already added): l = X - 256 X1 and m = X1 - 256 h, each in -128..127. */
TARGET_AVX512VNNI static inline void vnni_store_pieces(__m512i X, uint8_t *planes) {
    const __m512i bias = _mm512_set1_epi32(128), byte = _mm512_set1_epi32(255);
    __m512i l = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X, bias), byte), bias);
    __m512i X1 = _mm512_srai_epi32(_mm512_sub_epi32(X, l), 8);
    __m512i m = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X1, bias), byte), bias);
    __m512i h = _mm512_srai_epi32(_mm512_sub_epi32(X1, m), 8);
    _mm_storeu_si128((__m128i *)planes, _mm512_cvtepi32_epi8(h));
    _mm_storeu_si128((__m128i *)(planes + 128), _mm512_cvtepi32_epi8(m));
    _mm_storeu_si128((__m128i *)(planes + 256), _mm512_cvtepi32_epi8(l));
}

/* 16 bf16 (as 16-bit lanes of a 256-bit vector) as fp32. */
TARGET_AVX512VNNI static inline __m512 vnni_widen(__m256i bf16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

/* Row m of bf16 activations as gemv_vnni reads them: the header (the two halves of 2^(e - 22), or NaN
   for a row holding inf or NaN), then per block of 16 words the planes and the lanes' seeds -8 * sum(X);
   inputs past K (a tail block's, K being a multiple of 32) are 0. */
TARGET_AVX512VNNI static void convert_row_vnni(const Job *job, int64_t m) {
    const uint16_t *x = (const uint16_t *)job->x + m * job->K;
    uint8_t *out = (uint8_t *)(job->xp + m * job->xp_stride);
    const int64_t K = job->K, num_blocks = (K / 8 + 15) / 16;
    const __m512i magnitude = _mm512_set1_epi16(0x7FFF), exponent = _mm512_set1_epi16(0x7F80);
    __m512i top = _mm512_setzero_si512(); /* |x| as bf16 bits: ordered as the values (finite ones) */
    __mmask32 special = 0;
    for (int64_t k = 0; k < K; k += 32) {
        __m512i v = _mm512_and_si512(_mm512_loadu_si512(x + k), magnitude);
        special |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, exponent), exponent);
        top = _mm512_max_epu16(top, v);
    }
    uint16_t lanes[32], largest = 0;
    _mm512_storeu_si512(lanes, top);
    for (int i = 0; i < 32; i++)
        largest = lanes[i] > largest ? lanes[i] : largest;
    int e = 0;
    if (largest != 0)
        frexpf(bits_f32((uint32_t)largest << 16), &e);
    const int up_lo = (22 - e) / 2, up_hi = 22 - e - up_lo; /* 2^(22 - e) in two representable halves */
    float halves[2] = {ldexpf(1.0f, -up_lo), ldexpf(1.0f, -up_hi)};
    if (special)
        halves[0] = halves[1] = NAN;
    memset(out, 0, VNNI_HEADER_BYTES);
    memcpy(out, halves, sizeof halves);
    out += VNNI_HEADER_BYTES;
    const __m512 up0 = _mm512_set1_ps(ldexpf(1.0f, up_lo)), up1 = _mm512_set1_ps(ldexpf(1.0f, up_hi));
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t b = 0; b < num_blocks; b++, out += VNNI_BLOCK_BYTES) {
        int32_t seeds[16];
        for (int u = 0; u < 4; u++) { /* 32 inputs: words 4u..4u+3 of the block */
            const int64_t k = 128 * b + 32 * u;
            __m512i X0 = _mm512_setzero_si512(), X1 = X0;
            if (k < K && !special) {
                __m512i v = _mm512_loadu_si512(x + k);
                __m512 lo = vnni_widen(_mm512_castsi512_si256(v)), hi = vnni_widen(_mm512_extracti64x4_epi64(v, 1));
                const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
                X0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_mul_ps(lo, up0), up1), round);
                X1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_mul_ps(hi, up0), up1), round);
            }
            __m512i lo_inputs = _mm512_permutex2var_epi32(X0, even, X1); /* the low nibbles' inputs */
            __m512i hi_inputs = _mm512_permutex2var_epi32(X0, odd, X1);
            vnni_store_pieces(lo_inputs, out + 16 * u);
            vnni_store_pieces(hi_inputs, out + 64 + 16 * u);
            int32_t pairs[16]; /* pairs[t]: inputs 2t, 2t + 1 of the 32; word 4u + t / 4 */
            _mm512_storeu_si512(pairs, _mm512_add_epi32(lo_inputs, hi_inputs));
            for (int i = 0; i < 4; i++)
                seeds[4 * u + i] = -8 * (pairs[4 * i] + pairs[4 * i + 1] + pairs[4 * i + 2] + pairs[4 * i + 3]);
        }
        memcpy(out + VNNI_SEEDS, seeds, sizeof seeds);
    }
}

/* A block's per-lane sums of q * X (exact, int32) from its weights as nibble bytes (low, high) and its
   activation planes and seeds at xb: see the top of this file. Three independent pairs of vpdpbusd, then
   65536 H + 256 M + (L + seeds) (the GEMM's: its tiles keep many blocks in flight). */
TARGET_AVX512VNNI static inline __m512i lane_sums_vnni(__m512i lo, __m512i hi, const uint8_t *xb) {
    const __m512i zero = _mm512_setzero_si512();
    __m512i sum_h = _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(xb));
    __m512i sum_m = _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(xb + 128));
    __m512i sum_l = _mm512_dpbusd_epi32(_mm512_loadu_si512(xb + VNNI_SEEDS), lo, _mm512_loadu_si512(xb + 256));
    sum_h = _mm512_dpbusd_epi32(sum_h, hi, _mm512_loadu_si512(xb + 64));
    sum_m = _mm512_dpbusd_epi32(sum_m, hi, _mm512_loadu_si512(xb + 192));
    sum_l = _mm512_dpbusd_epi32(sum_l, hi, _mm512_loadu_si512(xb + 320));
    return _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(sum_h, 16), _mm512_slli_epi32(sum_m, 8)), sum_l);
}

/* lane_sums_vnni's sums with one op fewer, for the GEMV (there 1.05-1.13x with the scale kinds below; in the
   GEMM 12% slower at 8 rows): the h sums, shifted, seed the m sums, 256 * (256 H + M) + (L + seeds), two
   shifts and one add (int32 wraps; the total is below 2^28). */
TARGET_AVX512VNNI static inline __m512i lane_sums_chained(__m512i lo, __m512i hi, const uint8_t *xb) {
    __m512i sum_h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xb));
    sum_h = _mm512_dpbusd_epi32(sum_h, hi, _mm512_loadu_si512(xb + 64));
    __m512i sum_l = _mm512_dpbusd_epi32(_mm512_loadu_si512(xb + VNNI_SEEDS), lo, _mm512_loadu_si512(xb + 256));
    sum_l = _mm512_dpbusd_epi32(sum_l, hi, _mm512_loadu_si512(xb + 320));
    __m512i sum_hm = _mm512_dpbusd_epi32(_mm512_slli_epi32(sum_h, 8), lo, _mm512_loadu_si512(xb + 128));
    sum_hm = _mm512_dpbusd_epi32(sum_hm, hi, _mm512_loadu_si512(xb + 192));
    return _mm512_add_epi32(_mm512_slli_epi32(sum_hm, 8), sum_l);
}

/* A block's 16 words as nibble bytes: low nibbles, then high. */
TARGET_AVX512VNNI static inline __m512i low_nibbles(__m512i w) {
    return _mm512_and_si512(w, _mm512_set1_epi8(15));
}
TARGET_AVX512VNNI static inline __m512i high_nibbles(__m512i w) {
    return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(15));
}

TARGET_AVX512VNNI static inline __m512i block_sums_vnni(__m512i w, const uint8_t *xb) {
    return lane_sums_chained(low_nibbles(w), high_nibbles(w), xb);
}

/* Half a block (8 words, lanes 0-7: the first 32 bytes of each plane) in 256-bit registers, times scale. */
TARGET_AVX512VNNI static inline __m256 half_block_vnni(const int32_t *w8, const uint8_t *xb, __m256 scale) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)w8), nibble = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(w, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
#define PLANE(offset) _mm256_loadu_si256((const __m256i *)(xb + (offset)))
    __m256i sum_h = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, PLANE(0)), hi, PLANE(64));
    __m256i sum_l = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(PLANE(VNNI_SEEDS), lo, PLANE(256)), hi, PLANE(320));
    __m256i sum_hm = _mm256_dpbusd_epi32(_mm256_slli_epi32(sum_h, 8), lo, PLANE(128));
    sum_hm = _mm256_dpbusd_epi32(sum_hm, hi, PLANE(192));
#undef PLANE
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(sum_hm, 8), sum_l)), scale);
}

/* Row n's per-lane sums of q * X times the group scales, over all its blocks. */
TARGET_AVX512VNNI static inline __attribute__((always_inline)) __m256 row_dot_vnni(const Job *job, GemvRows r,
                                                                                int64_t n, __m512i idx, int kind) {
    const int64_t words = r.words, whole = r.whole, tail = r.tail;
    const int32_t *wrow = r.packed + n * words;
    const uint8_t *srow = r.scale + n * r.scale_stride;
    const uint8_t *xb = r.x;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < whole; b++, xb += VNNI_BLOCK_BYTES) {
        prefetch_ahead(wrow + b * 16);
        __m512i s = block_sums_vnni(_mm512_loadu_si512(wrow + b * 16), xb);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), block_scales(job, srow, b, idx, kind), acc);
    }
    if (tail == 8 && kind == SCALES_BF16_G64) { /* K % 128 = 64: one group left */
        __m256 scale = _mm512_castps512_ps256(bf16_broadcast(srow + 4 * whole));
        return _mm256_add_ps(half_sum_avx512(acc), half_block_vnni(wrow + whole * 16, xb, scale));
    }
    if (tail > 0) { /* the words past K load as 0 */
        __m512i s = block_sums_vnni(load_block_avx512(wrow, whole, words), xb);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), tail_block_scales(job, srow, whole, idx, kind), acc);
    }
    return half_sum_avx512(acc);
}

/* M = 1: rows streamed one after another, in fours sharing the horizontal sums' shuffles (four rows side by
   side, sharing the activation loads, ran 1.1x faster with the weights in L2 at K = 576 but slower from
   DRAM: 4% fewer tokens a second in a SmolLM2 decode step). One copy of the loop per scale kind. */
TARGET_AVX512VNNI static inline __attribute__((always_inline)) void gemv_vnni_rows(const Job *job, int64_t n0,
                                                                                int64_t n1, int kind) {
    const __m512i idx = expand_index_avx512(job->group);
    float halves[2];
    memcpy(halves, job->xp, sizeof halves);
    const __m128 half0 = _mm_set1_ps(halves[0]), half1 = _mm_set1_ps(halves[1]);
    const GemvRows r = gemv_rows_of(job, (const uint8_t *)job->xp + VNNI_HEADER_BYTES);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        __m256 a0 = row_dot_vnni(job, r, n, idx, kind), a1 = row_dot_vnni(job, r, n + 1, idx, kind);
        __m256 a2 = row_dot_vnni(job, r, n + 2, idx, kind), a3 = row_dot_vnni(job, r, n + 3, idx, kind);
        __m128 sums = hsum4_avx2(a0, a1, a2, a3);
        store_y4(job, 0, n, _mm_mul_ps(_mm_mul_ps(sums, half0), half1));
    }
    for (; n < n1; n++) {
        __m128 sums = hsum4_avx2(row_dot_vnni(job, r, n, idx, kind), _mm256_setzero_ps(), _mm256_setzero_ps(),
                                 _mm256_setzero_ps());
        store_y(job, 0, n, _mm_cvtss_f32(sums) * halves[0] * halves[1]);
    }
}

TARGET_AVX512VNNI static void gemv_vnni(const Job *job, int64_t n0, int64_t n1) {
    BY_SCALE_KIND(gemv_vnni_rows, job, n0, n1);
}

#define VNNI_KC 8       /* blocks per tile of 4 weight rows (nibble bytes and scales: 6 KiB, in L1) */
#define VNNI_M_BLOCK 64 /* activation rows per pass over a tile */

/* M >= 2: per 4 weight rows and VNNI_KC blocks, the nibble bytes and lane scales once into a tile, then
   every activation row through it (each row's planes loaded once for the 4 weight rows). */
TARGET_AVX512VNNI static void gemm_vnni(const Job *job, int64_t n0, int64_t n1) {
    const int64_t words = job->K / 8, num_blocks = (words + 15) / 16, whole = words / 16;
    const __m512i idx = expand_index_avx512(job->group);
    const int kind = scale_kind(job);
    __m512i lo[4 * VNNI_KC], hi[4 * VNNI_KC];
    __m512 scales[4 * VNNI_KC];
    __m512 acc[VNNI_M_BLOCK * 4];
    for (int64_t n = n0; n < n1; n += 4) {
        const int num_rows = n1 - n < 4 ? (int)(n1 - n) : 4;
        for (int i = num_rows * VNNI_KC; i < 4 * VNNI_KC; i++) { /* a missing row: u 0, scale 0 */
            lo[i] = hi[i] = _mm512_setzero_si512();
            scales[i] = _mm512_setzero_ps();
        }
        for (int64_t m0 = 0; m0 < job->M; m0 += VNNI_M_BLOCK) {
            const int64_t mb = job->M - m0 < VNNI_M_BLOCK ? job->M - m0 : VNNI_M_BLOCK;
            for (int64_t i = 0; i < mb * 4; i++)
                acc[i] = _mm512_setzero_ps();
            for (int64_t b0 = 0; b0 < num_blocks; b0 += VNNI_KC) {
                const int64_t nb = num_blocks - b0 < VNNI_KC ? num_blocks - b0 : VNNI_KC;
                for (int r = 0; r < num_rows; r++) {
                    const int32_t *wrow = job->packed + (n + r) * words;
                    const uint8_t *srow = job->scale + (n + r) * job->num_groups * job->scale_size;
                    for (int64_t b = 0; b < nb; b++) {
                        __m512i w = load_block_avx512(wrow, b0 + b, words);
                        lo[r * VNNI_KC + b] = low_nibbles(w), hi[r * VNNI_KC + b] = high_nibbles(w);
                        scales[r * VNNI_KC + b] = b0 + b < whole ? block_scales(job, srow, b0 + b, idx, kind)
                                                                 : tail_block_scales(job, srow, b0 + b, idx, kind);
                    }
                }
                for (int64_t m = 0; m < mb; m++) {
                    const uint8_t *xb = (const uint8_t *)(job->xp + (m0 + m) * job->xp_stride) +
                                        VNNI_HEADER_BYTES + b0 * VNNI_BLOCK_BYTES;
                    __m512 *a = acc + m * 4;
                    for (int64_t b = 0; b < nb; b++, xb += VNNI_BLOCK_BYTES)
                        for (int r = 0; r < 4; r++) {
                            const int t = r * VNNI_KC + (int)b;
                            __m512i s = lane_sums_vnni(lo[t], hi[t], xb);
                            a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scales[t], a[r]);
                        }
                }
            }
            for (int64_t m = 0; m < mb; m++) { /* gemv_vnni's stores, again: one shared helper ran 4-7% slower */
                const __m512 *a = acc + m * 4;
                float halves[2];
                memcpy(halves, job->xp + (m0 + m) * job->xp_stride, sizeof halves);
                if (num_rows == 4) {
                    __m128 sums = hsum4_avx2(half_sum_avx512(a[0]), half_sum_avx512(a[1]), half_sum_avx512(a[2]),
                                             half_sum_avx512(a[3]));
                    sums = _mm_mul_ps(_mm_mul_ps(sums, _mm_set1_ps(halves[0])), _mm_set1_ps(halves[1]));
                    store_y4(job, m0 + m, n, sums);
                } else {
                    for (int r = 0; r < num_rows; r++)
                        store_y(job, m0 + m, n + r, _mm512_reduce_add_ps(a[r]) * halves[0] * halves[1]);
                }
            }
        }
    }
}

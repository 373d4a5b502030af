/* The AVX-512 BF16 W4A16 kernels (path avx512bf16, for bf16 activations): gemv_bf16 at M = 1 where the
   GEMV is not _linear_vnni.h's, gemm_bf16 at M >= 2 (W8A16's: _w8a16_bf16.h).
   Included by _linear.c after the AVX-512 path, whose block layout, scale vectors and tail loads the
   W4A16 ones share.

   A block is 16 int32 words of one weight row (128 elements, word i in lane i, nibble j of word i is
   element 8i + j). Here its elements go as 4 pair planes: plane p, lane i holds elements 8i + p (low
   half) and 8i + 4 + p (high half), the nibbles p and 4 + p of word i, which sit at the same place in
   its two 16-bit halves. So one 16-bit shift by 4p puts both at the bottom of their halves and one
   vpermw (which reads 5 index bits: a table of 32 that repeats) turns them into q = u - 8 as two bf16
   (exact: -8..7): two instructions per 32 weights (q_pairs). convert_row_pairs lays the activations out
   as the same pairs. vdpbf16ps multiplies each pair and adds both products to the lane's fp32 sum. Per
   block and (activation row, weight row) of the GEMV, 4 vdpbf16ps from zero give the lane's sum of q * x,
   which goes times the lane's group scale into the fp32 accumulator. So its sums are the fp32 path's in
   another order (products of bf16 pairs are exact in fp32; vdpbf16ps flushes denormals to zero).
   gemv_bf16 makes the pairs in registers, one row after another. gemm_bf16 (M >= 2) multiplies
   compressed-tensors' bf16 weight, bf16(q * scale), as the amx path and dense_matmul do: the same shift
   indexes a table of the block's groups' bf16(q * scale) (scaled_planes_bf16, shared with the amx path),
   once per tile of 4 rows x GEMM_KC blocks, and every activation row goes through the tile four at a time,
   4 vdpbf16ps per block and (activation row, weight row) straight into the fp32 accumulators (16 of them,
   8 loads per 16 vdpbf16ps; its inner loop alone: ~1.2 cycles per vdpbf16ps on a Zen 4 core). It replaced
   (stop 38) a GEMM on exact q like the GEMV's (pairs of rows, 8 accumulators, a scale multiply per block):
   1.1x that one at 8-64 rows, 1.0x at 2-4 on Zen 4. Tried and slower: lanes that each own 64 consecutive
   elements of a 1024-element range, so that one multiply per 32 elements suffices (gathered weights, and a
   whole range of work for K = 576: 0.6-0.9x this layout). The GEMV takes its block scales as
   _linear_vnni.h's GEMV does (block_scales: the scale kind chosen once per call; GemvRows: the job's
   fields read once) and runs K % 128 = 64's half block in 256-bit registers: [3072, 576] 60.8 -> 55.3 us
   with the weights in cache on Zen 4, no change from memory (~13.5 GB/s there; one core streams 19.8). */

#define BF_TILE (GEMM_KC * 4) /* pair-plane vectors per tile row (_linear_gemm.h) */

TARGET_AVX512BF16 static inline __m512bh as_bf16_pairs(__m512i v) {
    __m512bh out;
    memcpy(&out, &v, sizeof out);
    return out;
}

/* The vpermw table: entry j is q = (j & 15) - 8 as bf16 (the index's fifth bit is the next nibble's). */
TARGET_AVX512BF16 static __m512i q_table(void) {
    uint16_t t[32];
    for (int j = 0; j < 32; j++) {
        float q = (float)((j & 15) - 8);
        uint32_t bits;
        memcpy(&bits, &q, 4);
        t[j] = (uint16_t)(bits >> 16); /* exact: these fp32 have a zero bottom half */
    }
    return _mm512_loadu_si512(t);
}

/* Pair plane p (0..3) of block w as bf16 q pairs (see the top of this file). */
TARGET_AVX512BF16 static inline __m512i q_pairs(__m512i w, int p, __m512i table) {
    return _mm512_permutexvar_epi16(p ? _mm512_srli_epi16(w, 4 * p) : w, table);
}

/* How a row's group scales become a block's 16 lane scales (block_scales), decided once per call so that a
   GEMV's block loop holds no branch on it: bf16 scales in groups of 64 (two per block) or of 128 or more
   (one per block), else scale_vec_avx512's general way. Shared with _linear_vnni.h. */
enum { SCALES_ANY = 0, SCALES_BF16_G64 = 1, SCALES_BF16_WHOLE = 2 };

static int scale_kind(const Job *job) {
    if (job->scale_dtype != DTYPE_BF16)
        return SCALES_ANY;
    return job->group_shift == 6 ? SCALES_BF16_G64 : job->group_shift >= 7 ? SCALES_BF16_WHOLE : SCALES_ANY;
}

/* rows(job, n0, n1, kind) with the job's scale kind as a constant: a GEMV's copy of its loops per kind. */
#define BY_SCALE_KIND(rows, job, n0, n1)                                                                         \
    switch (scale_kind(job)) {                                                                                   \
    case SCALES_BF16_G64:                                                                                        \
        rows(job, n0, n1, SCALES_BF16_G64);                                                                      \
        break;                                                                                                   \
    case SCALES_BF16_WHOLE:                                                                                      \
        rows(job, n0, n1, SCALES_BF16_WHOLE);                                                                    \
        break;                                                                                                   \
    default:                                                                                                     \
        rows(job, n0, n1, SCALES_ANY);                                                                           \
    }

/* A bf16 scale as 16 fp32 lanes. */
TARGET_AVX512 static inline __m512 bf16_broadcast(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
    return _mm512_castsi512_ps(_mm512_set1_epi32((int32_t)((uint32_t)bits << 16)));
}

/* The lane scales of block b (all 16 words inside K). SCALES_BF16_G64: the two bf16 scales by one 32-bit
   broadcast and a per-lane shift instead of a permute. */
TARGET_AVX512 static inline __attribute__((always_inline)) __m512 block_scales(const Job *job, const uint8_t *srow,
                                                                               int64_t b, __m512i idx, int kind) {
    if (kind == SCALES_BF16_G64) {
        const __m512i shifts = _mm512_setr_epi32(16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0);
        int32_t pair;
        memcpy(&pair, srow + 4 * b, 4);
        __m512i v = _mm512_sllv_epi32(_mm512_set1_epi32(pair), shifts);
        return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
    }
    if (kind == SCALES_BF16_WHOLE)
        return bf16_broadcast(srow + 2 * ((b << 7) >> job->group_shift));
    return scale_vec_avx512(job, srow, b, idx);
}

/* The lane scales of a tail block (words past K load as 0): with groups of 64 and half a block left, its
   one group's scale in every lane (the other 8 lanes' sums are 0). */
TARGET_AVX512 static inline __m512 tail_block_scales(const Job *job, const uint8_t *srow, int64_t b, __m512i idx,
                                                     int kind) {
    if (kind == SCALES_BF16_G64 && 2 * b + 1 == job->num_groups)
        return bf16_broadcast(srow + 4 * b);
    return scale_vec_avx512(job, srow, b, idx);
}

/* A GEMV's view of a job, read once per call: in the row loop the compiler reloads a Job's fields after each
   store into y (it cannot tell that y does not alias them). x: the activations' first block. */
typedef struct {
    const int32_t *packed;
    const uint8_t *scale, *x;
    int64_t words, whole, tail, scale_stride;
} GemvRows;

static inline GemvRows gemv_rows_of(const Job *job, const void *x) {
    const int64_t words = job->K / 8;
    return (GemvRows){job->packed, job->scale, (const uint8_t *)x, words, words / 16, words % 16,
                      job->num_groups * job->scale_size};
}

/* A block's per-lane sums of q * x (its 16 words w, its activation pair planes at xb): 4 vdpbf16ps. */
TARGET_AVX512BF16 static inline __m512 block_dot_bf16(__m512i w, const uint32_t *xb, __m512i table) {
    __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bf16_pairs(q_pairs(w, 0, table)),
                                as_bf16_pairs(_mm512_loadu_si512(xb)));
    s = _mm512_dpbf16_ps(s, as_bf16_pairs(q_pairs(w, 1, table)), as_bf16_pairs(_mm512_loadu_si512(xb + 16)));
    s = _mm512_dpbf16_ps(s, as_bf16_pairs(q_pairs(w, 2, table)), as_bf16_pairs(_mm512_loadu_si512(xb + 32)));
    return _mm512_dpbf16_ps(s, as_bf16_pairs(q_pairs(w, 3, table)), as_bf16_pairs(_mm512_loadu_si512(xb + 48)));
}

/* Half a block (8 words: lanes 0-7, the first 8 lanes of each plane) in 256-bit registers: the same 4
   vdpbf16ps on half the width (ymm vpermw reads 4 index bits: the table's first 16 entries). */
TARGET_AVX512BF16 static inline __m256 half_block_dot_bf16(const int32_t *w8, const uint32_t *xb, __m512i table) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)w8), t = _mm512_castsi512_si256(table);
    __m256 s = _mm256_setzero_ps();
    for (int p = 0; p < 4; p++) {
        __m256i q = _mm256_permutexvar_epi16(p ? _mm256_srli_epi16(w, 4 * p) : w, t);
        __m256bh pairs, x;
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xb + 16 * p));
        memcpy(&pairs, &q, sizeof pairs);
        memcpy(&x, &xv, sizeof x);
        s = _mm256_dpbf16_ps(s, pairs, x);
    }
    return s;
}

/* Row n's per-lane sums of q * x times the group scales, over all its blocks (M = 1), 8 lanes. */
TARGET_AVX512BF16 static inline __attribute__((always_inline)) __m256 row_dot_bf16(const Job *job, GemvRows r,
                                                                                int64_t n, __m512i idx,
                                                                                __m512i table, int kind) {
    const int32_t *wrow = r.packed + n * r.words;
    const uint8_t *srow = r.scale + n * r.scale_stride;
    const uint32_t *x = (const uint32_t *)r.x;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < r.whole; b++) {
        prefetch_ahead(wrow + b * 16);
        __m512 s = block_dot_bf16(_mm512_loadu_si512(wrow + b * 16), x + b * 64, table);
        acc = _mm512_fmadd_ps(s, block_scales(job, srow, b, idx, kind), acc);
    }
    if (r.tail == 8 && kind == SCALES_BF16_G64) { /* K % 128 = 64: one group left */
        __m256 scale = _mm512_castps512_ps256(bf16_broadcast(srow + 4 * r.whole));
        __m256 s = half_block_dot_bf16(wrow + r.whole * 16, x + r.whole * 64, table);
        return _mm256_fmadd_ps(s, scale, half_sum_avx512(acc));
    }
    if (r.tail > 0) { /* the words past K load as 0 */
        __m512 s = block_dot_bf16(load_block_avx512(wrow, r.whole, r.words), x + r.whole * 64, table);
        acc = _mm512_fmadd_ps(s, tail_block_scales(job, srow, r.whole, idx, kind), acc);
    }
    return half_sum_avx512(acc);
}

/* M = 1: each row streamed on its own (rows read side by side defeat the prefetcher on long rows, and on a
   Zen 4 core sharing the activation loads gained nothing); rows in fours share the horizontal sums'
   shuffles. One copy of the loop per scale kind. */
TARGET_AVX512BF16 static inline __attribute__((always_inline)) void gemv_bf16_rows(const Job *job, int64_t n0,
                                                                                int64_t n1, int kind) {
    const __m512i idx = expand_index_avx512(job->group), table = q_table();
    const GemvRows r = gemv_rows_of(job, job->xp);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        __m256 a0 = row_dot_bf16(job, r, n, idx, table, kind), a1 = row_dot_bf16(job, r, n + 1, idx, table, kind);
        __m256 a2 = row_dot_bf16(job, r, n + 2, idx, table, kind), a3 = row_dot_bf16(job, r, n + 3, idx, table, kind);
        store_y4(job, 0, n, hsum4_avx2(a0, a1, a2, a3));
    }
    for (; n < n1; n++) {
        const __m256 zero = _mm256_setzero_ps();
        store_y(job, 0, n, _mm_cvtss_f32(hsum4_avx2(row_dot_bf16(job, r, n, idx, table, kind), zero, zero, zero)));
    }
}

TARGET_AVX512BF16 static void gemv_bf16(const Job *job, int64_t n0, int64_t n1) {
    BY_SCALE_KIND(gemv_bf16_rows, job, n0, n1);
}

/* bf16((u - 8) * s) for u = 0..15 as 16 fp32 (a quarter of scaled_planes_bf16's table). */
TARGET_AVX512BF16 static inline __m512 scaled_q_bf16(float s) {
    const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    return _mm512_mul_ps(q, _mm512_set1_ps(s));
}

/* low's and high's 16 fp32 as 32 bf16 (entries 0..15 low, 16..31 high), rounded to nearest even as
   `dequantize` rounds, but a denormal flushed to zero (vcvtne2ps2bf16; vdpbf16ps and tdpbf16ps would read
   it as zero). */
TARGET_AVX512BF16 static inline __m512i scaled_table_bf16(__m512 low, __m512 high) {
#if defined(KVQ_SIMDE_CHECK) /* SIMDe 0.7 has no vcvtne2ps2bf16 */
    float lanes[32];
    uint16_t halves[32];
    _mm512_storeu_ps(lanes, low);
    _mm512_storeu_ps(lanes + 16, high);
    for (int i = 0; i < 32; i++)
        halves[i] = f32_to_bf16(lanes[i]);
    return _mm512_loadu_si512(halves);
#else
    __m512bh table = _mm512_cvtne2ps_pbh(high, low);
    __m512i out;
    memcpy(&out, &table, sizeof out);
    return out;
#endif
}

/* Bits 4-5 of a block's 16-bit half i (inputs 4i..4i+3): its group in the block, (4i / group), for the
   block's groups (1, 2 or 4). */
TARGET_AVX512BF16 static inline __m512i group_bits_bf16(int64_t groups) {
    return groups == 4   ? _mm512_set_epi16(48, 48, 48, 48, 48, 48, 48, 48, 32, 32, 32, 32, 32, 32, 32, 32, 16, 16, 16,
                                            16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0)
           : groups == 2 ? _mm512_set_epi16(16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0,
                                            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
                         : _mm512_setzero_si512();
}

/* Block `words` (16 words of a row, its groups g0.. of a row's scales srow: `groups` of them, the first
   `valid` inside K) as its 4 pair planes of bf16(q * scale), plane p at out + p * stride: per plane a 16-bit
   shift puts nibble p of every 16-bit half at its bottom (half h of word i: input 8i + 4h + p), and the
   nibble, with the half's group in bits 4-5 (vpternlogd), indexes vpermt2w's table of the block's groups'
   bf16(q * scale). A group past K takes the last valid one's scale (its inputs are zero). */
TARGET_AVX512BF16 static inline void scaled_planes_bf16(__m512i words, const uint8_t *srow, int scale_dtype, int64_t g0,
                                                        int64_t groups, int64_t valid, __m512i group_bits,
                                                        uint16_t *out, int64_t stride) {
    __m512 s0 = scaled_q_bf16(row_scale(srow, scale_dtype, g0));
    __m512 s1 = groups > 1 ? scaled_q_bf16(row_scale(srow, scale_dtype, g0 + (valid > 1))) : s0;
    __m512i t01 = scaled_table_bf16(s0, s1), t23 = t01;
    if (groups > 2)
        t23 = scaled_table_bf16(scaled_q_bf16(row_scale(srow, scale_dtype, g0 + (valid > 2 ? 2 : valid - 1))),
                                scaled_q_bf16(row_scale(srow, scale_dtype, g0 + (valid > 3 ? 3 : valid - 1))));
    const __m512i nibble = _mm512_set1_epi16(15);
    for (int p = 0; p < 4; p++, out += stride) {
        __m512i shifted = p ? _mm512_srli_epi16(words, 4 * p) : words;
        __m512i idx = _mm512_ternarylogic_epi32(shifted, nibble, group_bits, 0xEA); /* (a & b) | c */
        _mm512_storeu_si512(out, _mm512_permutex2var_epi16(t01, idx, t23));
    }
}

/* Blocks b0..b0+nb of row n as pair planes of bf16(q * scale) into tile (4 vectors a block). */
TARGET_AVX512BF16 static void dequantize_bf16(const Job *job, int64_t n, int64_t b0, int64_t nb,
                                                     __m512i group_bits, __m512i *tile) {
    const int64_t words = job->K / 8, groups = 128 / job->group;
    const int32_t *wrow = job->packed + n * words;
    const uint8_t *srow = job->scale + n * job->num_groups * job->scale_size;
    for (int64_t b = b0; b < b0 + nb; b++, tile += 4) {
        const int64_t g0 = b * groups, valid = job->num_groups - g0 < groups ? job->num_groups - g0 : groups;

        scaled_planes_bf16(load_block_avx512(wrow, b, words), srow, job->scale_dtype, g0, groups, valid, group_bits,
                           (uint16_t *)tile, 32);
    }
}

/* acc[4i + r] += activation row i (of mb, at x + i * stride in pair planes) . tile row r, over nb blocks:
   per plane 4 weight and mb activation vectors loaded for 4 mb vdpbf16ps. */
TARGET_AVX512BF16 static inline __attribute__((always_inline)) void
tile_dot_bf16(const uint32_t *x, int64_t stride, int mb, const __m512i *tile, int64_t nb, __m512 *acc) {
    __m512 a[16];
    for (int i = 0; i < 4 * mb; i++)
        a[i] = acc[i];
    for (int64_t b = 0; b < nb; b++)
        for (int p = 0; p < 4; p++) {
            __m512bh w[4];
            for (int r = 0; r < 4; r++)
                w[r] = as_bf16_pairs(tile[r * BF_TILE + b * 4 + p]);
            for (int i = 0; i < mb; i++) {
                __m512bh xi = as_bf16_pairs(_mm512_loadu_si512(x + i * stride + b * 64 + p * 16));
                for (int r = 0; r < 4; r++)
                    a[4 * i + r] = _mm512_dpbf16_ps(a[4 * i + r], w[r], xi);
            }
        }
    for (int i = 0; i < 4 * mb; i++)
        acc[i] = a[i];
}

/* acc[4m + r] += activation row m0 + m (m < mb) . tile row r over blocks b0..b0+nb: rows in fours. */
TARGET_AVX512BF16 static inline __attribute__((always_inline)) void
tile_rows_bf16(const Job *job, int64_t m0, int64_t mb, int64_t b0, int64_t nb, const __m512i *tile, __m512 *acc) {
    const int64_t stride = job->xp_stride;
    const uint32_t *x = (const uint32_t *)job->xp + m0 * stride + b0 * 64;
    int64_t m = 0;
    for (; m + 4 <= mb; m += 4)
        tile_dot_bf16(x + m * stride, stride, 4, tile, nb, acc + m * 4);
    if (mb - m == 3)
        tile_dot_bf16(x + m * stride, stride, 3, tile, nb, acc + m * 4);
    else if (mb - m == 2)
        tile_dot_bf16(x + m * stride, stride, 2, tile, nb, acc + m * 4);
    else if (mb - m == 1)
        tile_dot_bf16(x + m * stride, stride, 1, tile, nb, acc + m * 4);
}

/* M >= 2 (bf16 activations on vdpbf16ps): y = x @ bf16(q * scale)^T with fp32 sums, compressed-tensors'
   bf16 weight as the amx path multiplies it. Per tile of 4 weight rows x GEMM_KC blocks the weight is
   decompressed once (dequantize_bf16: scaled_planes_bf16), then every activation row goes through it four
   at a time (tile_rows_bf16): 16 accumulators, 8 loads per 16 vdpbf16ps, no per-block scale multiply.
   gemm_bf16 is _linear_gemm.h's loop over them (ISA bf16: AVX-512's vector macros). */
#define GEMM_TILE __m512i
#define GEMM_TILE_VECS BF_TILE
#define GEMM_INDEX(job) group_bits_bf16(128 / (job)->group)
#include "_linear_gemm.h"
#undef GEMM_TILE
#undef GEMM_TILE_VECS
#undef GEMM_INDEX

#undef BF_TILE

/* One ISA's W4A16 kernels, included by _linear.c once per ISA with these macros defined:
     ISA (name suffix), TARGET (function attribute), L (fp32 lanes), VF / VI (float / int vectors) and the
     vector operations below (V_*).
   A block is L int32 words of one weight row (8 * L elements, word i in lane i); nibble plane j holds
   elements 8i + j. Activations are permuted once per call to match (see convert_row): per block, 8
   vectors of plane inputs, then a vector of 8 * (sum of each word's 8 inputs), which turns the
   stored nibble u = q + 8 into q without a per-element subtraction: sum(u x) - 8 sum(x) = sum(q x).

   gemv (M = 1): per row, per block: 8 planes (V_PLANE_GEMV: AVX2 and, convert, against inputs scaled
   by 16^-j; AVX-512: shift and a 16-entry table lookup) times their inputs, fp32 sums, times the lane's
   group scale; rows in fours; the weight stream prefetched ahead (prefetch_ahead).
   gemm (M >= 2, _linear_gemm.h's loop): per tile of 4 rows and GEMM_KC blocks, the weights are dequantized
   once (q * scale, fp32) into an L1 buffer, then every activation row (in pairs) is dotted with all 4 rows
   from it: 8 accumulators, 6 loads per 8 FMAs. */

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, ISA)
#define BW (L * 8)            /* weight elements per block */
#define BW_SHIFT (L == 16 ? 7 : 6)
#define BLOCK_FLOATS (BW + L) /* permuted activations per block */
#define TILE_VECS (GEMM_KC * 8) /* fp32 vectors per tile row (_linear_gemm.h) */

/* The per-lane group scales of block b of row `srow`. Groups and blocks are powers of two: shifts, no
   division, in this per-block path. In a tail block the lanes past K get any finite scale (their weights
   and activations are 0), or 0 where the block's groups end before the vector does. */
TARGET static inline VF FN(scale_vec)(const Job *job, const uint8_t *srow, int64_t b, VI idx) {
    const int gs = job->group_shift;
    if (gs >= BW_SHIFT) /* one group covers the block (a tail block starts inside K too) */
        return V_SET1(scale_at(job, srow, (b << BW_SHIFT) >> gs));
    const int per_block = 1 << (BW_SHIFT - gs); /* 2 or 4 groups in this block */
    const int64_t first = b * per_block, valid = job->num_groups - first;
    const uint8_t *p = srow + first * job->scale_size;
    __m128 s4;
    if (valid < per_block) { /* 1 to 3 groups; no loop, which the compiler would make a memcpy call */
        float s1 = valid > 1 ? scale_at(job, srow, first + 1) : 0.0f;
        float s2 = valid > 2 ? scale_at(job, srow, first + 2) : 0.0f;
        s4 = _mm_setr_ps(scale_at(job, srow, first), s1, s2, 0.0f);
    } else if (job->scale_dtype == DTYPE_F32) {
        s4 = per_block == 4 ? _mm_loadu_ps((const float *)p) : _mm_castpd_ps(_mm_load_sd((const double *)p));
    } else { /* fixed-size loads: a memcpy of a run-time size is a libc call per block */
        __m128i bits = per_block == 4 ? _mm_loadl_epi64((const __m128i *)p) : _mm_loadu_si32(p);
        s4 = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(bits), 16));
    }
    return V_EXPAND4(s4, idx);
}

/* sum_j plane_j(w) * x_j - 8 * sum(x), i.e. sum(q x) per lane, for one block (no scale). */
TARGET static inline VF FN(block_raw)(VI w, const float *xb, VF lut) {
    (void)lut;
    VF p0 = V_MUL(V_PLANE_GEMV(w, 0, lut), V_LOAD(xb));
    VF p1 = V_MUL(V_PLANE_GEMV(w, 1, lut), V_LOAD(xb + L));
    p0 = V_FMA(V_PLANE_GEMV(w, 2, lut), V_LOAD(xb + 2 * L), p0);
    p1 = V_FMA(V_PLANE_GEMV(w, 3, lut), V_LOAD(xb + 3 * L), p1);
    p0 = V_FMA(V_PLANE_GEMV(w, 4, lut), V_LOAD(xb + 4 * L), p0);
    p1 = V_FMA(V_PLANE_GEMV(w, 5, lut), V_LOAD(xb + 5 * L), p1);
    p0 = V_FMA(V_PLANE_GEMV(w, 6, lut), V_LOAD(xb + 6 * L), p0);
    p1 = V_FMA(V_PLANE_GEMV(w, 7, lut), V_LOAD(xb + 7 * L), p1);
    return V_SUB(V_ADD(p0, p1), V_LOAD(xb + 8 * L));
}

/* acc + scale * sum_j plane_j(w) * x_j, for one block. */
TARGET static inline VF FN(block_dot)(VI w, const float *xb, VF scale, VF acc, VF lut) {
    return V_FMA(FN(block_raw)(w, xb, lut), scale, acc);
}

TARGET static inline VI FN(load_block)(const int32_t *wrow, int64_t b, int64_t words) {
    int64_t first = b * L;
    return first + L <= words ? VI_LOADU(wrow + first) : VI_LOAD_FIRST(wrow + first, (int)(words - first));
}

TARGET static VI FN(expand_index)(int group) {
    int32_t idx[L];
    for (int i = 0; i < L; i++)
        idx[i] = group >= BW ? 0 : i * 8 / group;
    return VI_LOADU(idx);
}

/* Row n's per-lane sums over all its blocks. Groups of one or more whole blocks (group >= 8 * L: AVX2
   at 64 and 128, AVX-512 at 128) take their scale once per group, broadcast, after the group's blocks are
   summed; the rest (smaller groups, the tail block) a per-lane scale vector per block. */
TARGET static inline VF FN(row_dot)(const Job *job, int64_t n, VI idx, VF lut) {
    const int64_t words = job->K / 8, num_blocks = (words + L - 1) / L;
    const int blocks_per_group = job->group_shift >= BW_SHIFT ? 1 << (job->group_shift - BW_SHIFT) : 0;
    const int64_t whole_groups = blocks_per_group ? words / L / blocks_per_group : 0;
    const int32_t *wrow = job->packed + n * words;
    const uint8_t *srow = job->scale + n * job->num_groups * job->scale_size;
    VF acc = V_ZERO();
    int64_t b = 0;
    for (int64_t g = 0; g < whole_groups; g++) {
        prefetch_ahead(wrow + b * L);
        VF sum = FN(block_raw)(VI_LOADU(wrow + b * L), job->xp + b * BLOCK_FLOATS, lut);
        for (b++; b < (g + 1) * blocks_per_group; b++) {
            prefetch_ahead(wrow + b * L);
            sum = V_ADD(sum, FN(block_raw)(VI_LOADU(wrow + b * L), job->xp + b * BLOCK_FLOATS, lut));
        }
        acc = V_FMA(sum, V_SET1(scale_at(job, srow, g)), acc);
    }
    for (; b < num_blocks; b++) {
        prefetch_ahead(wrow + b * L);
        acc = FN(block_dot)(FN(load_block)(wrow, b, words), job->xp + b * BLOCK_FLOATS,
                            FN(scale_vec)(job, srow, b, idx), acc, lut);
    }
    return acc;
}

/* gemv rows in fours: the four horizontal sums share their shuffles. */
TARGET static void FN(gemv)(const Job *job, int64_t n0, int64_t n1) {
    const VI idx = FN(expand_index)(job->group);
    const VF lut = V_NIBBLE_LUT();
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        VF a0 = FN(row_dot)(job, n, idx, lut), a1 = FN(row_dot)(job, n + 1, idx, lut);
        VF a2 = FN(row_dot)(job, n + 2, idx, lut), a3 = FN(row_dot)(job, n + 3, idx, lut);
        store_y4(job, 0, n, V_HSUM4(a0, a1, a2, a3));
    }
    for (; n < n1; n++)
        store_y(job, 0, n, V_HSUM(FN(row_dot)(job, n, idx, lut)));
}

/* Dequantize blocks b0..b0+nb of row n (fp32 q * scale, the activations' plane order) into tile. */
TARGET static void FN(dequantize)(const Job *job, int64_t n, int64_t b0, int64_t nb, VI idx, VF *tile) {
    const int64_t words = job->K / 8;
    const int32_t *wrow = job->packed + n * words;
    const uint8_t *srow = job->scale + n * job->num_groups * job->scale_size;
    const VF eight = V_SET1(8.0f), lut = V_NIBBLE_LUT();
    (void)lut;
    for (int64_t b = 0; b < nb; b++) {
        VI w = FN(load_block)(wrow, b0 + b, words);
        VF scale = FN(scale_vec)(job, srow, b0 + b, idx), offset = V_MUL(scale, eight);
        VF *t = tile + b * 8;
        t[0] = V_FMSUB(V_PLANE(w, 0, lut), scale, offset);
        t[1] = V_FMSUB(V_PLANE(w, 1, lut), scale, offset);
        t[2] = V_FMSUB(V_PLANE(w, 2, lut), scale, offset);
        t[3] = V_FMSUB(V_PLANE(w, 3, lut), scale, offset);
        t[4] = V_FMSUB(V_PLANE(w, 4, lut), scale, offset);
        t[5] = V_FMSUB(V_PLANE(w, 5, lut), scale, offset);
        t[6] = V_FMSUB(V_PLANE(w, 6, lut), scale, offset);
        t[7] = V_FMSUB(V_PLANE(w, 7, lut), scale, offset);
    }
}

/* acc[r], acc[4 + r] += rows x0, x1 (permuted) . tile row r over nb blocks (x1 NULL: one row). */
TARGET static void FN(tile_dot)(const float *x0, const float *x1, const VF *tile, int64_t nb, VF *acc) {
    VF a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3];
    if (x1 == NULL) {
        for (int64_t b = 0; b < nb; b++)
            for (int j = 0; j < 8; j++) {
                VF xa = V_LOAD(x0 + b * BLOCK_FLOATS + j * L);
                const VF *t = tile + b * 8 + j;
                a0 = V_FMA(t[0], xa, a0);
                a1 = V_FMA(t[TILE_VECS], xa, a1);
                a2 = V_FMA(t[2 * TILE_VECS], xa, a2);
                a3 = V_FMA(t[3 * TILE_VECS], xa, a3);
            }
    } else {
        VF c0 = acc[4], c1 = acc[5], c2 = acc[6], c3 = acc[7];
        for (int64_t b = 0; b < nb; b++)
            for (int j = 0; j < 8; j++) {
                VF xa = V_LOAD(x0 + b * BLOCK_FLOATS + j * L), xb = V_LOAD(x1 + b * BLOCK_FLOATS + j * L);
                const VF *t = tile + b * 8 + j;
                VF w0 = t[0], w1 = t[TILE_VECS], w2 = t[2 * TILE_VECS], w3 = t[3 * TILE_VECS];
                a0 = V_FMA(w0, xa, a0);
                a1 = V_FMA(w1, xa, a1);
                a2 = V_FMA(w2, xa, a2);
                a3 = V_FMA(w3, xa, a3);
                c0 = V_FMA(w0, xb, c0);
                c1 = V_FMA(w1, xb, c1);
                c2 = V_FMA(w2, xb, c2);
                c3 = V_FMA(w3, xb, c3);
            }
        acc[4] = c0, acc[5] = c1, acc[6] = c2, acc[7] = c3;
    }
    acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3;
}

/* acc[4m + r] += activation row m0 + m (m < mb) . tile row r over blocks b0..b0+nb: rows in pairs. */
TARGET static inline __attribute__((always_inline)) void FN(tile_rows)(const Job *job, int64_t m0, int64_t mb,
                                                                       int64_t b0, int64_t nb, const VF *tile,
                                                                       VF *acc) {
    const float *x = job->xp + m0 * job->xp_stride + b0 * BLOCK_FLOATS;
    int64_t m = 0;
    for (; m + 1 < mb; m += 2)
        FN(tile_dot)(x + m * job->xp_stride, x + (m + 1) * job->xp_stride, tile, nb, acc + m * 4);
    if (m < mb)
        FN(tile_dot)(x + m * job->xp_stride, NULL, tile, nb, acc + m * 4);
}

#define GEMM_TILE VF
#define GEMM_TILE_VECS TILE_VECS
#define GEMM_INDEX(job) FN(expand_index)((job)->group)
#include "_linear_gemm.h"
#undef GEMM_TILE
#undef GEMM_TILE_VECS
#undef GEMM_INDEX

TARGET static void FN(run)(const Job *job, int64_t n0, int64_t n1) {
    if (job->M == 1)
        FN(gemv)(job, n0, n1);
    else
        FN(gemm)(job, n0, n1);
}

#undef BW
#undef BW_SHIFT
#undef BLOCK_FLOATS
#undef TILE_VECS

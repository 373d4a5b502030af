/* One ISA's W8A16 kernels, included by _linear.c once per ISA after _linear_simd.h, with its macros
   (ISA, TARGET, L, VF, V_*) plus V_LOAD_I8(p): L int8 weights as fp32 lanes, and V_LOAD_W16(p): L bf16
   weights as fp32 lanes (exact).

   gemv (M = 1): per row, a dot of its int8 weights with the fp32 activations in 4 accumulators, the
   scalar tail after the vector part, times the row's scale. gemm (M >= 2): per tile of 4 rows, the
   weights are converted to fp32 once into a buffer, then every activation row (in pairs) is dotted with
   all 4 rows from it: 8 accumulators, 6 loads per 8 FMAs. */

#define W8_FN(name) CAT(name, ISA)
#define W8_TILE_K 1024 /* inputs per fp32 tile: 4 rows x 4 KiB, in L1 */
#define W8_M_BLOCK 64  /* activation rows per pass over a tile */

/* sum_k w[k] * x[k] in fp32 over one weight row, int8 (is_bf16 0) or bf16 (1), each weight widened exactly:
   4 accumulators, then one, then the scalar tail. Inlined into w8_dot and w16_dot, where is_bf16 is a
   constant and the loads are one kind. */
TARGET static inline __attribute__((always_inline)) float W8_FN(dot_row)(const void *w, int is_bf16,
                                                                         const float *x, int64_t K) {
    const int8_t *w8 = (const int8_t *)w;
    const uint16_t *w16 = (const uint16_t *)w;
#define W8_LOAD(k) (is_bf16 ? V_LOAD_W16(w16 + (k)) : V_LOAD_I8(w8 + (k)))
    VF a0 = V_ZERO(), a1 = V_ZERO(), a2 = V_ZERO(), a3 = V_ZERO();
    int64_t k = 0;
    for (; k + 4 * L <= K; k += 4 * L) {
        /* as the W4A16 GEMVs (_linear.c): GEMV_PREFETCH_BYTES ahead of the bytes read */
        __builtin_prefetch((const char *)w + k * (is_bf16 ? 2 : 1) + GEMV_PREFETCH_BYTES, 0, 3);
        a0 = V_FMA(W8_LOAD(k), V_LOADU(x + k), a0);
        a1 = V_FMA(W8_LOAD(k + L), V_LOADU(x + k + L), a1);
        a2 = V_FMA(W8_LOAD(k + 2 * L), V_LOADU(x + k + 2 * L), a2);
        a3 = V_FMA(W8_LOAD(k + 3 * L), V_LOADU(x + k + 3 * L), a3);
    }
    for (; k + L <= K; k += L)
        a0 = V_FMA(W8_LOAD(k), V_LOADU(x + k), a0);
#undef W8_LOAD
    float sum = V_HSUM(V_ADD(V_ADD(a0, a1), V_ADD(a2, a3)));
    for (; k < K; k++)
        sum += (is_bf16 ? load_f32(w16, DTYPE_BF16, k) : (float)w8[k]) * x[k];
    return sum;
}

TARGET static float W8_FN(w8_dot)(const int8_t *w, const float *x, int64_t K) {
    return W8_FN(dot_row)(w, 0, x, K);
}

/* w8_dot for a bf16 weight row (gemv_dense). */
TARGET static float W8_FN(w16_dot)(const uint16_t *w, const float *x, int64_t K) {
    return W8_FN(dot_row)(w, 1, x, K);
}

/* out[r] += x0 . tile row r, out[4 + r] += x1 . tile row r (x1 NULL: one row), tile rows K floats apart. */
TARGET static void W8_FN(w8_tile_dot)(const float *x0, const float *x1, const float *tile, int64_t K,
                                      float *out) {
    const int64_t kv = K / L * L;
    VF a0 = V_ZERO(), a1 = V_ZERO(), a2 = V_ZERO(), a3 = V_ZERO();
    VF c0 = V_ZERO(), c1 = V_ZERO(), c2 = V_ZERO(), c3 = V_ZERO();
    for (int64_t k = 0; k < kv; k += L) {
        VF w0 = V_LOADU(tile + k), w1 = V_LOADU(tile + K + k), w2 = V_LOADU(tile + 2 * K + k),
           w3 = V_LOADU(tile + 3 * K + k), xa = V_LOADU(x0 + k);
        a0 = V_FMA(w0, xa, a0);
        a1 = V_FMA(w1, xa, a1);
        a2 = V_FMA(w2, xa, a2);
        a3 = V_FMA(w3, xa, a3);
        if (x1 != NULL) {
            VF xb = V_LOADU(x1 + k);
            c0 = V_FMA(w0, xb, c0);
            c1 = V_FMA(w1, xb, c1);
            c2 = V_FMA(w2, xb, c2);
            c3 = V_FMA(w3, xb, c3);
        }
    }
    VF sums[8] = {a0, a1, a2, a3, c0, c1, c2, c3};
    for (int i = 0; i < (x1 != NULL ? 8 : 4); i++) {
        const float *x = i < 4 ? x0 : x1, *t = tile + (i % 4) * K;
        float s = V_HSUM(sums[i]);
        for (int64_t k = kv; k < K; k++)
            s += t[k] * x[k];
        out[i] += s;
    }
}

/* Rows n0..n1 of y: gemv for one activation row, else tiles of 4 rows x W8_TILE_K inputs in fp32. */
TARGET static void W8_FN(w8_run)(const W8Job *job, int64_t n0, int64_t n1) {
    const int64_t K = job->K;
    if (job->w16 != NULL) { /* gemv_dense: one row */
        for (int64_t n = n0; n < n1; n++)
            w8_store(job, 0, n, W8_FN(w16_dot)(job->w16 + n * K, job->xp, K));
        return;
    }
    if (job->M == 1) {
        for (int64_t n = n0; n < n1; n++)
            w8_store(job, 0, n, W8_FN(w8_dot)(job->w + n * K, job->xp, K));
        return;
    }
    float tile[4 * W8_TILE_K], part[W8_M_BLOCK * 4];
    for (int64_t n = n0; n < n1; n += 4) {
        int rows = n1 - n < 4 ? (int)(n1 - n) : 4;
        for (int64_t m0 = 0; m0 < job->M; m0 += W8_M_BLOCK) {
            int64_t mb = job->M - m0 < W8_M_BLOCK ? job->M - m0 : W8_M_BLOCK;
            memset(part, 0, sizeof part);
            for (int64_t k0 = 0; k0 < K; k0 += W8_TILE_K) {
                int64_t kc = K - k0 < W8_TILE_K ? K - k0 : W8_TILE_K;
                for (int r = 0; r < 4; r++) {
                    const int8_t *w = job->w + (n + r) * K + k0;
                    for (int64_t k = 0; k < kc; k++)
                        tile[r * kc + k] = r < rows ? (float)w[k] : 0.0f;
                }
                for (int64_t m = 0; m < mb; m += 2) {
                    const float *x0 = job->xp + (m0 + m) * K + k0, *x1 = m + 1 < mb ? x0 + K : NULL;
                    W8_FN(w8_tile_dot)(x0, x1, tile, kc, part + m * 4);
                }
            }
            for (int64_t m = 0; m < mb; m++)
                for (int r = 0; r < rows; r++)
                    w8_store(job, m0 + m, n + r, part[m * 4 + r]);
        }
    }
}

#undef W8_FN
#undef W8_TILE_K
#undef W8_M_BLOCK

/* The decode attention's lane-typed helpers and its per-(sequence, KV head) body, included twice by
   _ops_attention.h: with 16 lanes in one GCC vector (LN(x) = x_z, LANES_WIDE 1: the AVX-512 level)
   and as two 8-lane ones (x_y, LANES_WIDE 0: the AVX2 level and the baseline; GCC keeps a 16-lane vector
   on the stack where the target has no 16-lane registers, ~5x slower). VT is the 16-lane type; V_ZERO,
   V_LOAD, V_SPLAT (a scalar in every lane), V_ADD and V_FMA (a * b + c, fused: one rounding) its
   operations. Both give the same bits: the same 16 partial sums of fused multiply-adds, combined in the
   same tree (halves, quarters, pairs, then lanes 0 and 1); the tails fuse theirs too (fmaf). */

/* Slots 0..n-1 of page `page`, head h (K or V), as fp32 into rows [n, D] (FP8: value * 2^-8, unscaled;
   page_factor says what to multiply by): one page lookup per page, not one division per token. */
ALWAYS_INLINE void LN(load_page_rows)(const Pages *p, int64_t page, int64_t n, int64_t h, int64_t D,
                                      float *restrict rows) {
    const int64_t base = page * p->page_stride + h * p->head_stride;
#ifdef KVQ_X86_LEVELS
    if (p->is_fp8 && p->level != LEVEL_BASE) {
        if (p->level == LEVEL_AVX512)
            e4m3_rows_avx512(p->base + base, n, p->slot_stride, D, rows);
        else
            e4m3_rows_f16c(p->base + base, n, p->slot_stride, D, rows);
        return;
    }
#endif
    for (int64_t j = 0; j < n; j++) {
        float *restrict row = rows + j * D;
        if (p->is_fp8) {
            const uint8_t *restrict src = p->base + base + j * p->slot_stride;
            for (int64_t d = 0; d < D; d++)
                row[d] = e4m3_f32(src[d]) * 0x1p-8f; /* exact, as the F16C path */
        } else {
            const uint16_t *restrict src = (const uint16_t *)p->base + base + j * p->slot_stride;
            int64_t d = 0;
#if LANES_WIDE && defined(KVQ_X86_LEVELS)
            d = bf16_row_avx512(src, D, row);
#elif LANES_WIDE
            for (; d + LANES16 <= D; d += LANES16) { /* explicit lanes: GCC's own loop went 8 at a time */
                v16h h;
                memcpy(&h, src + d, sizeof h);
                v16u u = __builtin_convertvector(h, v16u) << 16;
                memcpy(row + d, &u, sizeof u);
            }
#endif
            for (; d < D; d++)
                row[d] = bf16_f32(src[d]);
        }
    }
}

/* The 16 lanes' sum in a fixed tree: lane i + lane i + 8, then + 4, then + 2, then lanes 0 and 1. */
ALWAYS_INLINE float LN(tree)(VT part) {
#if LANES_WIDE
    part += SHUFFLE16(part, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    part += SHUFFLE16(part, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    part += SHUFFLE16(part, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return part[0] + part[1];
#else
    v8 s = part.lo + part.hi;
    s += SHUFFLE8(s, 4, 5, 6, 7, 0, 1, 2, 3);
    s += SHUFFLE8(s, 2, 3, 0, 1, 6, 7, 4, 5);
    return s[0] + s[1];
#endif
}

/* a . b over D: 16 partial sums, the tail's own sum, then the tree: one order at every level. */
ALWAYS_INLINE float LN(dot)(const float *restrict a, const float *restrict b, int64_t D) {
    VT part = V_ZERO;
    int64_t d = 0;
    for (; d + LANES16 <= D; d += LANES16)
        part = V_FMA(V_LOAD(a + d), V_LOAD(b + d), part);
    float tail = 0.0f;
    for (; d < D; d++)
        tail = __builtin_fmaf(a[d], b[d], tail);
    return LN(tree)(part) + tail;
}

/* s[r] = (a . rows[r]) * scale for the 4 rows [4, D]: each row's 16 partial sums as in dot (a loaded once
   for the four), each row's tree as dot's (the same additions). */
ALWAYS_INLINE void LN(dot4)(const float *restrict a, const float *restrict rows, int64_t D, float scale,
                            float *restrict s) {
    VT zero = V_ZERO, p0 = zero, p1 = zero, p2 = zero, p3 = zero;
    int64_t d = 0;
    for (; d + LANES16 <= D; d += LANES16) {
        VT x = V_LOAD(a + d);
        p0 = V_FMA(x, V_LOAD(rows + d), p0);
        p1 = V_FMA(x, V_LOAD(rows + D + d), p1);
        p2 = V_FMA(x, V_LOAD(rows + 2 * D + d), p2);
        p3 = V_FMA(x, V_LOAD(rows + 3 * D + d), p3);
    }
    float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (; d < D; d++)
        for (int r = 0; r < 4; r++)
            tail[r] = __builtin_fmaf(a[d], rows[r * D + d], tail[r]);
#if LANES_WIDE /* the four trees at once, transposing (halves, quarters, pairs): 8 shuffles where 4 take 12 */
    v16 t01 = SHUFFLE32(p0, p1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
              SHUFFLE32(p0, p1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    v16 t23 = SHUFFLE32(p2, p3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
              SHUFFLE32(p2, p3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    v16 u = SHUFFLE32(t01, t23, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            SHUFFLE32(t01, t23, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    u += SHUFFLE16(u, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    u += SHUFFLE16(u, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14); /* lanes 0, 8, 4, 12: rows 0-3 */
    s[0] = (u[0] + tail[0]) * scale, s[1] = (u[8] + tail[1]) * scale;
    s[2] = (u[4] + tail[2]) * scale, s[3] = (u[12] + tail[3]) * scale;
#else
    s[0] = (LN(tree)(p0) + tail[0]) * scale, s[1] = (LN(tree)(p1) + tail[1]) * scale;
    s[2] = (LN(tree)(p2) + tail[2]) * scale, s[3] = (LN(tree)(p3) + tail[3]) * scale;
#endif
}

/* In place over s[0..L): softmax, with the maximum and the sum in 16 lanes and the fixed tree (one order
   at every level and thread count). */
ALWAYS_INLINE void LN(softmax)(float *restrict s, int64_t L) {
    float top = s[0], sum = 0.0f;
    int64_t t = 0;
    if (L >= LANES16) { /* lane j keeps the first of its largest (a NaN never wins) */
        float top16[16];
#if LANES_WIDE
        v16 top_v = load16(s);
        for (t = LANES16; t + LANES16 <= L; t += LANES16) {
            v16 v = load16(s + t);
            v16i wins = v > top_v;
            top_v = (v16)((wins & (v16i)v) | (~wins & (v16i)top_v));
        }
        memcpy(top16, &top_v, sizeof top16);
#else
        memcpy(top16, s, sizeof top16);
        for (t = LANES16; t + LANES16 <= L; t += LANES16)
            for (int j = 0; j < LANES16; j++)
                top16[j] = s[t + j] > top16[j] ? s[t + j] : top16[j];
#endif
        for (int j = 0; j < LANES16; j++)
            top = top16[j] > top ? top16[j] : top;
    }
    for (; t < L; t++)
        top = s[t] > top ? s[t] : top;
    for (t = 0; t < L; t++)
        s[t] = exp_f32(s[t] - top);
    VT part = V_ZERO;
    for (t = 0; t + LANES16 <= L; t += LANES16)
        part = V_ADD(part, V_LOAD(s + t));
    for (; t < L; t++)
        sum += s[t];
    sum += LN(tree)(part);
    for (t = 0; t < L; t++)
        s[t] /= sum;
}

/* acc[0..D) += sum over j < n of p[j] * rows[j] (rows [n, D]), each element's sum in token order; 64
   elements of acc at a time stay in registers over the n rows (four independent chains of adds). */
ALWAYS_INLINE void LN(weighted_rows)(float *restrict acc, const float *restrict p, const float *restrict rows,
                                     int64_t n, int64_t D) {
    int64_t d = 0;
    for (; d + 4 * LANES16 <= D; d += 4 * LANES16) {
        VT v0 = V_LOAD(acc + d), v1 = V_LOAD(acc + d + 16), v2 = V_LOAD(acc + d + 32), v3 = V_LOAD(acc + d + 48);
        for (int64_t j = 0; j < n; j++) {
            const float *r = rows + j * D + d;
            v0 = V_FMA(V_SPLAT(p[j]), V_LOAD(r), v0);
            v1 = V_FMA(V_SPLAT(p[j]), V_LOAD(r + 16), v1);
            v2 = V_FMA(V_SPLAT(p[j]), V_LOAD(r + 32), v2);
            v3 = V_FMA(V_SPLAT(p[j]), V_LOAD(r + 48), v3);
        }
        memcpy(acc + d, &v0, sizeof v0);
        memcpy(acc + d + 16, &v1, sizeof v1);
        memcpy(acc + d + 32, &v2, sizeof v2);
        memcpy(acc + d + 48, &v3, sizeof v3);
    }
    for (; d + LANES16 <= D; d += LANES16) {
        VT v = V_LOAD(acc + d);
        for (int64_t j = 0; j < n; j++)
            v = V_FMA(V_SPLAT(p[j]), V_LOAD(rows + j * D + d), v);
        memcpy(acc + d, &v, sizeof v);
    }
    for (; d < D; d++)
        for (int64_t j = 0; j < n; j++)
            acc[d] = __builtin_fmaf(p[j], rows[j * D + d], acc[d]);
}

/* Sequence b, KV head h: its G query heads over the sequence's pages into out. `work` holds
   2 G D + G L + page_size D floats. */
ALWAYS_INLINE void LN(attend)(const Attention *a, int64_t b, int64_t h, float *work) {
    const int64_t G = a->Hq / a->Hkv, D = a->D, P = a->page_size, L = seq_len(a, b);
    const uint8_t *table_row = a->tables + b * a->bt_stride * (a->bt_int64 ? 8 : 4);
    uint16_t *o = a->out + (b * a->Hq + h * G) * D;
    if (L <= 0) { /* an empty sequence attends to nothing: zeros */
        memset(o, 0, (size_t)(G * D) * 2);
        return;
    }
    float *qs = work, *acc = qs + G * D, *scores = acc + G * D, *rows = scores + G * L; /* [G,D] [G,D] [G,L] [P,D] */
    const float k_factor = page_factor(&a->kp, a->scale[h]);
    const float v_factor = page_factor(&a->vp, a->scale[a->Hkv + h]);
    for (int64_t i = 0; i < G * D; i++) /* q . (rows * k_factor) as (q * k_factor) . rows: once per query */
        qs[i] = bf16_f32(a->q[b * a->q_row_stride + h * G * D + i]) * k_factor;
    for (int64_t t0 = 0; t0 < L; t0 += P) {
        int64_t i = t0 / P, n = L - t0 < P ? L - t0 : P;
        int64_t page = a->bt_int64 ? ((const int64_t *)table_row)[i] : ((const int32_t *)table_row)[i];
        LN(load_page_rows)(&a->kp, page, n, h, D, rows);
        for (int64_t g = 0; g < G; g++) {
            float *s = scores + g * L + t0;
            int64_t j = 0;
            for (; j + 4 <= n; j += 4)
                LN(dot4)(qs + g * D, rows + j * D, D, a->sm_scale, s + j);
            for (; j < n; j++)
                s[j] = LN(dot)(qs + g * D, rows + j * D, D) * a->sm_scale;
        }
    }
    for (int64_t g = 0; g < G; g++)
        LN(softmax)(scores + g * L, L);
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    for (int64_t t0 = 0; t0 < L; t0 += P) {
        int64_t i = t0 / P, n = L - t0 < P ? L - t0 : P;
        int64_t page = a->bt_int64 ? ((const int64_t *)table_row)[i] : ((const int32_t *)table_row)[i];
        LN(load_page_rows)(&a->vp, page, n, h, D, rows);
        for (int64_t g = 0; g < G; g++)
            LN(weighted_rows)(acc + g * D, scores + g * L + t0, rows, n, D);
    }
    for (int64_t i = 0; i < G * D; i++)
        o[i] = f32_bf16(acc[i] * v_factor);
}

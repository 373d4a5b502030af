/* decode_attention of kvq.runtime.kernels._cpu_ops (the contract is at the top of _cpu_ops.c): paged decode
   attention straight from bf16 or FP8 pages, over the (sequence, KV head) pairs, on the W4A16 kernel's
   thread pool where it is built. Included by _cpu_ops.c, after its bf16 helpers, exp_f32 and the
   KVQ_CLONES / ALWAYS_INLINE macros. */

/* float8_e4m3fn byte -> fp32, exactly, in arithmetic (a loop of these vectorizes; a 256-entry table read
   is a gather): normals move their exponent and mantissa bits into fp32's, subnormals are m * 2^-9,
   S.1111.111 is NaN (e4m3fn has no infinities). */
ALWAYS_INLINE float e4m3_f32(uint8_t byte) {
    uint32_t exponent = (byte >> 3) & 15u, mantissa = byte & 7u;
    uint32_t normal = ((exponent + 120u) << 23) | (mantissa << 20), subnormal;
    float sub = (float)mantissa * 0x1p-9f; /* both computed and chosen by masks: no branch in the loop */
    memcpy(&subnormal, &sub, 4);
    uint32_t is_normal = 0u - (uint32_t)(exponent != 0), is_nan = 0u - (uint32_t)((byte & 0x7Fu) == 0x7Fu);
    uint32_t u = (normal & is_normal) | (subnormal & ~is_normal);
    u = ((u & ~is_nan) | (0x7FC00000u & is_nan)) | (uint32_t)(byte & 0x80u) << 24;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define MAX_HEAD_DIM 512

/* Rows of e4m3fn bytes -> fp32 e4m3(b) * 2^-8, 16 bytes at a time with F16C: the byte's 7 exponent-mantissa
   bits placed in a binary16's low exponent and high mantissa bits ((b & 0x7F) << 7, sign to bit 15) make
   a binary16 of that value for normals and subnormals alike (e4m3fn's bias is 7, binary16's 15; binary16
   subnormals keep the same m * 2^-k form), which vcvtph2ps widens exactly (in hardware: no denormal fp32
   arithmetic). 0x7F / 0xFF (NaN) would read as +-480 * 2^-8: their halves become the quiet NaN 0x7E00
   with the sign, which widens to e4m3_f32's 0x7FC00000. ~10 instructions per 16 bytes where the
   arithmetic form takes ~30. The 2^8 and the page's scale go on the query (K) and the output (V), once:
   see attend. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVQ_HAS_F16C_PATH 1
__attribute__((target("avx2,f16c"))) static void e4m3_rows_f16c(const uint8_t *restrict src, int64_t n,
                                                                int64_t src_stride, int64_t D,
                                                                float *restrict rows) {
    const __m256i keep = _mm256_set1_epi16((short)0xBF80), nan_bits = _mm256_set1_epi16((short)0xFE00);
    const __m256i to_nan = _mm256_set1_epi16(0x4180); /* 0x3F80 ^ 0x4180 = 0x7E00 */
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *restrict s = src + j * src_stride;
        float *restrict row = rows + j * D;
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(s + d));
            __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);      /* b << 8 */
            __m256i h = _mm256_and_si256(_mm256_srai_epi16(w, 1), keep);       /* sign | (b & 0x7F) << 7 */
            __m256i nan = _mm256_cmpeq_epi16(_mm256_slli_epi16(w, 1), nan_bits); /* (b & 0x7F) == 0x7F */
            h = _mm256_xor_si256(h, _mm256_and_si256(nan, to_nan));
            _mm256_storeu_ps(row + d, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
            _mm256_storeu_ps(row + d + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
        }
        for (; d < D; d++)
            row[d] = e4m3_f32(s[d]) * 0x1p-8f;
    }
}

/* e4m3_rows_f16c 32 bytes at a time in AVX-512 registers, the NaN fix in a mask (the same values). */
__attribute__((target("avx512f,avx512bw"))) static void
e4m3_rows_avx512(const uint8_t *restrict src, int64_t n, int64_t src_stride, int64_t D, float *restrict rows) {
    const __m512i keep = _mm512_set1_epi16((short)0xBF80), nan_bits = _mm512_set1_epi16((short)0xFE00);
    const __m512i to_nan = _mm512_set1_epi16(0x4180);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *restrict s = src + j * src_stride;
        float *restrict row = rows + j * D;
        int64_t d = 0;
        for (; d + 32 <= D; d += 32) {
            __m256i bytes = _mm256_loadu_si256((const __m256i *)(s + d));
            __m512i w = _mm512_slli_epi16(_mm512_cvtepu8_epi16(bytes), 8);
            __m512i h = _mm512_and_si512(_mm512_srai_epi16(w, 1), keep);
            __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_slli_epi16(w, 1), nan_bits);
            h = _mm512_mask_mov_epi16(h, nan, _mm512_xor_si512(h, to_nan));
            _mm512_storeu_ps(row + d, _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
            _mm512_storeu_ps(row + d + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
        }
        for (; d < D; d++)
            row[d] = e4m3_f32(s[d]) * 0x1p-8f;
    }
}
#endif

enum { FP8_SCALAR, FP8_F16C, FP8_AVX512 };

typedef struct {
    const uint8_t *base;
    int64_t page_stride, slot_stride, head_stride; /* elements */
    int is_fp8, fp8_path; /* FP8_SCALAR, FP8_F16C or FP8_AVX512: how bytes become fp32 (the same values) */
} Pages;

/* Slots 0..n-1 of page `page`, head h (K or V), as fp32 into rows [n, D] (FP8: value * 2^-8, unscaled;
   page_factor says what to multiply by): one page lookup per page, not one division per token. */
ALWAYS_INLINE void load_page_rows(const Pages *p, int64_t page, int64_t n, int64_t h, int64_t D,
                                  float *restrict rows) {
    const int64_t base = page * p->page_stride + h * p->head_stride;
#ifdef KVQ_HAS_F16C_PATH
    if (p->is_fp8 && p->fp8_path != FP8_SCALAR) {
        if (p->fp8_path == FP8_AVX512)
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
            for (; d + LANES16 <= D; d += LANES16) { /* explicit lanes: GCC's own loop went 8 at a time */
                v16h h;
                memcpy(&h, src + d, sizeof h);
                v16u u = __builtin_convertvector(h, v16u) << 16;
                memcpy(row + d, &u, sizeof u);
            }
            for (; d < D; d++)
                row[d] = bf16_f32(src[d]);
        }
    }
}

/* a . b over D: 16 partial sums, the tail's own sum, then a fixed tree: one order on every clone. */
ALWAYS_INLINE float dot(const float *restrict a, const float *restrict b, int64_t D) {
    v16 part = {0};
    int64_t d = 0;
    for (; d + LANES16 <= D; d += LANES16)
        part = fma16(load16(a + d), load16(b + d), part);
    float tail = 0.0f;
    for (; d < D; d++)
        tail += a[d] * b[d];
    part += SHUFFLE16(part, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    part += SHUFFLE16(part, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    part += SHUFFLE16(part, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return (part[0] + part[1]) + tail;
}

/* s[r] = (a . rows[r]) * scale for the 4 rows [4, D]: each row's 16 partial sums as in dot (a loaded once
   for the four), then one tree that adds the four rows' lanes together (halves, quarters, pairs), so 4
   scores take 8 shuffles where dot's 4 would take 12 and 4 scalar steps. */
ALWAYS_INLINE void dot4(const float *restrict a, const float *restrict rows, int64_t D, float scale,
                        float *restrict s) {
    v16 p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
    int64_t d = 0;
    for (; d + LANES16 <= D; d += LANES16) {
        v16 x = load16(a + d);
        p0 = fma16(x, load16(rows + d), p0);
        p1 = fma16(x, load16(rows + D + d), p1);
        p2 = fma16(x, load16(rows + 2 * D + d), p2);
        p3 = fma16(x, load16(rows + 3 * D + d), p3);
    }
    v16 t01 = SHUFFLE32(p0, p1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
              SHUFFLE32(p0, p1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    v16 t23 = SHUFFLE32(p2, p3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
              SHUFFLE32(p2, p3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    v16 u = SHUFFLE32(t01, t23, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            SHUFFLE32(t01, t23, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    u += SHUFFLE16(u, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    u += SHUFFLE16(u, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14); /* lanes 0, 8, 4, 12: rows 0-3 */
    float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (; d < D; d++)
        for (int r = 0; r < 4; r++)
            tail[r] += a[d] * rows[r * D + d];
    s[0] = (u[0] + tail[0]) * scale, s[1] = (u[8] + tail[1]) * scale;
    s[2] = (u[4] + tail[2]) * scale, s[3] = (u[12] + tail[3]) * scale;
}

/* In place over s[0..L): softmax, with the maximum and the sum in 16 lanes and a fixed tree (one order on
   every clone and thread count). */
ALWAYS_INLINE void softmax(float *restrict s, int64_t L) {
    float top = s[0], sum = 0.0f;
    int64_t t = 0;
    if (L >= LANES16) {
        v16 top16 = load16(s);
        for (t = LANES16; t + LANES16 <= L; t += LANES16) {
            v16 v = load16(s + t);
            v16i wins = v > top16;
            top16 = (v16)((wins & (v16i)v) | (~wins & (v16i)top16));
        }
        for (int j = 0; j < LANES16; j++)
            top = top16[j] > top ? top16[j] : top;
    }
    for (; t < L; t++)
        top = s[t] > top ? s[t] : top;
    for (t = 0; t < L; t++)
        s[t] = exp_f32(s[t] - top);
    v16 part = {0};
    for (t = 0; t + LANES16 <= L; t += LANES16)
        part += load16(s + t);
    for (; t < L; t++)
        sum += s[t];
    part += SHUFFLE16(part, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    part += SHUFFLE16(part, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    part += SHUFFLE16(part, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    sum += part[0] + part[1];
    for (t = 0; t < L; t++)
        s[t] /= sum;
}

/* acc[0..D) += sum over j < n of p[j] * rows[j] (rows [n, D]), each element's sum in token order; 64
   elements of acc at a time stay in registers over the n rows (four independent chains of fused
   multiply-adds). */
ALWAYS_INLINE void weighted_rows(float *restrict acc, const float *restrict p, const float *restrict rows,
                                 int64_t n, int64_t D) {
    int64_t d = 0;
    for (; d + 4 * LANES16 <= D; d += 4 * LANES16) {
        v16 v0 = load16(acc + d), v1 = load16(acc + d + 16), v2 = load16(acc + d + 32), v3 = load16(acc + d + 48);
        for (int64_t j = 0; j < n; j++) {
            const float *r = rows + j * D + d;
            v16 pj = (v16){0} + p[j];
            v0 = fma16(pj, load16(r), v0);
            v1 = fma16(pj, load16(r + 16), v1);
            v2 = fma16(pj, load16(r + 32), v2);
            v3 = fma16(pj, load16(r + 48), v3);
        }
        memcpy(acc + d, &v0, sizeof v0);
        memcpy(acc + d + 16, &v1, sizeof v1);
        memcpy(acc + d + 32, &v2, sizeof v2);
        memcpy(acc + d + 48, &v3, sizeof v3);
    }
    for (; d + LANES16 <= D; d += LANES16) {
        v16 v = load16(acc + d);
        for (int64_t j = 0; j < n; j++)
            v = fma16((v16){0} + p[j], load16(rows + j * D + d), v);
        memcpy(acc + d, &v, sizeof v);
    }
    for (; d < D; d++)
        for (int64_t j = 0; j < n; j++)
            acc[d] += p[j] * rows[j * D + d];
}

/* What load_page_rows' rows of these pages are multiplied by to give K or V: 1 for bf16, the head's scale
   times 2^8 for FP8 (an exact power-of-two factor: where it is applied does not change a product's
   rounding). */
ALWAYS_INLINE float page_factor(const Pages *p, float scale) {
    return p->is_fp8 ? scale * 256.0f : 1.0f;
}

typedef struct {
    Pages kp, vp;
    const float *scale;   /* [2, Hkv]: K then V */
    const uint16_t *q;    /* [B, q_row_stride] */
    const uint8_t *tables; /* [B, bt_stride] int32 or int64 */
    const void *lens;     /* [B] int32 or int64 */
    uint16_t *out;        /* [B, Hq, D] */
    int64_t q_row_stride, bt_stride, B, Hq, Hkv, D, page_size;
    int bt_int64, sl_int64;
    float sm_scale;
    atomic_int out_of_memory;
} Attention;

static inline int64_t seq_len(const Attention *a, int64_t b) {
    return a->sl_int64 ? ((const int64_t *)a->lens)[b] : ((const int32_t *)a->lens)[b];
}

/* Sequence b, KV head h: its G query heads over the sequence's pages into out. `work` holds
   2 G D + G L + page_size D floats. */
KVQ_CLONES static void attend(const Attention *a, int64_t b, int64_t h, float *work) {
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
        load_page_rows(&a->kp, page, n, h, D, rows);
        for (int64_t g = 0; g < G; g++) {
            float *s = scores + g * L + t0;
            int64_t j = 0;
            for (; j + 4 <= n; j += 4)
                dot4(qs + g * D, rows + j * D, D, a->sm_scale, s + j);
            for (; j < n; j++)
                s[j] = dot(qs + g * D, rows + j * D, D) * a->sm_scale;
        }
    }
    for (int64_t g = 0; g < G; g++)
        softmax(scores + g * L, L);
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    for (int64_t t0 = 0; t0 < L; t0 += P) {
        int64_t i = t0 / P, n = L - t0 < P ? L - t0 : P;
        int64_t page = a->bt_int64 ? ((const int64_t *)table_row)[i] : ((const int32_t *)table_row)[i];
        load_page_rows(&a->vp, page, n, h, D, rows);
        for (int64_t g = 0; g < G; g++)
            weighted_rows(acc + g * D, scores + g * L + t0, rows, n, D);
    }
    for (int64_t i = 0; i < G * D; i++)
        o[i] = f32_bf16(acc[i] * v_factor);
}

/* Chunk `chunk` of `num_chunks` over the B * Hkv (sequence, KV head) items, on whichever thread takes it;
   each thread's scratch is its own, kept between calls. */
static void attention_task(void *ctx, int64_t chunk, int64_t num_chunks) {
    static _Thread_local float *work;
    static _Thread_local size_t work_floats;
    Attention *a = ctx;
    const int64_t items = a->B * a->Hkv, G = a->Hq / a->Hkv;
    for (int64_t item = items * chunk / num_chunks; item < items * (chunk + 1) / num_chunks; item++) {
        int64_t b = item / a->Hkv, L = seq_len(a, b);
        size_t need = (size_t)(2 * G * a->D + G * (L > 0 ? L : 0) + a->page_size * a->D);
        if (need > work_floats) {
            free(work);
            work = malloc(need * sizeof(float));
            work_floats = work ? need : 0;
            if (work == NULL) {
                atomic_store(&a->out_of_memory, 1);
                return;
            }
        }
        attend(a, b, item % a->Hkv, work);
    }
}

/* The fastest FP8 widening up to `wanted` (an FP8_* value) that this build and CPU run. */
static int fp8_path(int wanted) {
#ifdef KVQ_HAS_F16C_PATH
    if (wanted >= FP8_AVX512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        return FP8_AVX512;
    if (wanted >= FP8_F16C && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
        return FP8_F16C;
#endif
    (void)wanted;
    return FP8_SCALAR;
}

static PyObject *decode_attention(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long q, k, v, scales, tables, lens, out;
    int kv_fp8, bt_int64, sl_int64, threads, fp8_wanted;
    long long q_row_stride, ks0, ks1, ks2, vs0, vs1, vs2, bt_stride, B, Hq, Hkv, D, page_size;
    float sm_scale;
    if (!PyArg_ParseTuple(args, "KLKKi(LLL)(LLL)KKLiKiKLLLLLfii", &q, &q_row_stride, &k, &v, &kv_fp8, &ks0,
                          &ks1, &ks2, &vs0, &vs1, &vs2, &scales, &tables, &bt_stride, &bt_int64, &lens,
                          &sl_int64, &out, &B, &Hq, &Hkv, &D, &page_size, &sm_scale, &threads, &fp8_wanted))
        return NULL;
    if (B < 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || D > MAX_HEAD_DIM || page_size <= 0 || q_row_stride < Hq * D)
        return PyErr_Format(PyExc_ValueError,
                            "bad shape B=%lld Hq=%lld Hkv=%lld D=%lld page_size=%lld q_row_stride=%lld", B, Hq,
                            Hkv, D, page_size, q_row_stride);
    Attention a = {
        .kp = {(const uint8_t *)(uintptr_t)k, ks0, ks1, ks2, kv_fp8, fp8_path(fp8_wanted)},
        .vp = {(const uint8_t *)(uintptr_t)v, vs0, vs1, vs2, kv_fp8, fp8_path(fp8_wanted)},
        .scale = (const float *)(uintptr_t)scales,
        .q = (const uint16_t *)(uintptr_t)q,
        .tables = (const uint8_t *)(uintptr_t)tables,
        .lens = (const void *)(uintptr_t)lens,
        .out = (uint16_t *)(uintptr_t)out,
        .q_row_stride = q_row_stride, .bt_stride = bt_stride, .B = B, .Hq = Hq, .Hkv = Hkv, .D = D,
        .page_size = page_size, .bt_int64 = bt_int64, .sl_int64 = sl_int64, .sm_scale = sm_scale,
    };
    Py_BEGIN_ALLOW_THREADS;
    run_chunks(attention_task, &a, B * Hkv, threads); /* lengths differ: chunks taken by free threads */
    Py_END_ALLOW_THREADS;
    if (atomic_load(&a.out_of_memory))
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

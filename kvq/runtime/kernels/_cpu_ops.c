/* kvq.runtime.kernels._cpu_ops: the small bf16 ops of a CPU decode step, one C call each instead of the
   5-10 eager torch ops (each ~1.5 us of dispatch and a temporary) they take in PyTorch.

   rms_norm(x, residual, residual_out, weight, out, M, H, eps): for each of M rows of H bf16 values,
     s = x (+ residual, rounded to bf16 and written to residual_out when residual != 0), then
     out = bf16(fp32(s) * rsqrt(mean(fp32(s)^2) + eps) * fp32(weight)): torch's F.rms_norm on bf16 (fp32
     inside, rounded once), and torch's bf16 `x + residual`.
   silu_mul(gate_up, out, M, I): gate_up [M, 2I] (gate then up), out [M, I] =
     bf16(bf16(silu(gate)) * up), as torch's `F.silu(gate) * up` on bf16 rounds (silu in fp32, rounded,
     then the product rounded).
   rotary(x, row_stride, T, H, D, R, cos, sin_signed, out): rotate-half rotary on the first R channels of
     each of H heads of T tokens (x rows `row_stride` apart, heads packed), cos/sin_signed [T, R]:
     out [T, H, D] = bf16(bf16(x * cos) + rotate_half(x) * sin_signed), the rest copied (torch's addcmul
     of `kvq.runtime.layers.rotary` on bf16: the products of bf16 values are exact in fp32).
   store_kv(k, k_row_stride, v, v_row_stride, T, Hkv, D, k_cache, k_strides, v_cache, v_strides, kv_fp8,
            scales, slots, slots_int64, page_size): the step's bf16 K/V rows (heads packed) into their
     page slots (negative slots skipped); FP8 pages get clamp(x / scale, +-448) rounded to nearest even
     e4m3fn, as `kv_cache_layout.quantize_kv` does in torch.
   decode_attention(q, q_row_stride, k, v, kv_fp8, k_strides, v_strides, scales, block_tables, bt_stride,
                    bt_int64, seq_lens, sl_int64, out, B, Hq, Hkv, D, page_size, sm_scale, threads):
     paged decode attention (kvq/runtime/kernels/paged_attention.py's contract) straight from the pages:
     bf16 or float8_e4m3fn K/V (bytes to fp32 in arithmetic, times the fp32 per-head scale, no bf16
     copy of the pages), fp32 scores, softmax and sums, out bf16 [B, Hq, D]. q's rows are q_row_stride
     elements apart (heads packed: a split of the rotary's [B, Hq + Hkv, D] output at B > 1); k/v strides
     are (page, slot, head) in elements (innermost 1); scales fp32 [2, Hkv] (K then V). The (sequence, KV
     head) pairs go over `threads` threads of _w4a16_cpu's pool (its `_parallel_for` capsule), without
     the GIL; each pair's sums are in one order whatever the thread count.
   Arguments are addresses (torch data_ptr) of bf16 tensors (contiguous unless strides are given); the
   caller checks shapes, dtypes and contiguity (kvq/runtime/kernels/cpu_ops.py). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Helpers of the cloned functions: inlined, so that they take each clone's instructions. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The attention's and silu_mul's loops built for AVX-512 and AVX2 too, picked at load by the CPU (glibc
   ifunc). Their fp32 sums keep one order (explicit lanes, no contraction), so every clone gives the same
   bits. */
#if defined(__x86_64__) && defined(__GLIBC__) && (defined(__GNUC__) || defined(__clang__))
#define KVQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVQ_CLONES
#endif

static inline float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_bf16(float f) { /* round to nearest even, NaN kept quiet */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* e^x in fp32 within 1.3 ulp (every 64th fp32 in range checked against expl), in arithmetic, so that loops of it vectorize (libm's expf is a call per
   element): x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), e^r by its degree-7 Taylor polynomial (the
   remainder is under 2^-27), times 2^n built in the exponent bits. x < -87.3 (e^x below fp32's smallest
   normal) gives 0, x > 88.3 gives inf, NaN stays NaN. */
ALWAYS_INLINE float exp_f32(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, kept in the low bits */
    float xc = x < -87.3f ? -87.3f : x > 88.3f ? 88.3f : x;
    float t = xc * 1.44269504f + magic, n = t - magic;
    float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-6f; /* ln 2 in two parts */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits;
    memcpy(&bits, &t, 4);
    uint32_t two_n = (uint32_t)(bits - 0x4B400000 + 127) << 23; /* n in -126..127 */
    float scale;
    memcpy(&scale, &two_n, 4);
    float y = p * scale;
    y = x < -87.3f ? 0.0f : y;
    y = x > 88.3f ? INFINITY : y;
    return x != x ? x : y;
}

#define LANES 16 /* independent partial sums: the loop vectorizes without reassociation flags */

static void rms_norm_row(const uint16_t *x, const uint16_t *res, uint16_t *res_out, const uint16_t *w,
                         uint16_t *out, int64_t H, float eps, float *s) {
    for (int64_t i = 0; i < H; i++)
        s[i] = res ? bf16_f32(f32_bf16(bf16_f32(x[i]) + bf16_f32(res[i]))) : bf16_f32(x[i]);
    if (res)
        for (int64_t i = 0; i < H; i++)
            res_out[i] = f32_bf16(s[i]);
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= H; i += LANES)
        for (int j = 0; j < LANES; j++)
            part[j] += s[i + j] * s[i + j];
    for (; i < H; i++)
        part[0] += s[i] * s[i];
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++)
        sum += part[j];
    float r = 1.0f / sqrtf(sum / (float)H + eps);
    for (int64_t k = 0; k < H; k++)
        out[k] = f32_bf16(s[k] * r * bf16_f32(w[k]));
}

static PyObject *rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, res, res_out, w, out;
    long long M, H;
    float eps;
    if (!PyArg_ParseTuple(args, "KKKKKLLf", &x, &res, &res_out, &w, &out, &M, &H, &eps))
        return NULL;
    if (M < 0 || H <= 0 || H > (1 << 20))
        return PyErr_Format(PyExc_ValueError, "bad shape M=%lld H=%lld", M, H);
    float *s = PyMem_RawMalloc((size_t)H * sizeof(float));
    if (s == NULL)
        return PyErr_NoMemory();
    for (long long m = 0; m < M; m++) {
        int64_t o = m * H;
        rms_norm_row((const uint16_t *)(uintptr_t)x + o, res ? (const uint16_t *)(uintptr_t)res + o : NULL,
                     res ? (uint16_t *)(uintptr_t)res_out + o : NULL, (const uint16_t *)(uintptr_t)w,
                     (uint16_t *)(uintptr_t)out + o, H, eps, s);
    }
    PyMem_RawFree(s);
    Py_RETURN_NONE;
}

KVQ_CLONES static PyObject *silu_mul(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long gate_up, out;
    long long M, I;
    if (!PyArg_ParseTuple(args, "KKLL", &gate_up, &out, &M, &I))
        return NULL;
    if (M < 0 || I <= 0)
        return PyErr_Format(PyExc_ValueError, "bad shape M=%lld I=%lld", M, I);
    for (long long m = 0; m < M; m++) {
        const uint16_t *g = (const uint16_t *)(uintptr_t)gate_up + m * 2 * I, *u = g + I;
        uint16_t *o = (uint16_t *)(uintptr_t)out + m * I;
        for (long long i = 0; i < I; i++) {
            float a = bf16_f32(g[i]);
            o[i] = f32_bf16(bf16_f32(f32_bf16(a / (1.0f + exp_f32(-a)))) * bf16_f32(u[i]));
        }
    }
    Py_RETURN_NONE;
}

static PyObject *rotary(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, cos, sin, out;
    long long row_stride, T, H, D, R;
    if (!PyArg_ParseTuple(args, "KLLLLLKKK", &x, &row_stride, &T, &H, &D, &R, &cos, &sin, &out))
        return NULL;
    if (T < 0 || H <= 0 || D <= 0 || R <= 0 || R > D || R % 2 || row_stride < H * D)
        return PyErr_Format(PyExc_ValueError, "bad shape T=%lld H=%lld D=%lld R=%lld stride=%lld", T, H, D, R,
                            row_stride);
    const int64_t half = R / 2;
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = (const uint16_t *)(uintptr_t)cos + t * R, *s = (const uint16_t *)(uintptr_t)sin + t * R;
        for (int64_t h = 0; h < H; h++) {
            const uint16_t *xi = (const uint16_t *)(uintptr_t)x + t * row_stride + h * D;
            uint16_t *o = (uint16_t *)(uintptr_t)out + (t * H + h) * D;
            for (int64_t i = 0; i < R; i++) {
                float partner = bf16_f32(xi[i < half ? i + half : i - half]);
                float first = bf16_f32(f32_bf16(bf16_f32(xi[i]) * bf16_f32(c[i])));
                o[i] = f32_bf16(first + partner * bf16_f32(s[i]));
            }
            memcpy(o + R, xi + R, (size_t)(D - R) * 2);
        }
    }
    Py_RETURN_NONE;
}

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

#define FP8_MAX 448.0f

/* fp32 -> float8_e4m3fn, round to nearest even; |f| <= 448 after the caller's clamp, NaN kept. */
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u)
        return sign | 0x7F;
    if (u < 0x3C800000u) { /* below 2^-6, the smallest normal: multiples of 2^-9 */
        float a;
        memcpy(&a, &u, 4);
        return sign | (uint8_t)nearbyintf(a * 512.0f); /* 8 (the rounding up to 2^-6) encodes it too */
    }
    u += 0x7FFFFu + ((u >> 20) & 1u); /* round the mantissa to 3 bits */
    uint32_t exponent = (u >> 23) - 120, mantissa = (u >> 20) & 7u;
    return sign | (uint8_t)((exponent << 3) | mantissa);
}

typedef struct {
    const uint8_t *base;
    int64_t page_stride, slot_stride, head_stride; /* elements */
    int is_fp8;
} Pages;

/* Slots 0..n-1 of page `page`, head h (K or V), as fp32 into rows [n, D]: one page lookup per page, not
   one division per token. */
ALWAYS_INLINE void load_page_rows(const Pages *p, int64_t page, int64_t n, int64_t h, int64_t D, float scale,
                                  float *restrict rows) {
    const int64_t base = page * p->page_stride + h * p->head_stride;
    for (int64_t j = 0; j < n; j++) {
        float *restrict row = rows + j * D;
        if (p->is_fp8) {
            const uint8_t *restrict src = p->base + base + j * p->slot_stride;
            for (int64_t d = 0; d < D; d++)
                row[d] = e4m3_f32(src[d]) * scale;
        } else {
            const uint16_t *restrict src = (const uint16_t *)p->base + base + j * p->slot_stride;
            for (int64_t d = 0; d < D; d++)
                row[d] = bf16_f32(src[d]);
        }
    }
}

/* 16 fp32 lanes as a GCC vector: one AVX-512 register, two AVX2 ones, four SSE2 ones on each clone, with
   the same sums in the same order (no contraction: -ffp-contract=off). */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define LANES16 16
#if defined(__clang__)
#define SHUFFLE16(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE16(v, ...) __builtin_shuffle(v, (v16i){__VA_ARGS__})
#endif

ALWAYS_INLINE v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* a . b over D: 16 partial sums, the tail's own sum, then a fixed tree: one order on every clone. */
ALWAYS_INLINE float dot(const float *restrict a, const float *restrict b, int64_t D) {
    v16 part = {0};
    int64_t d = 0;
    for (; d + LANES16 <= D; d += LANES16)
        part += load16(a + d) * load16(b + d);
    float tail = 0.0f;
    for (; d < D; d++)
        tail += a[d] * b[d];
    part += SHUFFLE16(part, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    part += SHUFFLE16(part, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    part += SHUFFLE16(part, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return (part[0] + part[1]) + tail;
}

/* acc[0..D) += sum over j < n of p[j] * rows[j] (rows [n, D]), each element's sum in token order; 64
   elements of acc at a time stay in registers over the n rows (four independent chains of adds). */
ALWAYS_INLINE void weighted_rows(float *restrict acc, const float *restrict p, const float *restrict rows,
                                 int64_t n, int64_t D) {
    int64_t d = 0;
    for (; d + 4 * LANES16 <= D; d += 4 * LANES16) {
        v16 v0 = load16(acc + d), v1 = load16(acc + d + 16), v2 = load16(acc + d + 32), v3 = load16(acc + d + 48);
        for (int64_t j = 0; j < n; j++) {
            const float *r = rows + j * D + d;
            v0 += p[j] * load16(r);
            v1 += p[j] * load16(r + 16);
            v2 += p[j] * load16(r + 32);
            v3 += p[j] * load16(r + 48);
        }
        memcpy(acc + d, &v0, sizeof v0);
        memcpy(acc + d + 16, &v1, sizeof v1);
        memcpy(acc + d + 32, &v2, sizeof v2);
        memcpy(acc + d + 48, &v3, sizeof v3);
    }
    for (; d + LANES16 <= D; d += LANES16) {
        v16 v = load16(acc + d);
        for (int64_t j = 0; j < n; j++)
            v += p[j] * load16(rows + j * D + d);
        memcpy(acc + d, &v, sizeof v);
    }
    for (; d < D; d++)
        for (int64_t j = 0; j < n; j++)
            acc[d] += p[j] * rows[j * D + d];
}

static PyObject *store_kv(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long k, v, kc, vc, scales, slots;
    long long k_row, v_row, T, Hkv, D, ks0, ks1, ks2, vs0, vs1, vs2, page_size;
    int kv_fp8, slots_int64;
    if (!PyArg_ParseTuple(args, "KLKLLLLK(LLL)K(LLL)iKKiL", &k, &k_row, &v, &v_row, &T, &Hkv, &D, &kc, &ks0,
                          &ks1, &ks2, &vc, &vs0, &vs1, &vs2, &kv_fp8, &scales, &slots, &slots_int64,
                          &page_size))
        return NULL;
    if (T < 0 || Hkv <= 0 || D <= 0 || page_size <= 0)
        return PyErr_Format(PyExc_ValueError, "bad shape T=%lld Hkv=%lld D=%lld", T, Hkv, D);
    const float *scale = (const float *)(uintptr_t)scales;
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slots_int64 ? ((const int64_t *)(uintptr_t)slots)[t] : ((const int32_t *)(uintptr_t)slots)[t];
        if (slot < 0)
            continue;
        int64_t page = slot / page_size, offset = slot % page_size;
        for (int half = 0; half < 2; half++) {
            const uint16_t *src = (const uint16_t *)(uintptr_t)(half ? v : k) + t * (half ? v_row : k_row);
            int64_t base = half ? page * vs0 + offset * vs1 : page * ks0 + offset * ks1, hs = half ? vs2 : ks2;
            for (int64_t h = 0; h < Hkv; h++) {
                if (!kv_fp8) {
                    memcpy((uint16_t *)(uintptr_t)(half ? vc : kc) + base + h * hs, src + h * D, (size_t)D * 2);
                    continue;
                }
                uint8_t *dst = (uint8_t *)(uintptr_t)(half ? vc : kc) + base + h * hs;
                float sc = scale[half * Hkv + h];
                for (int64_t d = 0; d < D; d++) {
                    float q = bf16_f32(src[h * D + d]) / sc;
                    q = q > FP8_MAX ? FP8_MAX : q < -FP8_MAX ? -FP8_MAX : q; /* NaN passes: torch's clamp */
                    dst[d] = f32_to_e4m3(q);
                }
            }
        }
    }
    Py_RETURN_NONE;
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
    for (int64_t i = 0; i < G * D; i++)
        qs[i] = bf16_f32(a->q[b * a->q_row_stride + h * G * D + i]);
    for (int64_t t0 = 0; t0 < L; t0 += P) {
        int64_t i = t0 / P, n = L - t0 < P ? L - t0 : P;
        int64_t page = a->bt_int64 ? ((const int64_t *)table_row)[i] : ((const int32_t *)table_row)[i];
        load_page_rows(&a->kp, page, n, h, D, a->scale[h], rows);
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < n; j++)
                scores[g * L + t0 + j] = dot(qs + g * D, rows + j * D, D) * a->sm_scale;
    }
    for (int64_t g = 0; g < G; g++) { /* softmax in place */
        float *s = scores + g * L, top = s[0], sum = 0.0f;
        for (int64_t t = 1; t < L; t++)
            top = s[t] > top ? s[t] : top;
        for (int64_t t = 0; t < L; t++)
            s[t] = exp_f32(s[t] - top);
        for (int64_t t = 0; t < L; t++)
            sum += s[t];
        for (int64_t t = 0; t < L; t++)
            s[t] /= sum;
    }
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    for (int64_t t0 = 0; t0 < L; t0 += P) {
        int64_t i = t0 / P, n = L - t0 < P ? L - t0 : P;
        int64_t page = a->bt_int64 ? ((const int64_t *)table_row)[i] : ((const int32_t *)table_row)[i];
        load_page_rows(&a->vp, page, n, h, D, a->scale[a->Hkv + h], rows);
        for (int64_t g = 0; g < G; g++)
            weighted_rows(acc + g * D, scores + g * L + t0, rows, n, D);
    }
    for (int64_t i = 0; i < G * D; i++)
        o[i] = f32_bf16(acc[i]);
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

/* The W4A16 extension's thread pool (its `_parallel_for` capsule), or NULL: then the calling thread alone. */
typedef void (*task_fn)(void *ctx, int64_t chunk, int64_t num_chunks);
typedef void (*parallel_for_fn)(task_fn fn, void *ctx, int64_t num_chunks, int nt);
static parallel_for_fn kvq_parallel_for;

#define CHUNKS_PER_THREAD 4 /* items go in chunks, taken by whichever thread is free: lengths differ */

static PyObject *decode_attention(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long q, k, v, scales, tables, lens, out;
    int kv_fp8, bt_int64, sl_int64, threads;
    long long q_row_stride, ks0, ks1, ks2, vs0, vs1, vs2, bt_stride, B, Hq, Hkv, D, page_size;
    float sm_scale;
    if (!PyArg_ParseTuple(args, "KLKKi(LLL)(LLL)KKLiKiKLLLLLfi", &q, &q_row_stride, &k, &v, &kv_fp8, &ks0,
                          &ks1, &ks2, &vs0, &vs1, &vs2, &scales, &tables, &bt_stride, &bt_int64, &lens,
                          &sl_int64, &out, &B, &Hq, &Hkv, &D, &page_size, &sm_scale, &threads))
        return NULL;
    if (B < 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || D > MAX_HEAD_DIM || page_size <= 0 || q_row_stride < Hq * D)
        return PyErr_Format(PyExc_ValueError,
                            "bad shape B=%lld Hq=%lld Hkv=%lld D=%lld page_size=%lld q_row_stride=%lld", B, Hq,
                            Hkv, D, page_size, q_row_stride);
    Attention a = {
        .kp = {(const uint8_t *)(uintptr_t)k, ks0, ks1, ks2, kv_fp8},
        .vp = {(const uint8_t *)(uintptr_t)v, vs0, vs1, vs2, kv_fp8},
        .scale = (const float *)(uintptr_t)scales,
        .q = (const uint16_t *)(uintptr_t)q,
        .tables = (const uint8_t *)(uintptr_t)tables,
        .lens = (const void *)(uintptr_t)lens,
        .out = (uint16_t *)(uintptr_t)out,
        .q_row_stride = q_row_stride, .bt_stride = bt_stride, .B = B, .Hq = Hq, .Hkv = Hkv, .D = D,
        .page_size = page_size, .bt_int64 = bt_int64, .sl_int64 = sl_int64, .sm_scale = sm_scale,
    };
    const int64_t items = B * Hkv;
    int nt = threads < 1 ? 1 : threads;
    int64_t chunks = (int64_t)nt * CHUNKS_PER_THREAD < items ? (int64_t)nt * CHUNKS_PER_THREAD : items;
    Py_BEGIN_ALLOW_THREADS;
    if (kvq_parallel_for != NULL && nt > 1 && chunks > 1)
        kvq_parallel_for(attention_task, &a, chunks, nt);
    else if (items > 0)
        attention_task(&a, 0, 1);
    Py_END_ALLOW_THREADS;
    if (atomic_load(&a.out_of_memory))
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS, "bf16 RMSNorm rows, optionally after a residual add (see source)."},
    {"silu_mul", silu_mul, METH_VARARGS, "bf16 silu(gate) * up over [M, 2I] rows (see the module source)."},
    {"rotary", rotary, METH_VARARGS, "bf16 rotate-half rotary embedding (see the module source)."},
    {"store_kv", store_kv, METH_VARARGS, "The step's K/V rows into their bf16 or FP8 page slots."},
    {"decode_attention", decode_attention, METH_VARARGS, "Paged decode attention over bf16/FP8 pages."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_cpu_ops", .m_doc = "The small bf16 ops of a CPU decode step (see the source).",
    .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__cpu_ops(void) {
    kvq_parallel_for = (parallel_for_fn)PyCapsule_Import("kvq.runtime.kernels._w4a16_cpu._parallel_for", 0);
    if (kvq_parallel_for == NULL)
        PyErr_Clear(); /* that extension is not built: one thread */
    return PyModule_Create(&module);
}

/* kvq.runtime.kernels.cpu._ops: the small bf16 ops of a CPU decode step, one C call each instead of the
   5-10 eager torch ops (each ~1.5 us of dispatch and a temporary) they take in PyTorch.

   rms_norm(x, residual, residual_out, weight, out, M, H, eps, threads, level): for each of M rows of H bf16
     values, s = x (+ residual, rounded to bf16 and written to residual_out when residual != 0), then
     out = bf16(fp32(s) * rsqrt(mean(fp32(s)^2) + eps) * fp32(weight)): torch's F.rms_norm on bf16 (fp32
     inside, rounded once), and torch's bf16 `x + residual`.
   silu_mul(gate_up, out, M, I, threads, level): gate_up [M, 2I] (gate then up), out [M, I] =
     bf16(bf16(silu(gate)) * up), as torch's `F.silu(gate) * up` on bf16 rounds (silu in fp32, rounded,
     then the product rounded).
   rotary(x, row_stride, T, H, D, R, cos, sin_signed, out, level): rotate-half rotary on the first R channels of
     each of H heads of T tokens (x rows `row_stride` apart, heads packed), cos/sin_signed [T, R]:
     out [T, H, D] = bf16(bf16(x * cos) + rotate_half(x) * sin_signed), the rest copied (torch's addcmul
     of `kvq.runtime.layers.rotary` on bf16: the products of bf16 values are exact in fp32).
   store_kv(k, k_row_stride, v, v_row_stride, T, Hkv, D, k_cache, k_strides, v_cache, v_strides, kv_fp8,
            scales, slots, slots_int64, page_size, level, stamps, stamp_stride, stamp_values): the step's bf16
     K/V rows (heads packed) into their page slots (negative slots skipped); FP8 pages get clamp(x / scale,
     +-448) rounded to nearest even e4m3fn, as `kv_cache_layout.quantize_kv` does in torch. With stamps
     (not 0: the layer's int64 slot stamps, slot s at stamps[s * stamp_stride]) each written slot also
     gets stamp_values[t] (the checked pool's stamp, `_ops_stamps.h`).
   decode_attention(q, q_row_stride, k, v, kv_fp8, k_strides, v_strides, scales, block_tables, bt_stride,
                    bt_int64, seq_lens, sl_int64, out, B, Hq, Hkv, D, page_size, sm_scale, threads, level):
     paged decode attention (kvq/runtime/kernels/paged/attention.py's contract) straight from the pages:
     bf16 or float8_e4m3fn K/V (FP8 bytes to fp32 exactly, no bf16 copy of the pages: in AVX-512 BW
     registers at level 2, F16C ones at level 1, in arithmetic at level 0, the same bits; the
     fp32 per-head scales applied on the query and the output), fp32 scores, softmax and sums, out bf16
     [B, Hq, D]. q's rows are q_row_stride elements apart (heads packed: a split of the rotary's
     [B, Hq + Hkv, D] output at B > 1); k/v strides are (page, slot, head) in elements (innermost 1);
     scales fp32 [2, Hkv] (K then V). The (sequence, KV
     head) pairs go over `threads` threads of _w4a16_cpu's pool (its `_parallel_for` capsule), without
     the GIL; each pair's sums are in one order whatever the thread count.
   argmax(x, M, V, is_bf16, out, is_finite, threads, level): out int64 [M] = torch.argmax(x, dim=-1) for fp32
     or bf16 x [M, V] (the first index of each row's maximum, or of its first NaN) and is_finite bool [M]
     (no NaN or +-inf in the row), in one pass over x.
   decode_attention runs without the GIL, and so do rms_norm, silu_mul and argmax from 8,192 elements,
   where their rows go over `threads` threads of that pool.
   `level` is the highest vector level to run (0 the build's baseline, 1 AVX2 + F16C + FMA, 2 AVX-512;
   lowered to what the CPU has; vector_level(wanted) says which runs): every level gives the same bits.
   Arguments are addresses (torch data_ptr) of bf16 tensors (contiguous unless strides are given); the
   caller checks shapes, dtypes and contiguity (kvq/runtime/kernels/cpu/ops.py). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Helpers of the per-level copies: inlined, so that they take each level's instructions. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The attention's and the row ops' loops built three times: for AVX-512 (LEVEL_AVX512: F, BW, DQ, VL),
   AVX2 + F16C + FMA (LEVEL_AVX2) and the build's baseline (LEVEL_BASE), from one body each (`*_impl`, always
   inlined, so each copy takes its level's instructions; KVQ_LEVELS defines the copies and their table).
   The caller names the highest level to use (`kvq.runtime.kernels.cpu.ops.vector_level`: $KVQ_CPU_ISA=
   scalar -> base, avx2 -> AVX2, else AVX-512) and `cpu_level` lowers it to what the CPU runs, so every
   level runs, and is compared, on one machine (until stop 32 the attention picked its copy by the CPU
   alone, so "held to AVX2" ran AVX-512 code, and the AVX2 copy, never run here, was ~5x slower: see
   _ops_lanes.h). Their fp32 sums keep one order (explicit lanes, no contraction; the attention's
   multiply-adds fused where the code says so: vfmadd at AVX2 and AVX-512, fmaf at the baseline), so every
   level gives the same bits. */
enum { LEVEL_BASE, LEVEL_AVX2, LEVEL_AVX512 };
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVQ_X86_LEVELS 1
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c,fma")))
#define TARGET_AVX2 __attribute__((target("avx2,f16c,fma")))
#else
#define TARGET_AVX512
#define TARGET_AVX2
#endif
#define KVQ_LEVELS(name, params, args)                                                                             \
    TARGET_AVX512 static void name##_avx512 params { name##_impl args; }                                           \
    TARGET_AVX2 static void name##_avx2 params { name##_impl args; }                                               \
    static void name##_base params { name##_impl args; }                                                          \
    static void (*const name##_at[3]) params = {name##_base, name##_avx2, name##_avx512};
/* A row op's levels (name_rows_at, from name_rows_impl over a job `Type` with fields M and level) and its
   pool task name_task: chunk c of n runs rows [chunk_start(M, c, n), chunk_start(M, c + 1, n)) at the
   job's level. */
#define KVQ_ROW_LEVELS(name, Type)                                                                                 \
    KVQ_LEVELS(name##_rows, (const Type *a, int64_t first, int64_t last), (a, first, last))                        \
    static void name##_task(void *ctx, int64_t chunk, int64_t num_chunks) {                                        \
        const Type *a = ctx;                                                                                       \
        const int64_t first = chunk_start(a->M, chunk, num_chunks);                                                \
        name##_rows_at[a->level](a, first, chunk_start(a->M, chunk + 1, num_chunks));                              \
    }

/* The highest level this build and CPU run (set once, at module init). */
static int cpu_max_level = LEVEL_BASE;

static int detect_cpu_level(void) {
#ifdef KVQ_X86_LEVELS
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c") || !__builtin_cpu_supports("fma"))
        return LEVEL_BASE;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        return LEVEL_AVX512;
    return LEVEL_AVX2;
#else
    return LEVEL_BASE;
#endif
}

/* The highest level up to `wanted` that this build and CPU run. */
static inline int cpu_level(int wanted) {
    return wanted < LEVEL_BASE ? LEVEL_BASE : wanted < cpu_max_level ? wanted : cpu_max_level;
}

/* 16 fp32 lanes as a GCC vector: one AVX-512 register (the AVX-512 level's lanes), with the same sums in
   the same order as two 8-lane ones (no contraction: -ffp-contract=off). */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32))); /* 16 bf16 bit patterns */
#define LANES16 16
/* 8 fp32 lanes: one AVX2 register. GCC keeps a 16-lane vector on the stack where the target has no
   16-lane registers (~6x slower loops), so code for the AVX2 level and the baseline works on 8-lane ones. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16))); /* 8 bf16 bit patterns */
#if defined(__clang__)
#define SHUFFLE8(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define SHUFFLE16(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define SHUFFLE32(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(v, ...) __builtin_shuffle(v, (v8i){__VA_ARGS__})
#define SHUFFLE16(v, ...) __builtin_shuffle(v, (v16i){__VA_ARGS__})
#define SHUFFLE32(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif

ALWAYS_INLINE v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

ALWAYS_INLINE float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, NaN kept quiet; both answers computed and one selected (no branch), so that
   loops of it vectorize. */
ALWAYS_INLINE uint16_t f32_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

/* e^x in fp32 within 1.3 ulp (every 64th fp32 in range checked against expl), in arithmetic, so that
   loops of it vectorize (libm's expf is a call per element): x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2),
   e^r by its degree-7 Taylor polynomial (the remainder is under 2^-27), times 2^n built in the exponent
   bits. x < -87.3 (e^x below fp32's smallest
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

/* The W4A16 extension's thread pool (its `_parallel_for` capsule, set at module init), or NULL: then
   the calling thread alone. One pool for both extensions, so two kinds of calls never have two sets of
   threads spinning against each other. */
typedef void (*task_fn)(void *ctx, int64_t chunk, int64_t num_chunks);
typedef void (*parallel_for_fn)(task_fn fn, void *ctx, int64_t num_chunks, int nt);
static parallel_for_fn kvq_parallel_for;

#define CHUNKS_PER_THREAD 4 /* chunks are taken by whichever thread is free */
#define PARALLEL_FROM_ELEMENTS 8192 /* rms_norm / silu_mul: below this, waking a thread costs more */

/* fn(ctx, c, n) for the n chunks of `items` work items (n = min(items, 4 x threads)) on up to `threads`
   threads; each chunk's results do not depend on n. Call without the GIL. */
static void run_chunks(task_fn fn, void *ctx, int64_t items, int threads) {
    int nt = threads < 1 ? 1 : threads;
    int64_t chunks = (int64_t)nt * CHUNKS_PER_THREAD < items ? (int64_t)nt * CHUNKS_PER_THREAD : items;
    if (kvq_parallel_for != NULL && nt > 1 && chunks > 1)
        kvq_parallel_for(fn, ctx, chunks, nt);
    else if (items > 0)
        fn(ctx, 0, 1);
}

/* run_chunks for the row ops: from PARALLEL_FROM_ELEMENTS, without the GIL and on `threads` threads;
   below, on this thread with the GIL kept (released for a few microseconds, it lets the server's event
   loop in, and getting it back can wait for that loop's whole turn). */
static void run_row_chunks(task_fn fn, void *ctx, int64_t rows, int64_t elements, int threads) {
    if (elements < PARALLEL_FROM_ELEMENTS || threads <= 1 || kvq_parallel_for == NULL) {
        if (rows > 0)
            fn(ctx, 0, 1);
        return;
    }
    PyThreadState *state = PyEval_SaveThread();
    run_chunks(fn, ctx, rows, threads);
    PyEval_RestoreThread(state);
}

/* The first row of chunk c of n over `rows` (chunk c ends where chunk c + 1 starts). */
static inline int64_t chunk_start(int64_t rows, int64_t c, int64_t n) {
    return rows * c / n;
}

#define LANES 16 /* independent partial sums: the loop vectorizes without reassociation flags */

ALWAYS_INLINE void rms_norm_row(const uint16_t *x, const uint16_t *res, uint16_t *res_out, const uint16_t *w,
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

typedef struct {
    const uint16_t *x, *res, *w;
    uint16_t *res_out, *out;
    int64_t M, H;
    float eps;
    int level;
    atomic_int out_of_memory;
} RmsNorm;

ALWAYS_INLINE void rms_norm_rows_impl(const RmsNorm *a, int64_t first, int64_t last, float *s) {
    for (int64_t m = first; m < last; m++) {
        int64_t o = m * a->H;
        rms_norm_row(a->x + o, a->res ? a->res + o : NULL, a->res ? a->res_out + o : NULL, a->w, a->out + o,
                     a->H, a->eps, s);
    }
}
KVQ_LEVELS(rms_norm_rows, (const RmsNorm *a, int64_t first, int64_t last, float *s), (a, first, last, s))

static void rms_norm_task(void *ctx, int64_t chunk, int64_t num_chunks) {
    RmsNorm *a = ctx;
    float *s = malloc((size_t)a->H * sizeof(float));
    if (s == NULL) {
        atomic_store(&a->out_of_memory, 1);
        return;
    }
    rms_norm_rows_at[a->level](a, chunk_start(a->M, chunk, num_chunks), chunk_start(a->M, chunk + 1, num_chunks), s);
    free(s);
}

PyDoc_STRVAR(rms_norm_doc, "bf16 RMSNorm rows, optionally after a residual add (see source).");
static PyObject *rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, res, res_out, w, out;
    long long M, H;
    float eps;
    int threads, level;
    if (!PyArg_ParseTuple(args, "KKKKKLLfii", &x, &res, &res_out, &w, &out, &M, &H, &eps, &threads, &level))
        return NULL;
    if (M < 0 || H <= 0 || H > (1 << 20))
        return PyErr_Format(PyExc_ValueError, "bad shape M=%lld H=%lld", M, H);
    RmsNorm a = {
        .x = (const uint16_t *)(uintptr_t)x, .res = (const uint16_t *)(uintptr_t)res,
        .w = (const uint16_t *)(uintptr_t)w, .res_out = (uint16_t *)(uintptr_t)res_out,
        .out = (uint16_t *)(uintptr_t)out, .M = M, .H = H, .eps = eps, .level = cpu_level(level),
    };
    run_row_chunks(rms_norm_task, &a, M, M * H, threads);
    if (atomic_load(&a.out_of_memory))
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

typedef struct {
    const uint16_t *gate_up;
    uint16_t *out;
    int64_t M, I;
    int level;
} SiluMul;

ALWAYS_INLINE void silu_mul_rows_impl(const SiluMul *a, int64_t first, int64_t last) {
    const int64_t I = a->I;
    for (int64_t m = first; m < last; m++) {
        const uint16_t *g = a->gate_up + m * 2 * I, *u = g + I;
        uint16_t *o = a->out + m * I;
        for (int64_t i = 0; i < I; i++) {
            float x = bf16_f32(g[i]);
            o[i] = f32_bf16(bf16_f32(f32_bf16(x / (1.0f + exp_f32(-x)))) * bf16_f32(u[i]));
        }
    }
}
KVQ_ROW_LEVELS(silu_mul, SiluMul)

PyDoc_STRVAR(silu_mul_doc, "bf16 silu(gate) * up over [M, 2I] rows (see the module source).");
static PyObject *silu_mul(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long gate_up, out;
    long long M, I;
    int threads, level;
    if (!PyArg_ParseTuple(args, "KKLLii", &gate_up, &out, &M, &I, &threads, &level))
        return NULL;
    if (M < 0 || I <= 0)
        return PyErr_Format(PyExc_ValueError, "bad shape M=%lld I=%lld", M, I);
    SiluMul a = {(const uint16_t *)(uintptr_t)gate_up, (uint16_t *)(uintptr_t)out, M, I, cpu_level(level)};
    run_row_chunks(silu_mul_task, &a, M, M * I, threads);
    Py_RETURN_NONE;
}

/* Eight elements of a row of fp32 or bf16 (exactly as fp32) from element i. */
ALWAYS_INLINE v8 row_load8(const void *x, int64_t i, int is_bf16) {
    v8 v;
    if (is_bf16) {
        v8h h;
        memcpy(&h, (const uint16_t *)x + i, sizeof h);
        v8i u = __builtin_convertvector(h, v8i) << 16;
        memcpy(&v, &u, sizeof v);
    } else {
        memcpy(&v, (const float *)x + i, sizeof v);
    }
    return v;
}

ALWAYS_INLINE float row_load1(const void *x, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* The first index of row x[0..V)'s maximum, or of its first NaN (torch.argmax's answer), and whether every
   element is finite: the maximum in 16 running lanes (NaN never wins a compare-and-select; x - x, NaN for
   NaN and +-inf, flags both in the same pass), then the first block of 8 holding it, then the index in
   that block. */
ALWAYS_INLINE int64_t row_argmax(const void *restrict x, int64_t V, int is_bf16, uint8_t *is_finite) {
    v8 top_lo = (v8){0} - INFINITY, top_hi = top_lo; /* lanes 0-7 and 8-15, as two 8-lane vectors */
    v8i nan_lo = {0}, nan_hi = {0}, bad_lo = {0}, bad_hi = {0};
    int64_t i = 0;
    for (; i + LANES16 <= V; i += LANES16) {
        v8 lo = row_load8(x, i, is_bf16), hi = row_load8(x, i + 8, is_bf16);
        v8i win_lo = lo > top_lo, win_hi = hi > top_hi;
        top_lo = (v8)((win_lo & (v8i)lo) | (~win_lo & (v8i)top_lo));
        top_hi = (v8)((win_hi & (v8i)hi) | (~win_hi & (v8i)top_hi));
        nan_lo |= lo != lo;
        nan_hi |= hi != hi;
        bad_lo |= (lo - lo) != 0;
        bad_hi |= (hi - hi) != 0;
    }
    float top16[LANES16];
    int32_t nan16[LANES16], bad16[LANES16];
    memcpy(top16, &top_lo, sizeof top_lo);
    memcpy(top16 + 8, &top_hi, sizeof top_hi);
    memcpy(nan16, &nan_lo, sizeof nan_lo);
    memcpy(nan16 + 8, &nan_hi, sizeof nan_hi);
    memcpy(bad16, &bad_lo, sizeof bad_lo);
    memcpy(bad16 + 8, &bad_hi, sizeof bad_hi);
    int any_nan = 0, any_bad = 0;
    float top = -INFINITY;
    for (int j = 0; j < LANES16; j++) {
        top = top16[j] > top ? top16[j] : top;
        any_nan |= nan16[j] != 0;
        any_bad |= bad16[j] != 0;
    }
    for (; i < V; i++) {
        float v = row_load1(x, i, is_bf16);
        top = v > top ? v : top;
        any_nan |= v != v;
        any_bad |= (v - v) != 0;
    }
    *is_finite = !any_bad;
    int64_t b = 0;
    if (!any_nan)
        for (; b + 8 <= V; b += 8) { /* "is it in these 8" in lanes before the scalar scan */
            v8i hit = row_load8(x, b, is_bf16) == top;
            int any = 0;
            for (int j = 0; j < 8; j++)
                any |= hit[j];
            if (any)
                break;
        }
    for (; b < V; b++) {
        float v = row_load1(x, b, is_bf16);
        if (any_nan ? v != v : v == top)
            return b;
    }
    return 0; /* V == 0: not reached (the caller checks) */
}

typedef struct {
    const void *x;
    int64_t *out;
    uint8_t *is_finite;
    int64_t M, V;
    int is_bf16, level;
} Argmax;

ALWAYS_INLINE void argmax_rows_impl(const Argmax *a, int64_t first, int64_t last) {
    const int64_t row_bytes = a->V * (a->is_bf16 ? 2 : 4);
    for (int64_t m = first; m < last; m++) {
        const char *row = (const char *)a->x + m * row_bytes;
        uint8_t *is_finite = a->is_finite + m;
        a->out[m] = a->is_bf16 ? row_argmax(row, a->V, 1, is_finite) : row_argmax(row, a->V, 0, is_finite);
    }
}
KVQ_ROW_LEVELS(argmax, Argmax)

PyDoc_STRVAR(argmax_doc, "torch.argmax(x, -1) of fp32 or bf16 rows, and their finiteness.");
static PyObject *argmax(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, out, is_finite;
    long long M, V;
    int is_bf16, threads, level;
    if (!PyArg_ParseTuple(args, "KLLpKKii", &x, &M, &V, &is_bf16, &out, &is_finite, &threads, &level))
        return NULL;
    if (M < 0 || V <= 0)
        return PyErr_Format(PyExc_ValueError, "bad shape M=%lld V=%lld", M, V);
    Argmax a = {(const void *)(uintptr_t)x, (int64_t *)(uintptr_t)out, (uint8_t *)(uintptr_t)is_finite, M, V,
                is_bf16, cpu_level(level)};
    run_row_chunks(argmax_task, &a, M, M * V, threads);
    Py_RETURN_NONE;
}

/* o[i] = bf16(bf16(x[i] * c[i]) + x[partner + i] * s[i]) for i in [0, n): one half of rotate_half. */
ALWAYS_INLINE void rotary_half(const uint16_t *restrict x, const uint16_t *restrict partner,
                               const uint16_t *restrict c, const uint16_t *restrict s, uint16_t *restrict o,
                               int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float first = bf16_f32(f32_bf16(bf16_f32(x[i]) * bf16_f32(c[i])));
        o[i] = f32_bf16(first + bf16_f32(partner[i]) * bf16_f32(s[i]));
    }
}

ALWAYS_INLINE void rotary_rows_impl(const uint16_t *x, int64_t row_stride, int64_t T, int64_t H, int64_t D,
                                    int64_t R, const uint16_t *cos, const uint16_t *sin, uint16_t *out) {
    const int64_t half = R / 2;
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos + t * R, *s = sin + t * R;
        for (int64_t h = 0; h < H; h++) {
            const uint16_t *xi = x + t * row_stride + h * D;
            uint16_t *o = out + (t * H + h) * D;
            rotary_half(xi, xi + half, c, s, o, half); /* rotate_half: -x2 (in sin_signed) for the first */
            rotary_half(xi + half, xi, c + half, s + half, o + half, half);
            memcpy(o + R, xi + R, (size_t)(D - R) * 2);
        }
    }
}
KVQ_LEVELS(rotary_rows,
           (const uint16_t *x, int64_t row_stride, int64_t T, int64_t H, int64_t D, int64_t R, const uint16_t *cos,
            const uint16_t *sin, uint16_t *out),
           (x, row_stride, T, H, D, R, cos, sin, out))

PyDoc_STRVAR(rotary_doc, "bf16 rotate-half rotary embedding (see the module source).");
static PyObject *rotary(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, cos, sin, out;
    long long row_stride, T, H, D, R;
    int level;
    if (!PyArg_ParseTuple(args, "KLLLLLKKKi", &x, &row_stride, &T, &H, &D, &R, &cos, &sin, &out, &level))
        return NULL;
    if (T < 0 || H <= 0 || D <= 0 || R <= 0 || R > D || R % 2 || row_stride < H * D)
        return PyErr_Format(PyExc_ValueError, "bad shape T=%lld H=%lld D=%lld R=%lld stride=%lld", T, H, D, R,
                            row_stride);
    rotary_rows_at[cpu_level(level)]((const uint16_t *)(uintptr_t)x, row_stride, T, H, D, R,
                                     (const uint16_t *)(uintptr_t)cos, (const uint16_t *)(uintptr_t)sin,
                                     (uint16_t *)(uintptr_t)out);
    Py_RETURN_NONE;
}

#define FP8_MAX 448.0f

/* fp32 -> float8_e4m3fn, round to nearest even; |f| <= 448 after the caller's clamp, NaN kept. Both
   encodings computed and one chosen by masks (no branch), so that a row of them vectorizes: below 2^-6,
   the smallest normal, a multiple of 2^-9 (rounded by adding and taking away 2^23, exact and to nearest
   even; 8, the rounding up to 2^-6, encodes it too); above, the mantissa rounded to 3 bits in the fp32
   bits and the exponent rebiased. */
ALWAYS_INLINE uint8_t f32_to_e4m3(float f) {
    uint32_t u, magnitude;
    memcpy(&u, &f, 4);
    magnitude = u & 0x7FFFFFFFu;
    float a;
    memcpy(&a, &magnitude, 4);
    int is_subnormal = magnitude < 0x3C800000u;
    float steps = is_subnormal ? (a * 512.0f + 8388608.0f) - 8388608.0f : 0.0f; /* 0..8 */
    uint32_t rounded = magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u);
    uint32_t normal = (((rounded >> 23) - 120u) << 3) | ((rounded >> 20) & 7u);
    uint32_t out = is_subnormal ? (uint32_t)(int32_t)steps : normal;
    out = magnitude > 0x7F800000u ? 0x7Fu : out;
    return (uint8_t)(((u >> 24) & 0x80u) | out);
}

/* One head's D bf16 values -> e4m3fn bytes of x / scale, clamped to +-448 (NaN passes: torch's clamp). */
ALWAYS_INLINE void quantize_e4m3_row_impl(const uint16_t *restrict src, uint8_t *restrict dst, int64_t D,
                                          float scale) {
    for (int64_t d = 0; d < D; d++) {
        float q = bf16_f32(src[d]) / scale;
        q = q > FP8_MAX ? FP8_MAX : q < -FP8_MAX ? -FP8_MAX : q;
        dst[d] = f32_to_e4m3(q);
    }
}
KVQ_LEVELS(quantize_e4m3_row, (const uint16_t *restrict src, uint8_t *restrict dst, int64_t D, float scale),
           (src, dst, D, scale))

PyDoc_STRVAR(store_kv_doc, "The step's K/V rows (and slot stamps) into their page slots.");
static PyObject *store_kv(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long k, v, kc, vc, scales, slots, stamps, stamp_values;
    long long k_row, v_row, T, Hkv, D, ks0, ks1, ks2, vs0, vs1, vs2, page_size, stamp_stride;
    int kv_fp8, slots_int64, level;
    if (!PyArg_ParseTuple(args, "KLKLLLLK(LLL)K(LLL)iKKiLiKLK", &k, &k_row, &v, &v_row, &T, &Hkv, &D, &kc,
                          &ks0, &ks1, &ks2, &vc, &vs0, &vs1, &vs2, &kv_fp8, &scales, &slots, &slots_int64,
                          &page_size, &level, &stamps, &stamp_stride, &stamp_values))
        return NULL;
    void (*const quantize_row)(const uint16_t *restrict, uint8_t *restrict, int64_t, float) =
        quantize_e4m3_row_at[cpu_level(level)];
    if (T < 0 || Hkv <= 0 || D <= 0 || page_size <= 0)
        return PyErr_Format(PyExc_ValueError, "bad shape T=%lld Hkv=%lld D=%lld", T, Hkv, D);
    const float *scale = (const float *)(uintptr_t)scales;
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slots_int64 ? ((const int64_t *)(uintptr_t)slots)[t] : ((const int32_t *)(uintptr_t)slots)[t];
        if (slot < 0)
            continue;
        int64_t page = slot / page_size, offset = slot % page_size;
        if (stamps)
            ((int64_t *)(uintptr_t)stamps)[slot * stamp_stride] = ((const int64_t *)(uintptr_t)stamp_values)[t];
        for (int half = 0; half < 2; half++) {
            const uint16_t *src = (const uint16_t *)(uintptr_t)(half ? v : k) + t * (half ? v_row : k_row);
            int64_t base = half ? page * vs0 + offset * vs1 : page * ks0 + offset * ks1, hs = half ? vs2 : ks2;
            for (int64_t h = 0; h < Hkv; h++) {
                if (!kv_fp8) {
                    memcpy((uint16_t *)(uintptr_t)(half ? vc : kc) + base + h * hs, src + h * D, (size_t)D * 2);
                    continue;
                }
                quantize_row(src + h * D, (uint8_t *)(uintptr_t)(half ? vc : kc) + base + h * hs, D,
                                  scale[half * Hkv + h]);
            }
        }
    }
    Py_RETURN_NONE;
}

#include "_ops_attention.h"
#include "_ops_stamps.h"

PyDoc_STRVAR(has_thread_pool_doc, "Whether calls can use the W4A16 extension's threads.");
static PyObject *has_thread_pool(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyBool_FromLong(kvq_parallel_for != NULL);
}

PyDoc_STRVAR(vector_level_doc, "The vector level (0-2) that runs for a wanted one.");
static PyObject *vector_level(PyObject *self, PyObject *args) {
    (void)self;
    int wanted;
    if (!PyArg_ParseTuple(args, "i", &wanted))
        return NULL;
    return PyLong_FromLong(cpu_level(wanted));
}

/* A row of the method table: the function `name` with its docstring `name##_doc` (beside the function). */
#define METHOD(name, flags) {#name, name, flags, name##_doc}

static PyMethodDef methods[] = {
    METHOD(rms_norm, METH_VARARGS), METHOD(silu_mul, METH_VARARGS), METHOD(rotary, METH_VARARGS),
    METHOD(store_kv, METH_VARARGS), METHOD(check_stamps, METH_VARARGS), METHOD(check_step, METH_VARARGS),
    METHOD(check_batch, METH_VARARGS), METHOD(guard_slots, METH_VARARGS),
    METHOD(sampled_page_hash, METH_VARARGS), METHOD(argmax, METH_VARARGS),
    METHOD(decode_attention, METH_VARARGS), METHOD(vector_level, METH_VARARGS),
    METHOD(has_thread_pool, METH_NOARGS),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_ops", .m_doc = "The small bf16 ops of a CPU decode step (see the source).",
    .m_size = -1, .m_methods = methods,
};

/* The W4A16 extension's `_parallel_for`, or NULL (not built: one thread). Imported by its full module
   name, not with PyCapsule_Import, which walks attributes from `kvq` down: while the kvq.runtime.kernels
   package is still initializing (its __init__ imports this module), `kvq.runtime` has no `kernels`
   attribute yet, so that walk failed and every call ran on one thread. */
static parallel_for_fn import_parallel_for(void) {
    PyObject *ext = PyImport_ImportModule("kvq.runtime.kernels.cpu._linear"), *capsule = NULL;
    void *fn = NULL;
    if (ext != NULL && (capsule = PyObject_GetAttrString(ext, "_parallel_for")) != NULL)
        fn = PyCapsule_GetPointer(capsule, "kvq.runtime.kernels.cpu._linear._parallel_for");
    Py_XDECREF(capsule);
    Py_XDECREF(ext);
    if (fn == NULL)
        PyErr_Clear();
    return (parallel_for_fn)fn;
}

PyMODINIT_FUNC PyInit__ops(void) {
    kvq_parallel_for = import_parallel_for();
    cpu_max_level = detect_cpu_level();
    return PyModule_Create(&module);
}

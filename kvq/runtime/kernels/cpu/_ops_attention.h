/* decode_attention of kvq.runtime.kernels.cpu._ops (the contract is at the top of _ops.c): paged decode
   attention straight from bf16 or FP8 pages, over the (sequence, KV head) pairs, on the W4A16 kernel's
   thread pool where it is built. Included by _ops.c, after its bf16 helpers, exp_f32, the LEVEL_*
   values and the KVQ_LEVELS / ALWAYS_INLINE macros. */

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

/* A row of e4m3fn bytes -> fp32 e4m3(b) * 2^-8, 16 bytes at a time with F16C (its first D - D % 16; returns how
   many it did, E4M3_ROWS converts the rest): the byte's 7 exponent-mantissa bits placed in a binary16's low
   exponent and high mantissa bits ((b & 0x7F) << 7, sign to bit 15) make a binary16 of that value for normals and
   subnormals alike (e4m3fn's bias is 7, binary16's 15; binary16 subnormals keep the same m * 2^-k form), which
   vcvtph2ps widens exactly (in hardware: no denormal fp32 arithmetic). 0x7F / 0xFF (NaN) would read as +-480 *
   2^-8: their halves become the quiet NaN 0x7E00 with the sign, which widens to e4m3_f32's 0x7FC00000. ~10
   instructions per 16 bytes where the arithmetic form takes ~30. The 2^8 and the page's scale go on the query (K)
   and the output (V), once: see attend. */
#ifdef KVQ_X86_LEVELS
__attribute__((target("avx2,f16c"))) static inline int64_t e4m3_row_f16c(const uint8_t *restrict s, int64_t D,
                                                                        float *restrict row) {
    const __m256i keep = _mm256_set1_epi16((short)0xBF80), nan_bits = _mm256_set1_epi16((short)0xFE00);
    const __m256i to_nan = _mm256_set1_epi16(0x4180); /* 0x3F80 ^ 0x4180 = 0x7E00 */
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
    return d;
}

/* e4m3_row_f16c 32 bytes at a time in AVX-512 registers, the NaN fix in a mask (the same values). */
__attribute__((target("avx512f,avx512bw"))) static inline int64_t
e4m3_row_avx512(const uint8_t *restrict s, int64_t D, float *restrict row) {
    const __m512i keep = _mm512_set1_epi16((short)0xBF80), nan_bits = _mm512_set1_epi16((short)0xFE00);
    const __m512i to_nan = _mm512_set1_epi16(0x4180);
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
    return d;
}

/* Rows of e4m3fn bytes (n rows, src_stride bytes apart) -> fp32 rows [n, D]: a row's first bytes in
   registers (row_fn), the rest one at a time. One call per page: the loop of the attention's FP8 loads. */
#define E4M3_ROWS(name, target, row_fn)                                                                          \
    target static void name(const uint8_t *restrict src, int64_t n, int64_t src_stride, int64_t D,             \
                            float *restrict rows) {                                                              \
        for (int64_t j = 0; j < n; j++) {                                                                        \
            const uint8_t *restrict s = src + j * src_stride;                                                    \
            float *restrict row = rows + j * D;                                                                  \
            for (int64_t d = row_fn(s, D, row); d < D; d++)                                                      \
                row[d] = e4m3_f32(s[d]) * 0x1p-8f;                                                               \
        }                                                                                                        \
    }
E4M3_ROWS(e4m3_rows_f16c, __attribute__((target("avx2,f16c"))), e4m3_row_f16c)
E4M3_ROWS(e4m3_rows_avx512, __attribute__((target("avx512f,avx512bw"))), e4m3_row_avx512)

/* A bf16 row's first D - D % 16 elements as fp32 into row (one vpmovzxwd from memory, a shift and a store
   per 16: GCC's own code for the 16-lane conversion went 8 lanes at a time, through extracts and inserts,
   ~45% of the kernel's samples); returns how many it did. */
TARGET_AVX512 static int64_t bf16_row_avx512(const uint16_t *restrict src, int64_t D, float *restrict row) {
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + d)));
        _mm512_storeu_si512(row + d, _mm512_slli_epi32(wide, 16));
    }
    return d;
}
#endif

typedef struct {
    const uint8_t *base;
    int64_t page_stride, slot_stride, head_stride; /* elements */
    int is_fp8, level; /* how FP8 bytes become fp32 (the same values): arithmetic, F16C, AVX-512 BW */
} Pages;

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
    int bt_int64, sl_int64, level;
    float sm_scale;
    atomic_int out_of_memory;
} Attention;

static inline int64_t seq_len(const Attention *a, int64_t b) {
    return a->sl_int64 ? ((const int64_t *)a->lens)[b] : ((const int32_t *)a->lens)[b];
}

/* a * b + c per lane, rounded once: vfmadd where the level has FMA (AVX2 and AVX-512 levels: GCC turns
   these lane loops into one instruction), fmaf elsewhere; the same bits either way. */
ALWAYS_INLINE v16 fma16(v16 a, v16 b, v16 c) {
    v16 r;
    for (int i = 0; i < 16; i++)
        r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
}
ALWAYS_INLINE v8 fma8(v8 a, v8 b, v8 c) {
    v8 r;
    for (int i = 0; i < 8; i++)
        r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
}

#define LN(name) name##_z /* 16 lanes in one GCC vector: one AVX-512 register */
#define VT v16
#define V_LOAD load16
#define V_ADD(a, b) ((a) + (b))
#define V_FMA fma16
#define V_SPLAT(s) ((v16){0} + (s))
#define V_ZERO ((v16){0})
#define LANES_WIDE 1
#include "_ops_lanes.h"
#undef LANES_WIDE
#undef LN
#undef VT
#undef V_ZERO
#undef V_LOAD
#undef V_ADD
#undef V_FMA
#undef V_SPLAT

typedef struct {
    v8 lo, hi; /* lanes 0-7, 8-15 */
} v16p;
ALWAYS_INLINE v16p p_load(const float *p) {
    v16p v;
    memcpy(&v.lo, p, sizeof v.lo);
    memcpy(&v.hi, p + 8, sizeof v.hi);
    return v;
}
ALWAYS_INLINE v16p p_add(v16p a, v16p b) {
    return (v16p){a.lo + b.lo, a.hi + b.hi};
}
ALWAYS_INLINE v16p p_fma(v16p a, v16p b, v16p c) {
    return (v16p){fma8(a.lo, b.lo, c.lo), fma8(a.hi, b.hi, c.hi)};
}
ALWAYS_INLINE v16p p_splat(float s) {
    return (v16p){(v8){0} + s, (v8){0} + s};
}

#define LN(name) name##_y /* 16 lanes as two 8-lane GCC vectors: AVX2 registers (GCC spills 16-lane ones) */
#define VT v16p
#define V_LOAD p_load
#define V_ADD p_add
#define V_FMA p_fma
#define V_SPLAT p_splat
#define V_ZERO ((v16p){{0}, {0}})
#define LANES_WIDE 0
#include "_ops_lanes.h"

TARGET_AVX512 static void attend_avx512(const Attention *a, int64_t b, int64_t h, float *work) {
    attend_z(a, b, h, work);
}
TARGET_AVX2 static void attend_avx2(const Attention *a, int64_t b, int64_t h, float *work) {
    attend_y(a, b, h, work);
}
static void attend_base(const Attention *a, int64_t b, int64_t h, float *work) {
    attend_y(a, b, h, work);
}
static void (*const attend_at[3])(const Attention *, int64_t, int64_t, float *) = {attend_base, attend_avx2,
                                                                                  attend_avx512};


/* The K and V rows of (sequence, KV head) item `item` requested into L2 (one prefetch per 64 bytes), a whole
   item ahead of their use: a layer's pages arrive cold (the weights between two layers' attention push them
   out of L2) and ~35% of the kernel's samples sat on the first loads of page rows. 32 sequences x 64
   tokens, 30 layers' pages with 64 MiB read between steps, one Emerald Rapids core: 193-265 -> 176-218 us
   a layer (warm pages: ~6% slower, the prefetches' own cost). The same values either way. */
static void prefetch_item(const Attention *a, int64_t item) {
    const int64_t b = item / a->Hkv, h = item % a->Hkv, L = seq_len(a, b), size = a->kp.is_fp8 ? 1 : 2;
    const uint8_t *table_row = a->tables + b * a->bt_stride * (a->bt_int64 ? 8 : 4);
    for (int64_t t = 0; t < L; t++) {
        const int64_t i = t / a->page_size, j = t % a->page_size;
        const int64_t page = a->bt_int64 ? ((const int64_t *)table_row)[i] : ((const int32_t *)table_row)[i];
        const Pages *kp = &a->kp, *vp = &a->vp;
        const uint8_t *k = kp->base + (page * kp->page_stride + j * kp->slot_stride + h * kp->head_stride) * size;
        const uint8_t *v = vp->base + (page * vp->page_stride + j * vp->slot_stride + h * vp->head_stride) * size;
        for (int64_t offset = 0; offset < a->D * size; offset += 64) {
            __builtin_prefetch(k + offset, 0, 2);
            __builtin_prefetch(v + offset, 0, 2);
        }
    }
}

/* Chunk `chunk` of `num_chunks` over the B * Hkv (sequence, KV head) items, on whichever thread takes it;
   each thread's scratch is its own, kept between calls. The next item's rows are prefetched first. */
static void attention_task(void *ctx, int64_t chunk, int64_t num_chunks) {
    static _Thread_local float *work;
    static _Thread_local size_t work_floats;
    Attention *a = ctx;
    const int64_t items = a->B * a->Hkv, G = a->Hq / a->Hkv;
    const int64_t last = items * (chunk + 1) / num_chunks;
    for (int64_t item = items * chunk / num_chunks; item < last; item++) {
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
        if (item + 1 < last)
            prefetch_item(a, item + 1);
        attend_at[a->level](a, b, item % a->Hkv, work);
    }
}

PyDoc_STRVAR(decode_attention_doc, "Paged decode attention over bf16/FP8 pages.");
static PyObject *decode_attention(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long q, k, v, scales, tables, lens, out;
    int kv_fp8, bt_int64, sl_int64, threads, level;
    long long q_row_stride, ks0, ks1, ks2, vs0, vs1, vs2, bt_stride, B, Hq, Hkv, D, page_size;
    float sm_scale;
    if (!PyArg_ParseTuple(args, "KLKKi(LLL)(LLL)KKLiKiKLLLLLfii", &q, &q_row_stride, &k, &v, &kv_fp8, &ks0,
                          &ks1, &ks2, &vs0, &vs1, &vs2, &scales, &tables, &bt_stride, &bt_int64, &lens,
                          &sl_int64, &out, &B, &Hq, &Hkv, &D, &page_size, &sm_scale, &threads, &level))
        return NULL;
    if (B < 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || D > MAX_HEAD_DIM || page_size <= 0 || q_row_stride < Hq * D)
        return PyErr_Format(PyExc_ValueError,
                            "bad shape B=%lld Hq=%lld Hkv=%lld D=%lld page_size=%lld q_row_stride=%lld", B, Hq,
                            Hkv, D, page_size, q_row_stride);
    level = cpu_level(level);
    Attention a = {
        .kp = {(const uint8_t *)(uintptr_t)k, ks0, ks1, ks2, kv_fp8, level},
        .vp = {(const uint8_t *)(uintptr_t)v, vs0, vs1, vs2, kv_fp8, level},
        .scale = (const float *)(uintptr_t)scales,
        .q = (const uint16_t *)(uintptr_t)q,
        .tables = (const uint8_t *)(uintptr_t)tables,
        .lens = (const void *)(uintptr_t)lens,
        .out = (uint16_t *)(uintptr_t)out,
        .q_row_stride = q_row_stride, .bt_stride = bt_stride, .B = B, .Hq = Hq, .Hkv = Hkv, .D = D,
        .page_size = page_size, .bt_int64 = bt_int64, .sl_int64 = sl_int64, .level = level, .sm_scale = sm_scale,
    };
    Py_BEGIN_ALLOW_THREADS;
    run_chunks(attention_task, &a, B * Hkv, threads); /* lengths differ: chunks taken by free threads */
    Py_END_ALLOW_THREADS;
    if (atomic_load(&a.out_of_memory))
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

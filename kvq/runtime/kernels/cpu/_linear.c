/* kvq.runtime.kernels.cpu._linear: W4A16 GEMV/GEMM on CPU over compressed-tensors pack-quantized weights.

   y[m, n] = sum_g scale[n, g] * sum_{k in group g} q[n, k] * x[m, k], fp32 sums, for weight_packed int32
   [N, K/8] (nibble j of word k is q[n, 8k + j] + 8), weight_scale [N, K/G] (bf16 or fp32), activations
   x [M, K] and output y [M, N] in fp32, bf16 or fp16 (rounded to nearest even), all contiguous.
   Paths (isa): 0 scalar (the C reference: plain loops in the natural order), 1 AVX2 + FMA, 2 AVX-512F,
   3 AVX-512 BF16 (path 2, but bf16 activations go through vdpbf16ps: _linear_bf16.h), 4 AMX (path 3,
   but bf16 batches of M >= 2 rows go through AMX tiles over bf16(q * scale): _linear_amx.h);
   one build holds all of them (per-function target attributes) and `isas()` says which this CPU runs.
   Threads split the output rows (N); activations are converted once per call (to fp32, or for
   avx512bf16 to bf16 pairs in its block order, or for amx to bf16 pairs in AMX's tile layout).

   gemm(isa, threads, x, x_dtype, M, K, weight_packed, weight_scale, scale_dtype, N, group, y, y_dtype)
   takes addresses (torch data_ptr) and dtype codes 0 fp32, 1 bf16, 2 fp16; the caller checks shapes,
   dtypes and contiguity (kvq/runtime/kernels/cpu/linear.py). The GIL is released while it runs; calls
   from several threads take turns. `gemm_w8` is the same for int8 weights with a scale per row
   (_w8a16.h, _w8a16_simd.h), `gemm_dense` for dense bf16 weights on AMX tiles (_dense_amx.h). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../../../formats/_pack_quantized.h" /* the nibble layout, f32_bits, bits_f32, bf16_round_bits */
#include "_linear_pool.h"

#if defined(KVQ_SIMDE_CHECK) /* a check build: every path through SIMDe's portable intrinsics, on any CPU */
#define KVQ_X86 1
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include "_linear_simde.h"
#define TARGET_AVX2
#define TARGET_AVX512
#define TARGET_AVX512BF16
#define TARGET_AVX512VNNI
#elif defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVQ_X86 1
#include <immintrin.h>
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define TARGET_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
#define TARGET_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
/* AMX: not in the SIMDe check build (SIMDe has no AMX), and only from compilers that know its targets and
   intrinsics (GCC 11, clang 12); older ones build every other path */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define KVQ_AMX 1
#define TARGET_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
#endif
#include <cpuid.h>
#endif

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3, ISA_AMX = 4 };
#define MIN_WORK_PER_THREAD 32768 /* multiply-adds: below this a thread costs more than it saves */
#define CHUNKS_PER_THREAD 4         /* row ranges per thread, taken dynamically (see _linear_pool.h) */

typedef struct {
    int isa, group, group_shift, x_dtype, scale_dtype, y_dtype, scale_size;
    int vnni;        /* avx512bf16: bf16 activations as fixed point on VNNI integer sums (_linear_vnni.h),
                        not vdpbf16ps pairs (gemv_bf16, gemm_bf16) */
    int weight_bits; /* 4: packed int4 (above); on the amx path also 8: W8A16's int8 [N, K] with one scale per
                        row (gemm_w8_amx), 16: a dense bf16 [N, K] (gemm_dense) */
    int64_t M, K, N, num_groups, xp_stride;
    const void *x;
    const int32_t *packed;
    const uint8_t *scale;
    void *y;
    float *xp; /* activations in fp32: natural order (scalar) or permuted blocks (SIMD); bf16 pair planes
                  (avx512bf16); bf16 pairs in B tiles (amx) */
    atomic_int failed; /* set by a thread that could not get its buffer (amx): the call raises MemoryError */
} Job;

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    if (exponent == 0x1F)
        return bits_f32(sign | 0x7F800000u | (mantissa << 13));
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact */
        float f = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    return bits_f32(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

/* Round to nearest even (F. Giesen's float_to_half_fast3_rtne). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000u;
    u &= 0x7FFFFFFFu;
    if (u >= 0x47800000u) /* >= 65536, Inf or NaN */
        return (uint16_t)(sign | (u > 0x7F800000u ? 0x7E00u : 0x7C00u));
    if (u < 0x38800000u) /* below 2^-14: the float adder rounds the subnormal */
        return (uint16_t)(sign | (f32_bits(bits_f32(u) + 0.5f) - 0x3F000000u));
    u += 0xC8000FFFu + ((u >> 13) & 1u); /* rebias the exponent (15 - 127) << 23, round */
    return (uint16_t)(sign | (u >> 13));
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)(bf16_round_bits(u) >> 16);
}

/* Element i of an fp32 / bf16 / fp16 array as fp32, and v stored into one (rounded to nearest even). */
static inline float load_f32(const void *p, int dtype, int64_t i) {
    switch (dtype) {
    case DTYPE_BF16:
        return bits_f32((uint32_t)((const uint16_t *)p)[i] << 16);
    case DTYPE_F16:
        return f16_to_f32(((const uint16_t *)p)[i]);
    default:
        return ((const float *)p)[i];
    }
}

static inline void store_f32(void *p, int dtype, int64_t i, float v) {
    if (dtype == DTYPE_F32)
        ((float *)p)[i] = v;
    else if (dtype == DTYPE_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((uint16_t *)p)[i] = f32_to_f16(v);
}

static inline float x_at(const Job *job, int64_t m, int64_t k) {
    return load_f32(job->x, job->x_dtype, m * job->K + k);
}

/* Group g's scale in a row of fp32 or bf16 scales. */
static inline float row_scale(const uint8_t *srow, int scale_dtype, int64_t g) {
    if (scale_dtype == DTYPE_F32)
        return ((const float *)srow)[g];
    return bits_f32((uint32_t)((const uint16_t *)srow)[g] << 16);
}

static inline float scale_at(const Job *job, const uint8_t *srow, int64_t g) {
    return row_scale(srow, job->scale_dtype, g);
}

/* The GEMVs (M = 1) read each weight once, row after row, and wait on memory: the hardware prefetcher alone
   kept a weight stream from DRAM at 5.2-6.1 GB/s on a Xeon core where torch's BF16 GEMV streams 8.2;
   requesting the line GEMV_PREFETCH_BYTES ahead of each block as it is read (rows are contiguous: a few
   rows on) took it to 10.8 (avx512bf16). 4-8 KiB did equally; 1 KiB too little, 16 KiB less; the lines of
   the next rows requested in one burst per four rows did less (8.6). */
#define GEMV_PREFETCH_BYTES 4096

static inline void prefetch_ahead(const int32_t *block) {
    __builtin_prefetch((const char *)block + GEMV_PREFETCH_BYTES, 0, 3);
}

static inline void store_y(const Job *job, int64_t m, int64_t n, float v) {
    store_f32(job->y, job->y_dtype, m * job->N + n, v);
}

#ifdef KVQ_X86
/* y[m, n..n+3] = v, as four store_y (bf16: the same rounding, four lanes at once, in SSE2). */
static inline void store_y4(const Job *job, int64_t m, int64_t n, __m128 v) {
    if (job->y_dtype != DTYPE_BF16) {
        float lanes[4];
        _mm_storeu_ps(lanes, v);
        for (int r = 0; r < 4; r++)
            store_y(job, m, n + r, lanes[r]);
        return;
    }
    const __m128i bits = _mm_castps_si128(v), one = _mm_set1_epi32(1);
    __m128i odd = _mm_and_si128(_mm_srli_epi32(bits, 16), one);
    __m128i rounded = _mm_srli_epi32(_mm_add_epi32(bits, _mm_add_epi32(odd, _mm_set1_epi32(0x7FFF))), 16);
    __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(v, v)); /* NaN: kept, made quiet */
    __m128i quiet = _mm_or_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(0x40));
    rounded = _mm_or_si128(_mm_and_si128(nan, quiet), _mm_andnot_si128(nan, rounded));
    /* 4 x u32 below 2^16 -> 4 x u16: shifted into int16's range for the signed pack, and back */
    __m128i biased = _mm_packs_epi32(_mm_sub_epi32(rounded, _mm_set1_epi32(0x8000)), _mm_setzero_si128());
    _mm_storel_epi64((__m128i *)((uint16_t *)job->y + m * job->N + n),
                     _mm_add_epi16(biased, _mm_set1_epi16((short)0x8000)));
}
#endif

/* A W8A16 call (see _w8a16.h): int8 weights [N, K] with one scale per row; or a dense bf16 GEMV
   (gemv_dense: `w16` set, M = 1, no scale). */
typedef struct {
    int isa, x_dtype, scale_dtype, y_dtype;
    int64_t M, K, N;
    const void *x;
    const int8_t *w;
    const uint16_t *w16; /* bf16 weights [N, K] instead of w (one activation row) */
    const void *scale;   /* NULL: 1 */
    void *y;
    float *xp; /* activations in fp32, [M, K] */
} W8Job;

static inline void w8_store(const W8Job *job, int64_t m, int64_t n, float dot) {
    float scale = job->scale == NULL ? 1.0f : load_f32(job->scale, job->scale_dtype, n);
    store_f32(job->y, job->y_dtype, m * job->N + n, dot * scale);
}

static inline int isa_lanes(int isa) { return isa >= ISA_AVX512 ? 16 : isa == ISA_AVX2 ? 8 : 0; }

#ifdef KVQ_X86
static int64_t vnni_xp_stride(int64_t K);              /* _linear_vnni.h */
static void convert_row_vnni(const Job *job, int64_t m); /* _linear_vnni.h */
#endif

/* Activations per row, in 4-byte units: K fp32 (scalar), per block of `lanes` words 8 * lanes fp32
   planes + lanes fp32 sums (SIMD), per block of 16 words 4 * 16 bf16 pairs (avx512bf16 at M >= 2; at
   Job.vnni the byte planes of _linear_vnni.h), or K / 2 bf16 pairs (amx). */
static int64_t xp_stride_of(int isa, int64_t K, int vnni) {
#ifdef KVQ_X86
    if (vnni)
        return vnni_xp_stride(K);
#endif
    if (isa == ISA_AMX)
        return K / 2;
    int lanes = isa_lanes(isa);
    if (lanes == 0)
        return K;
    int64_t words = K / 8, num_blocks = (words + lanes - 1) / lanes;
    return num_blocks * (isa == ISA_AVX512BF16 ? 4 * lanes : 8 * lanes + lanes);
}

/* Row m of bf16 activations as avx512bf16's kernels read them, zero past K: per block of 16 words, pair
   plane p (0..3), lane i (0..15) holds elements 8i + p (low half) and 8i + 4 + p (high half) of the
   block (see _linear_bf16.h). */
static void convert_row_pairs(const Job *job, int64_t m) {
    const uint16_t *x = (const uint16_t *)job->x + m * job->K;
    uint32_t *out = (uint32_t *)(job->xp + m * job->xp_stride);
    for (int64_t base = 0; base < job->xp_stride; base += 64) /* base: the block's first word, times 4 */
        for (int p = 0; p < 4; p++)
            for (int i = 0; i < 16; i++) {
                int64_t k = 2 * base + 8 * i + p;
                out[base + 16 * p + i] = k < job->K ? (uint32_t)x[k] | (uint32_t)x[k + 4] << 16 : 0;
            }
}

#ifdef KVQ_AMX
static void convert_row_amx(const Job *job, int64_t m); /* _linear_amx.h */
#endif

/* Activation rows as the path reads them: M, or for amx M rounded up to its 16-row tiles. */
static int64_t xp_rows(const Job *job) { return job->isa == ISA_AMX ? (job->M + 15) / 16 * 16 : job->M; }

/* convert_row's factor for the AVX2 GEMV's plane j inputs (V_PLANE_GEMV): 16^-j for the planes masked in
   place, 1 for plane 0 and the shifted plane 7. Powers of two: exact for inputs from 2^-102 up (smaller
   ones become fp32 subnormals and lose bits; their products are below 2^-98). */
static const float PLANE_INPUT_SCALE[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f,
                                           1.0f};

static void convert_row(const Job *job, int64_t m) {
    float *out = job->xp + m * job->xp_stride;
    int lanes = isa_lanes(job->isa);
#ifdef KVQ_AMX
    if (job->isa == ISA_AMX) {
        convert_row_amx(job, m);
        return;
    }
#endif
#ifdef KVQ_X86
    if (job->vnni) {
        convert_row_vnni(job, m);
        return;
    }
#endif
    if (job->isa == ISA_AVX512BF16) {
        convert_row_pairs(job, m);
        return;
    }
    if (lanes == 0) {
        for (int64_t k = 0; k < job->K; k++)
            out[k] = x_at(job, m, k);
        return;
    }
    int64_t words = job->K / 8, num_blocks = (words + lanes - 1) / lanes;
    const int unshifted = job->isa == ISA_AVX2 && job->M == 1; /* V_PLANE_GEMV's planes: inputs / 16^j */
    for (int64_t b = 0; b < num_blocks; b++) {
        float *block = out + b * (9 * lanes);
        for (int i = 0; i < lanes; i++) {
            int64_t word = b * lanes + i;
            float sum = 0.0f;
            for (int j = 0; j < 8; j++) {
                float v = word < words ? x_at(job, m, 8 * word + j) : 0.0f;
                block[j * lanes + i] = unshifted && j > 0 && j < 7 ? v * PLANE_INPUT_SCALE[j] : v;
                sum += v;
            }
            block[8 * lanes + i] = 8.0f * sum;
        }
    }
}

static void convert_task(void *ctx, int64_t chunk, int64_t num_chunks) {
    const Job *job = (const Job *)ctx;
    const int64_t rows = xp_rows(job);
    for (int64_t m = rows * chunk / num_chunks; m < rows * (chunk + 1) / num_chunks; m++)
        convert_row(job, m);
}

/* The reference: per output, per group, a plain fp32 sum in k order, then times the group's scale. */
static void scalar_rows(const Job *job, int64_t n0, int64_t n1) {
    const int64_t words = job->K / 8;
    for (int64_t m = 0; m < job->M; m++) {
        const float *x = job->xp + m * job->xp_stride;
        for (int64_t n = n0; n < n1; n++) {
            const uint32_t *wrow = (const uint32_t *)job->packed + n * words;
            const uint8_t *srow = job->scale + n * job->num_groups * job->scale_size;
            float acc = 0.0f;
            for (int64_t g = 0; g < job->num_groups; g++) {
                float sum = 0.0f;
                for (int64_t k = g * job->group; k < (g + 1) * job->group; k++) {
                    int q = int4_unpack(wrow[k / 8], (int)(k % 8));
                    sum += (float)q * x[k];
                }
                acc += sum * scale_at(job, srow, g);
            }
            store_y(job, m, n, acc);
        }
    }
}

#define GEMM_KC 8       /* weight blocks per decompressed tile of the W4A16 GEMMs (_linear_gemm.h) */
#define GEMM_M_BLOCK 64 /* activation rows per pass over such a tile */

#ifdef KVQ_X86
#define ISA avx2
#define TARGET TARGET_AVX2
#define L 8
#define VF __m256
#define VI __m256i
#define V_ZERO() _mm256_setzero_ps()
#define V_SET1(f) _mm256_set1_ps(f)
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_LOADU(p) _mm256_loadu_ps(p)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_SUB(a, b) _mm256_sub_ps(a, b)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_FMSUB(a, b, c) _mm256_fmsub_ps(a, b, c)
#define V_CVT(v) _mm256_cvtepi32_ps(v)
#define V_EXPAND4(s4, idx) _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s4), idx)
#define V_HSUM(v) hsum_avx2(v)
#define V_HSUM4(a, b, c, d) hsum4_avx2(a, b, c, d)
/* Nibble j of each lane as a float (the top one needs no mask); the table is AVX-512's. */
#define V_PLANE(w, j, lut)                                                                                   \
    ((j) == 7 ? V_CVT(VI_SRLI(w, 28)) : V_CVT(VI_AND((j) ? VI_SRLI(w, 4 * (j)) : (w), VI_SET1(15))))
/* The GEMV's plane j: nibbles 1-6 masked in place, u * 16^j, exact in fp32, against inputs stored times
   16^-j (convert_row, M = 1): no shift, so 2 of the 3 port-0/1 operations per 8 weights (mask, convert,
   FMA: the AVX2 GEMV is bound by them) where the shifted form takes 3; the same products to the bit. */
#define V_PLANE_GEMV(w, j, lut)                                                                              \
    ((j) == 7 ? V_CVT(VI_SRLI(w, 28)) : V_CVT(VI_AND(w, VI_SET1(15 << (4 * (j))))))
#define V_NIBBLE_LUT() _mm256_setzero_ps()
#define VI_SET1(i) _mm256_set1_epi32(i)
#define VI_LOADU(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI_LOAD_FIRST(p, n)                                                                                  \
    _mm256_maskload_epi32((const int *)(p),                                                                  \
                          _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))
#define VI_AND(a, b) _mm256_and_si256(a, b)
#define VI_SRLI(v, i) _mm256_srli_epi32(v, i)
#define V_LOAD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define V_LOAD_W16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
TARGET static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
/* [sum(a), sum(b), sum(c), sum(d)] */
TARGET static inline __m128 hsum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#include "_linear_simd.h"
#include "_w8a16_simd.h"
#undef ISA
#undef TARGET
#undef L
#undef VF
#undef VI
#undef V_ZERO
#undef V_SET1
#undef V_LOAD
#undef V_LOADU
#undef V_ADD
#undef V_SUB
#undef V_MUL
#undef V_FMA
#undef V_FMSUB
#undef V_CVT
#undef V_EXPAND4
#undef V_HSUM
#undef V_HSUM4
#undef V_PLANE
#undef V_PLANE_GEMV
#undef V_NIBBLE_LUT
#undef VI_SET1
#undef VI_LOADU
#undef VI_LOAD_FIRST
#undef VI_AND
#undef VI_SRLI
#undef V_LOAD_I8
#undef V_LOAD_W16

#define ISA avx512
#define TARGET TARGET_AVX512
#define L 16
#define VF __m512
#define VI __m512i
#define V_ZERO() _mm512_setzero_ps()
#define V_SET1(f) _mm512_set1_ps(f)
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_LOADU(p) _mm512_loadu_ps(p)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_SUB(a, b) _mm512_sub_ps(a, b)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_FMSUB(a, b, c) _mm512_fmsub_ps(a, b, c)
#define V_EXPAND4(s4, idx) _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(s4))
#define V_HSUM(v) _mm512_reduce_add_ps(v)
#define V_HSUM4(a, b, c, d)                                                                                  \
    hsum4_avx2(half_sum_avx512(a), half_sum_avx512(b), half_sum_avx512(c), half_sum_avx512(d))
/* Nibble j of each lane as a float: vpermps reads the index's low 4 bits, so no mask and no convert. */
#define V_PLANE(w, j, lut) _mm512_permutexvar_ps((j) ? VI_SRLI(w, 4 * (j)) : (w), lut)
#define V_PLANE_GEMV V_PLANE
#define V_NIBBLE_LUT() _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define VI_SET1(i) _mm512_set1_epi32(i)
#define VI_LOADU(p) _mm512_loadu_si512((const void *)(p))
#define VI_LOAD_FIRST(p, n) _mm512_maskz_loadu_epi32((1u << (n)) - 1u, (const void *)(p))
#define VI_SRLI(v, i) _mm512_srli_epi32(v, i)
#define V_LOAD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define V_LOAD_W16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
TARGET static inline __m256 half_sum_avx512(__m512 v) { /* the two 256-bit halves added */
    __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(v), high);
}
#include "_linear_simd.h"
#include "_w8a16_simd.h"
#undef ISA
#undef TARGET
#define ISA bf16 /* gemm_bf16: _linear_gemm.h's loop on AVX-512's vector macros */
#define TARGET TARGET_AVX512BF16
#include "_linear_bf16.h"
#include "_w8a16_bf16.h"
#include "_linear_vnni.h"
#endif
#ifdef KVQ_AMX
#include "_linear_amx.h"
#endif

#ifdef KVQ_AMX
static int amx_state; /* AMX-TILE and AMX-BF16 in cpuid, and the kernel's permission to use the tile data */

static void amx_probe(void) {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 22)))
        return;
    /* Linux hands out AMX's 8 KiB of tile state only on request: ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
       (once per process, for all its threads; a kernel without AMX support refuses) */
    amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

static int amx_permitted(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, amx_probe);
    return amx_state;
}
#endif

static int isa_supported(int isa) {
    if (isa == ISA_SCALAR)
        return 1;
#if defined(KVQ_SIMDE_CHECK)
    return isa != ISA_AMX;
#elif defined(KVQ_X86)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == ISA_AVX2)
        return avx2;
    int avx512 = avx2 && __builtin_cpu_supports("avx512f");
    if (isa == ISA_AVX512)
        return avx512;
    int avx512bf16 = avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                     __builtin_cpu_supports("avx512bf16") &&
                     __builtin_cpu_supports("avx512vnni"); /* Job.vnni's (every AVX512_BF16 CPU has VNNI) */
    if (isa == ISA_AVX512BF16)
        return avx512bf16;
#ifdef KVQ_AMX
    if (isa == ISA_AMX)
        return avx512bf16 && __builtin_cpu_supports("avx512vl") && amx_permitted();
#endif
#endif
    return 0;
}

/* A caller's isa code that this build and CPU run: 1, else 0 with a ValueError set. */
static int isa_checked(int isa) {
    if (isa >= ISA_SCALAR && isa <= ISA_AMX && isa_supported(isa))
        return 1;
    PyErr_Format(PyExc_ValueError, "isa %d is not runnable on this CPU (see isas())", isa);
    return 0;
}

/* Activations and output fp32, bf16 or fp16, scales fp32 or bf16 (gemm's and gemm_w8's dtype codes): 1, else
   0 with a ValueError set. */
static int dtypes_checked(int x_dtype, int scale_dtype, int y_dtype) {
    if (x_dtype >= 0 && x_dtype <= 2 && y_dtype >= 0 && y_dtype <= 2 &&
        (scale_dtype == DTYPE_F32 || scale_dtype == DTYPE_BF16))
        return 1;
    PyErr_Format(PyExc_ValueError, "bad dtype codes x=%d scale=%d y=%d", x_dtype, scale_dtype, y_dtype);
    return 0;
}

/* Output rows [n0, n1) of chunk `chunk` of `num_chunks` over N rows, in whole tiles of `tile` rows; 0
   when empty. */
static int chunk_rows(int64_t N, int64_t tile, int64_t chunk, int64_t num_chunks, int64_t *n0, int64_t *n1) {
    int64_t tiles = (N + tile - 1) / tile;
    *n0 = tiles * chunk / num_chunks * tile;
    *n1 = tiles * (chunk + 1) / num_chunks * tile;
    *n1 = *n1 < N ? *n1 : N;
    return *n0 < *n1;
}

/* Output rows per chunk unit: AMX's 16-row strips, else the 4-row tiles of the other paths. */
static int64_t row_tile(int isa) { return isa == ISA_AMX ? 16 : 4; }

/* The job's path on output rows [n0, n1): its ISA's copy of `simd` (simd_avx2, simd_avx512: _linear_simd.h,
   _w8a16_simd.h), `bf16` on avx512bf16, `scalar` on the scalar path (and every path of a build without x86
   kernels, where isa_supported lets only the scalar one through). W4A16's and W8A16's row tasks. */
#ifdef KVQ_X86
#define RUN_PATH(job, n0, n1, simd, bf16, scalar)                                                                \
    ((job)->isa == ISA_AVX2         ? simd##_avx2(job, n0, n1)                                                   \
     : (job)->isa == ISA_AVX512     ? simd##_avx512(job, n0, n1)                                                 \
     : (job)->isa == ISA_AVX512BF16 ? bf16(job, n0, n1)                                                          \
                                    : scalar(job, n0, n1))

/* avx512bf16's W4A16 kernels: bf16 activations as VNNI integer sums (Job.vnni) or vdpbf16ps pairs, by M. */
static void rows_bf16(const Job *job, int64_t n0, int64_t n1) {
    if (job->vnni && job->M == 1)
        gemv_vnni(job, n0, n1);
    else if (job->vnni)
        gemm_vnni(job, n0, n1);
    else if (job->M == 1)
        gemv_bf16(job, n0, n1);
    else
        gemm_bf16(job, n0, n1);
}
#else
#define RUN_PATH(job, n0, n1, simd, bf16, scalar) scalar(job, n0, n1)
#endif

static void rows_task(void *ctx, int64_t chunk, int64_t num_chunks) {
    Job *job = (Job *)ctx;
    int64_t n0, n1;
    if (!chunk_rows(job->N, row_tile(job->isa), chunk, num_chunks, &n0, &n1))
        return;
#ifdef KVQ_AMX
    if (job->isa == ISA_AMX) {
        gemm_amx(job, n0, n1);
        return;
    }
#endif
    RUN_PATH(job, n0, n1, run, rows_bf16, scalar_rows);
}

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;
static float *scratch;
static size_t scratch_floats;

/* Runs a checked job under call_lock: activations into fp32 scratch, then the rows over the threads. */
/* The fp32 activation scratch, grown to `floats` (+16 for the SIMD tails); NULL when out of memory. */
static float *scratch_of(size_t floats) {
    size_t need = floats + 16;
    if (need > scratch_floats) {
        free(scratch);
        scratch_floats = 0;
        if (posix_memalign((void **)&scratch, 64, need * sizeof(float)) != 0) {
            scratch = NULL;
            return NULL;
        }
        scratch_floats = need;
    }
    return scratch;
}

static int run_job(Job *job, int threads) {
    const int64_t rows = xp_rows(job);
    job->xp = scratch_of((size_t)(rows * job->xp_stride));
    if (job->xp == NULL)
        return -1;
    int64_t work = job->M * job->N * job->K, useful = work / MIN_WORK_PER_THREAD;
    int nt = useful < threads ? (int)(useful > 1 ? useful : 1) : threads;
    int64_t tiles = (job->N + row_tile(job->isa) - 1) / row_tile(job->isa);
    int64_t chunks = nt > 1 ? (int64_t)nt * CHUNKS_PER_THREAD : 1; /* one thread: one pipeline (amx) */
    if (job->M * job->K > 65536)
        run_parallel(convert_task, job, chunks < rows ? chunks : rows, nt);
    else
        convert_task(job, 0, 1);
    run_parallel(rows_task, job, chunks < tiles ? chunks : tiles, nt);
    return atomic_load(&job->failed) ? -1 : 0;
}

/* run_job without the GIL, under call_lock (calls from several threads take turns): None, or MemoryError. */
static PyObject *run_job_released(Job *job, int threads) {
    int status;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&call_lock);
    status = run_job(job, threads < 1 ? 1 : threads);
    pthread_mutex_unlock(&call_lock);
    Py_END_ALLOW_THREADS;
    if (status < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Whether avx512bf16 (and amx below AMX_FROM_ROWS) multiplies bf16 activations as fixed point on VNNI
   integer sums (_linear_vnni.h, 1) or as vdpbf16ps pairs (gemv_bf16, gemm_bf16, 0): $KVQ_CPU_DOT = vnni
   or bf16, else vnni on Intel CPUs, where vdpbf16ps issues once per two cycles (Sapphire / Emerald Rapids:
   the VNNI GEMV measured 1.34-1.68x, the GEMM 1.35-1.49x), and bf16 on others (AMD Zen 4 issues either
   instruction once per cycle per 512-bit vector, so the 4 vdpbf16ps per block should beat VNNI's 6; not
   measured). -1 (a ValueError set) for another value. Called with the GIL. */
static int vnni_wanted(void) {
    const char *choice = getenv("KVQ_CPU_DOT");
    if (choice != NULL && choice[0] != '\0') {
        if (strcmp(choice, "vnni") == 0 || strcmp(choice, "bf16") == 0)
            return choice[0] == 'v';
        PyErr_Format(PyExc_ValueError, "$KVQ_CPU_DOT is '%s'; expected vnni, bf16 or unset (by CPU)", choice);
        return -1;
    }
    static int is_intel = -1; /* cpuid once: under a hypervisor it traps */
#if defined(KVQ_X86) && !defined(KVQ_SIMDE_CHECK)
    if (is_intel < 0) {
        unsigned eax, ebx, ecx, edx; /* "GenuineIntel" */
        is_intel = __get_cpuid(0, &eax, &ebx, &ecx, &edx) && ebx == 0x756e6547u && edx == 0x49656e69u &&
                   ecx == 0x6c65746eu;
    }
#endif
    return is_intel > 0;
}

static PyObject *dot(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    int wanted = vnni_wanted();
    return wanted < 0 ? NULL : PyUnicode_FromString(wanted ? "vnni" : "bf16");
}

static PyObject *gemm(PyObject *self, PyObject *args) {
    (void)self;
    int isa, threads, x_dtype, scale_dtype, group, y_dtype, vnni;
    unsigned long long x, packed, scale, y;
    long long M, K, N;
    if (!PyArg_ParseTuple(args, "iiKiLLKKiLiKip", &isa, &threads, &x, &x_dtype, &M, &K, &packed, &scale,
                          &scale_dtype, &N, &group, &y, &y_dtype, &vnni))
        return NULL;
    if (!isa_checked(isa))
        return NULL;
    if (isa == ISA_AMX && (M < 2 || x_dtype != DTYPE_BF16))
        isa = ISA_AVX512BF16; /* its GEMV, and other activations, are the AVX-512 BF16 path's */
    if (isa == ISA_AVX512BF16 && x_dtype != DTYPE_BF16)
        isa = ISA_AVX512; /* other activations are the AVX-512 path's */
    if ((group != 32 && group != 64 && group != 128) || M < 0 || N < 0 || K <= 0 || K % group)
        return PyErr_Format(PyExc_ValueError, "bad shape M=%lld N=%lld K=%lld group=%d", M, N, K, group);
    if (!dtypes_checked(x_dtype, scale_dtype, y_dtype))
        return NULL;
    if (M == 0 || N == 0)
        Py_RETURN_NONE;
    if (isa != ISA_AVX512BF16)
        vnni = 0; /* the caller's choice (`dot()` at load), for avx512bf16's bf16 activations only */
    Job job = {
        .isa = isa,
        .vnni = vnni,
        .weight_bits = 4,
        .group = group,
        .group_shift = group == 32 ? 5 : group == 64 ? 6 : 7,
        .x_dtype = x_dtype,
        .scale_dtype = scale_dtype,
        .y_dtype = y_dtype,
        .scale_size = scale_dtype == DTYPE_F32 ? 4 : 2,
        .M = M,
        .K = K,
        .N = N,
        .num_groups = K / group,
        .xp_stride = xp_stride_of(isa, K, vnni),
        .x = (const void *)(uintptr_t)x,
        .packed = (const int32_t *)(uintptr_t)packed,
        .scale = (const uint8_t *)(uintptr_t)scale,
        .y = (void *)(uintptr_t)y,
    };
    return run_job_released(&job, threads);
}

#include "_w8a16.h"
#include "_dense_amx.h"
#include "_linear_dequant.h"
#ifdef KVQ_X86
#include "_w4a8.h"
#endif

static PyObject *isas(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    static const char *names[] = {"scalar", "avx2", "avx512", "avx512bf16", "amx"};
    const char *runnable[5];
    Py_ssize_t count = 0;
    for (int isa = ISA_SCALAR; isa <= ISA_AMX; isa++)
        if (isa_supported(isa))
            runnable[count++] = names[isa];
    PyObject *out = PyTuple_New(count);
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        PyObject *name = PyUnicode_FromString(runnable[i]);
        if (name == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, name);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"gemm", gemm, METH_VARARGS, "y = x @ dequantize(weight_packed, weight_scale)^T (see the module source)."},
    {"gemm_w8", gemm_w8, METH_VARARGS, "y = x @ (w * scale[:, None])^T for int8 w (see _w8a16.h)."},
    {"gemm_dense", gemm_dense, METH_VARARGS, "y = x @ w^T for bf16 w on AMX tiles (see _dense_amx.h)."},
    {"gemv_dense", gemv_dense, METH_VARARGS, "y = x @ w^T for one bf16 row x and a bf16 w (see _w8a16.h)."},
    {"dequantize", dequantize, METH_VARARGS, "out = bf16(q * scale), the weight as bf16 (see _linear_dequant.h)."},
#ifdef KVQ_X86
    {"gemm_w4a8", gemm_w4a8, METH_VARARGS, "y = x @ (q * scale)^T with x as int8 per chunk (see _w4a8.h)."},
    {"w4a8_paths", w4a8_paths, METH_NOARGS, "Whether gemm_w4a8's (AVX-512 VNNI, AVX2) kernels run here."},
#endif
    {"isas", isas, METH_NOARGS, "The kernel paths this CPU can run, by code: ('scalar', 'avx2', ...)."},
    {"dot", dot, METH_NOARGS, "How avx512bf16 multiplies bf16 activations here ($KVQ_CPU_DOT): 'vnni' or 'bf16'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_linear", .m_doc = "W4A16, W8A16, W4A8, W8A8 and dense AMX GEMV/GEMM on CPU.", .m_size = -1,
    .m_methods = methods,
};

static void forget_after_fork(void) { /* a forked child has one thread and no call in flight */
    pthread_mutex_init(&call_lock, NULL);
    pool_forget_after_fork();
}

/* The worker threads lent to the other CPU extension (_ops' decode attention) through the capsule
   `_parallel_for` (see kvq_parallel_for in _ops.c): one pool, so two kinds of calls never have two
   sets of threads spinning against each other. Called without the GIL; serialized with the kernels. */
static void parallel_for(task_fn fn, void *ctx, int64_t num_chunks, int nt) {
    pthread_mutex_lock(&call_lock);
    run_parallel(fn, ctx, num_chunks, nt);
    pthread_mutex_unlock(&call_lock);
}

PyMODINIT_FUNC PyInit__linear(void) {
    pthread_atfork(NULL, NULL, forget_after_fork);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *capsule = PyCapsule_New((void *)parallel_for, "kvq.runtime.kernels.cpu._linear._parallel_for", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_parallel_for", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

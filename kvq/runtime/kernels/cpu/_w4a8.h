/* W4A8 on CPU (opt-in: EngineConfig.int4_compute = "w4a8"): the INT4 weight times activations quantized to
   int8 per row and chunk of C = min(group, 64) inputs, in exact integer sums; and W8A8, the same kernels
   over 8-bit weights (`wide`: the INT8 lm_head copy under int4_compute "w4a8"). Included by _linear.c
   after the W4A16 paths (their pool, scratch and stores); the kernels are _w4a8_vnni.h (AVX-512 VNNI)
   and _w4a8_avx2.h (AVX2: any x86-64 CPU of the last decade), each with _w4a8_isa.h's loops around it.

   Why: a W4A16 product costs one bf16 multiply-add per weight and activation row (vdpbf16ps: 32 a cycle
   on a Zen 4 core, the same as oneDNN's BF16 GEMM, so INT4 cannot outrun BF16 there once the batch is
   compute-bound; fp32 FMAs on AVX2, 16 a cycle), where vpdpbusd does 64 u8 x s8 products a cycle,
   exactly, and AVX2's vpmaddubsw 32 (twice). Activations in int8 are a different numeric (llama.cpp's Q8
   activations; vLLM's and SGLang's W4A8): opt-in, its cost measured by `kvq eval`.

   Activations (w4a8_convert_row_*): per row m and chunk c, amax = max |x|, xq = rint(x * (127 / amax)) in
   -127..127, xs = amax / 127 (fp32; all zero for an all-zero chunk; NaN for a chunk holding inf or NaN),
   and the chunk's seed -z * sum(xq) (z: the weights' zero point, 8 or 128).
   Weights (kvq.runtime.kernels.cpu.w4a8.w4a8_pack, once at load): tiles of 16 output rows, one per 32-bit
   lane; per tile and chunk, C / 8 vectors of 64 bytes: byte 4l + j of vector v holds, for the tile's row
   l, u = q + 8 of input 4v + j (low nibble) and of input 4(v + C / 8) + j (high nibble) of the chunk. So
   a vector's low (high) nibbles times the 4 inputs of step v (v + C / 8), broadcast to every lane, sum to
   each row's u * xq over the step, and over the chunk to the row's int32 sum, seeded so that it is the
   sum of q * xq, exact (|sum| < 2^17). Then y[m, row] += float(sum) * (scale(row, g) * xs[m, c]) in
   fp32 (g: chunk c's group; the scales kept one column per group, as stored): no horizontal sums, 16
   outputs per tile. Stacked experts are one such layout per expert (the caller passes the expert's).
   8-bit weights (w8a8_pack, `wide`): u = q + 128, one byte a weight, C / 4 vectors per chunk: byte 4l + j
   of vector v holds row l's input 4v + j; vpdpbusd takes a vector as it is (vectors v and v + C / 8 in the
   places of the low and high nibbles above); AVX2's vpmaddubsw, whose int16 pairs 255 * 127 * 2 would
   overflow, takes the two nibbles of u = 16h + l apart and adds 16 times the high ones' sums (|sum| <
   2^20, exact in fp32 too). Results do not depend on the path or the thread count (the same integer sums,
   the same fp32 operations in the same order). */

#define W4A8_ROWS 16 /* output rows per tile: one per lane */
#define W4A8_MB 64   /* activation rows per pass over a tile (their fp32 sums: 4 KiB on the stack) */

typedef struct {
    int64_t M, K, N, tiles, chunks, xp_stride, groups, chunks_per_group; /* groups: scale columns */
    int C, x_dtype, y_dtype;
    const void *x;
    const uint8_t *w;    /* [tiles][chunks][C / 8 or C / 4 (wide)][64] */
    const void *scales; /* [tiles][groups][16], fp32 or bf16 (scale_bf16) as the checkpoint stores them */
    int scale_bf16;
    int avx2; /* the AVX2 kernel (_w4a8_avx2.h), else AVX-512 VNNI's */
    int wide; /* 8-bit weights (zero point 128, C / 4 vectors per chunk), else 4-bit (zero point 8, C / 8) */
    void *y;
    uint8_t *xp; /* per row: xs [chunks] fp32, seeds [chunks] int32, xq [K] int8 */
} W4A8Job;

static inline int64_t w4a8_xp_stride(int64_t K, int64_t chunks) { /* bytes, a multiple of 64 */
    return (8 * chunks + K + 63) / 64 * 64;
}

/* The largest of n lanes of |x| from 0 (a NaN lane loses: the chunk's amax is not used then). */
static inline float w4a8_max_lanes(const float *lanes, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++)
        amax = lanes[i] > amax ? lanes[i] : amax;
    return amax;
}

static inline int32_t w4a8_sum_lanes(const int32_t *lanes, int n) {
    int32_t total = 0;
    for (int i = 0; i < n; i++)
        total += lanes[i];
    return total;
}

/* Where chunk c's 16 scales of tile t (its group's column) start in job->scales, in elements. */
static inline int64_t w4a8_scale_index(const W4A8Job *job, int64_t t, int64_t c) {
    return (t * job->groups + c / job->chunks_per_group) * 16;
}

#include "_w4a8_vnni.h"
#define W4A8_ISA vnni
#define W4A8_TARGET TARGET_AVX512VNNI
#include "_w4a8_isa.h"
#undef W4A8_ISA
#undef W4A8_TARGET
#include "_w4a8_avx2.h"
#define W4A8_ISA avx2
#define W4A8_TARGET TARGET_AVX2
#include "_w4a8_isa.h"
#undef W4A8_ISA
#undef W4A8_TARGET

static void w4a8_convert_task(void *ctx, int64_t chunk, int64_t num_chunks) {
    W4A8Job *job = (W4A8Job *)ctx;
    for (int64_t m = job->M * chunk / num_chunks; m < job->M * (chunk + 1) / num_chunks; m++)
        if (job->avx2)
            w4a8_convert_row_avx2(job, m);
        else
            w4a8_convert_row_vnni(job, m);
}

static void w4a8_rows_task(void *ctx, int64_t chunk, int64_t num_chunks) {
    const W4A8Job *job = (const W4A8Job *)ctx;
    const int64_t t0 = job->tiles * chunk / num_chunks, t1 = job->tiles * (chunk + 1) / num_chunks;
    if (job->avx2)
        w4a8_tiles_avx2(job, t0, t1);
    else
        w4a8_tiles_vnni(job, t0, t1);
}

/* Whether the AVX-512 VNNI kernel (path 0: AVX-512 F, BW, VL and VNNI: Ice Lake, Zen 4 and later) or the
   AVX2 one (path 1: AVX2 + FMA) runs on this CPU. */
static int w4a8_supported(int avx2) {
#if defined(KVQ_SIMDE_CHECK)
    (void)avx2;
    return 1;
#else
    __builtin_cpu_init();
    if (avx2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
}

static PyObject *w4a8_paths(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(OO)", w4a8_supported(0) ? Py_True : Py_False, w4a8_supported(1) ? Py_True : Py_False);
}

static PyObject *gemm_w4a8(PyObject *self, PyObject *args) {
    (void)self;
    int avx2, threads, x_dtype, wide, chunk, y_dtype, scale_dtype;
    unsigned long long x, w, scales, y;
    long long M, K, N, groups;
    if (!PyArg_ParseTuple(args, "iiKiLLiKKiLLiKi", &avx2, &threads, &x, &x_dtype, &M, &K, &wide, &w, &scales,
                          &scale_dtype, &groups, &N, &chunk, &y, &y_dtype))
        return NULL;
    if (!w4a8_supported(avx2))
        return PyErr_Format(PyExc_ValueError, "the W4A8 %s kernel does not run on this CPU (see w4a8_paths())",
                            avx2 ? "AVX2" : "AVX-512 VNNI");
    if ((chunk != 32 && chunk != 64) || M < 0 || N < 0 || K <= 0 || K % chunk || groups <= 0 ||
        (K / chunk) % groups)
        return PyErr_Format(PyExc_ValueError, "bad shape M=%lld N=%lld K=%lld chunk=%d groups=%lld", M, N, K, chunk,
                            groups);
    if ((x_dtype != DTYPE_F32 && x_dtype != DTYPE_BF16) || (y_dtype != DTYPE_F32 && y_dtype != DTYPE_BF16) ||
        (scale_dtype != DTYPE_F32 && scale_dtype != DTYPE_BF16))
        return PyErr_Format(PyExc_ValueError, "bad dtype codes x=%d scale=%d y=%d", x_dtype, scale_dtype,
                            y_dtype);
    if (M == 0 || N == 0)
        Py_RETURN_NONE;
    const int64_t chunks = K / chunk;
    W4A8Job job = {
        .M = M, .K = K, .N = N, .tiles = (N + W4A8_ROWS - 1) / W4A8_ROWS, .chunks = chunks,
        .xp_stride = w4a8_xp_stride(K, chunks), .groups = groups, .chunks_per_group = chunks / groups,
        .C = chunk, .x_dtype = x_dtype, .y_dtype = y_dtype,
        .x = (const void *)(uintptr_t)x, .w = (const uint8_t *)(uintptr_t)w,
        .scales = (const void *)(uintptr_t)scales, .scale_bf16 = scale_dtype == DTYPE_BF16,
        .y = (void *)(uintptr_t)y, .avx2 = avx2 != 0, .wide = wide != 0,
    };
    int status = 0;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&call_lock);
    job.xp = (uint8_t *)scratch_of((size_t)(M * job.xp_stride / 4));
    if (job.xp == NULL)
        status = -1;
    else {
        int64_t useful = M * N * K / MIN_WORK_PER_THREAD;
        int nt = threads < 1 ? 1 : threads;
        nt = useful < nt ? (int)(useful > 1 ? useful : 1) : nt;
        int64_t parts = nt > 1 ? (int64_t)nt * CHUNKS_PER_THREAD : 1;
        run_parallel(w4a8_convert_task, &job, parts < M ? parts : M, nt);
        run_parallel(w4a8_rows_task, &job, parts < job.tiles ? parts : job.tiles, nt);
    }
    pthread_mutex_unlock(&call_lock);
    Py_END_ALLOW_THREADS;
    if (status < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

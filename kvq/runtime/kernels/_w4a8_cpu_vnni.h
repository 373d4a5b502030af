/* W4A8 on AVX-512 VNNI (opt-in: EngineConfig.cpu_int8_activations): the INT4 weight times activations
   quantized to int8 per row and chunk of C = min(group, 64) inputs, in exact integer sums. Included by
   _w4a16_cpu.c after the W4A16 paths (their pool, scratch and stores).

   Why: a W4A16 product costs one bf16 multiply-add per weight and activation row (vdpbf16ps: 32 a cycle
   on a Zen 4 core, the same as oneDNN's BF16 GEMM, so INT4 cannot outrun BF16 there once the batch is
   compute-bound), where vpdpbusd does 64 u8 x s8 products a cycle, exactly. Activations in int8 are a
   different numeric (llama.cpp's Q8 activations; vLLM's and SGLang's W4A8): opt-in, its cost measured by
   `kvq eval`.

   Activations (w4a8_convert_row): per row m and chunk c, amax = max |x|, xq = rint(x * (127 / amax)) in
   -127..127, xs = amax / 127 (fp32; all zero for an all-zero chunk; NaN for a chunk holding inf or NaN).
   Weights (kvq.runtime.kernels.w4a8_cpu.w4a8_pack, once at load): tiles of 16 output rows, one per lane;
   per tile and chunk, C / 8 vectors of 64 bytes: byte 4l + j of vector v holds, for the tile's row l, u =
   q + 8 of input 4v + j (low nibble) and of input 4(v + C / 8) + j (high nibble) of the chunk. So a
   vector's low (high) nibbles times the 4 inputs of step v (v + C / 8), broadcast to every lane, is one
   vpdpbusd: each lane's sum of u * xq over the chunk in int32, seeded with -8 * sum(xq) (so it is the sum
   of q * xq), exact (|sum| < 2^17). Then y[m, row] += float(sum) * (scale(row, c) * xs[m, c]) in fp32:
   no horizontal sums, and 16 outputs per vector. The tile's weights are unpacked once per chunk and
   pass W4A8_MB activation rows, four at a time, two chains each (vpdpbusd's latency). */

#define W4A8_ROWS 16 /* output rows per tile: one per lane */
#define W4A8_MB 64   /* activation rows per pass over a tile (their fp32 sums: 4 KiB on the stack) */

typedef struct {
    int64_t M, K, N, tiles, chunks, xp_stride;
    int C, x_dtype, y_dtype;
    const void *x;
    const uint8_t *w;    /* [tiles][chunks][C / 8][64] */
    const void *scales; /* [tiles][chunks][16], fp32 or bf16 (scale_bf16) as the checkpoint stores them */
    int scale_bf16;
    void *y;
    uint8_t *xp; /* per row: xs [chunks] fp32, seeds [chunks] int32, xq [K] int8 */
} W4A8Job;

static inline int64_t w4a8_xp_stride(int64_t K, int64_t chunks) { /* bytes, a multiple of 64 */
    return (8 * chunks + K + 63) / 64 * 64;
}

/* 16 activations of row m from input k as fp32 (bf16 or fp32 activations). */
TARGET_AVX512VNNI static inline __m512 w4a8_load_x(const W4A8Job *job, int64_t m, int64_t k) {
    const int64_t i = m * job->K + k;
    if (job->x_dtype == DTYPE_F32)
        return _mm512_loadu_ps((const float *)job->x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)job->x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Row m's chunks quantized (see the top of this file) into its xp row. */
TARGET_AVX512VNNI static void w4a8_convert_row(const W4A8Job *job, int64_t m) {
    uint8_t *row = job->xp + m * job->xp_stride;
    float *xs = (float *)row;
    int32_t *seeds = (int32_t *)(row + 4 * job->chunks);
    int8_t *xq = (int8_t *)(row + 8 * job->chunks);
    for (int64_t c = 0; c < job->chunks; c++) {
        const int64_t k0 = c * job->C;
        __m512 top = _mm512_setzero_ps();
        unsigned special = 0; /* lanes that saw inf or NaN */
        for (int64_t k = k0; k < k0 + job->C; k += 16) {
            const __m512 a = _mm512_abs_ps(w4a8_load_x(job, m, k));
            special |= (unsigned)_mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
            top = _mm512_max_ps(a, top);
        }
        float lanes[16], amax = 0.0f;
        _mm512_storeu_ps(lanes, top);
        for (int i = 0; i < 16; i++)
            amax = lanes[i] > amax ? lanes[i] : amax;
        const float inv = amax > 0.0f && !special ? 127.0f / amax : 0.0f;
        xs[c] = special ? NAN : amax / 127.0f;
        __m512i sum = _mm512_setzero_si512();
        for (int64_t k = k0; k < k0 + job->C; k += 16) {
            __m512 scaled = _mm512_mul_ps(w4a8_load_x(job, m, k), _mm512_set1_ps(inv));
            __m512i q = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(xq + k), _mm512_cvtepi32_epi8(q));
            sum = _mm512_add_epi32(sum, q);
        }
        int32_t sums[16], total = 0;
        _mm512_storeu_si512(sums, sum);
        for (int i = 0; i < 16; i++)
            total += sums[i];
        seeds[c] = -8 * total;
    }
}

static void w4a8_convert_task(void *ctx, int64_t chunk, int64_t num_chunks) {
    W4A8Job *job = (W4A8Job *)ctx;
    for (int64_t m = job->M * chunk / num_chunks; m < job->M * (chunk + 1) / num_chunks; m++)
        w4a8_convert_row(job, m);
}

/* 16 fp32 as bf16 bits, rounded to nearest even, NaN kept quiet. */
TARGET_AVX512VNNI static inline __m256i w4a8_bf16_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v), odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i bits = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(bits);
}

/* y[m, n0 .. n0 + lanes) = v in fp32 or bf16 (lanes <= 16: the last tile's rows past N are not stored). */
TARGET_AVX512VNNI static inline void w4a8_store(const W4A8Job *job, int64_t m, int64_t n0, __m512 v) {
    const int64_t lanes = job->N - n0 < 16 ? job->N - n0 : 16, size = job->y_dtype == DTYPE_F32 ? 4 : 2;
    uint8_t *out = (uint8_t *)job->y + (m * job->N + n0) * size, tail[64];
    uint8_t *to = lanes == 16 ? out : tail;
    if (job->y_dtype == DTYPE_F32)
        _mm512_storeu_ps(to, v);
    else
        _mm256_storeu_si256((__m256i *)to, w4a8_bf16_bits(v));
    if (lanes < 16)
        memcpy(out, tail, (size_t)(lanes * size));
}

/* acc + the lanes' u8 x s8 products of w and the 4 int8 at p broadcast to every lane: vpdpbusd with its
   broadcast folded into the instruction (GCC 12 loads it into a register first, an extra operation). */
TARGET_AVX512VNNI static inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t *p) {
#if defined(KVQ_SIMDE_CHECK)
    int32_t x;
    memcpy(&x, p, 4);
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x));
#else
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
#endif
}

/* One activation row's int32 sums over a chunk (xr: its xq from the chunk's first input), two chains. */
TARGET_AVX512VNNI static inline __attribute__((always_inline)) __m512i w4a8_row_sums(const __m512i *lo,
                                                                                  const __m512i *hi,
                                                                                  const int8_t *xr,
                                                                                  int32_t seed, int nv) {
    __m512i a = _mm512_set1_epi32(seed), b = _mm512_setzero_si512();
    for (int v = 0; v < nv; v++) {
        a = dpbusd_broadcast(a, lo[v], xr + 4 * v);
        b = dpbusd_broadcast(b, hi[v], xr + 4 * (v + nv));
    }
    return _mm512_add_epi32(a, b);
}

/* Tile t (output rows 16t ..) for activation rows [m0, m0 + mb): nv = C / 8 vectors per chunk. */
TARGET_AVX512VNNI static inline __attribute__((always_inline)) void w4a8_tile(const W4A8Job *job, int64_t t,
                                                                           int64_t m0, int64_t mb, int nv) {
    const uint8_t *wt = job->w + t * job->chunks * nv * 64;

    __m512 acc[W4A8_MB];
    for (int64_t r = 0; r < mb; r++)
        acc[r] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int64_t c = 0; c < job->chunks; c++) {
        __m512i lo[8], hi[8];
        for (int v = 0; v < nv; v++) {
            const __m512i w = _mm512_loadu_si512(wt + (c * nv + v) * 64);
            lo[v] = _mm512_and_si512(w, nibble);
            hi[v] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
        }
        __builtin_prefetch(wt + (c * nv + nv) * 64 + GEMV_PREFETCH_BYTES, 0, 3);
        const int64_t sc = (t * job->chunks + c) * 16;
        const __m512 ws = job->scale_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                                _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                    (const __m256i *)((const uint16_t *)job->scales + sc))),
                                                16))
                                          : _mm512_loadu_ps((const float *)job->scales + sc);
        for (int64_t r = 0; r < mb; r += 4) { /* four rows' chains side by side (a short last group) */
            __m512i s[4];
            const int64_t n = mb - r < 4 ? mb - r : 4;
            for (int64_t i = 0; i < n; i++) {
                const uint8_t *row = job->xp + (m0 + r + i) * job->xp_stride;
                const int8_t *xr = (const int8_t *)(row + 8 * job->chunks) + c * job->C;
                s[i] = w4a8_row_sums(lo, hi, xr, ((const int32_t *)(row + 4 * job->chunks))[c], nv);
            }
            for (int64_t i = 0; i < n; i++) {
                const float xs = ((const float *)(job->xp + (m0 + r + i) * job->xp_stride))[c];
                acc[r + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(ws, _mm512_set1_ps(xs)),
                                             acc[r + i]);
            }
        }
    }
    for (int64_t r = 0; r < mb; r++)
        w4a8_store(job, m0 + r, t * W4A8_ROWS, acc[r]);
}

TARGET_AVX512VNNI static void w4a8_tiles(const W4A8Job *job, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
        for (int64_t m0 = 0; m0 < job->M; m0 += W4A8_MB) {
            const int64_t mb = job->M - m0 < W4A8_MB ? job->M - m0 : W4A8_MB;
            if (job->C == 64)
                w4a8_tile(job, t, m0, mb, 8);
            else
                w4a8_tile(job, t, m0, mb, 4);
        }
}

static void w4a8_rows_task(void *ctx, int64_t chunk, int64_t num_chunks) {
    const W4A8Job *job = (const W4A8Job *)ctx;
    w4a8_tiles(job, job->tiles * chunk / num_chunks, job->tiles * (chunk + 1) / num_chunks);
}

/* AVX-512 F, BW, VL and VNNI (Ice Lake, Zen 4 and later): what the kernel above is compiled for. */
static int w4a8_supported(void) {
#if defined(KVQ_SIMDE_CHECK)
    return 1;
#else
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
}

static PyObject *w4a8_runnable(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(w4a8_supported());
}

static PyObject *gemm_w4a8(PyObject *self, PyObject *args) {
    (void)self;
    int threads, x_dtype, chunk, y_dtype, scale_dtype;
    unsigned long long x, w, scales, y;
    long long M, K, N;
    if (!PyArg_ParseTuple(args, "iKiLLKKiLiKi", &threads, &x, &x_dtype, &M, &K, &w, &scales, &scale_dtype, &N,
                          &chunk, &y, &y_dtype))
        return NULL;
    if (!w4a8_supported())
        return PyErr_Format(PyExc_ValueError, "W4A8 needs AVX-512 VNNI, which this CPU lacks");
    if ((chunk != 32 && chunk != 64) || M < 0 || N < 0 || K <= 0 || K % chunk)
        return PyErr_Format(PyExc_ValueError, "bad shape M=%lld N=%lld K=%lld chunk=%d", M, N, K, chunk);
    if ((x_dtype != DTYPE_F32 && x_dtype != DTYPE_BF16) || (y_dtype != DTYPE_F32 && y_dtype != DTYPE_BF16) ||
        (scale_dtype != DTYPE_F32 && scale_dtype != DTYPE_BF16))
        return PyErr_Format(PyExc_ValueError, "bad dtype codes x=%d scale=%d y=%d", x_dtype, scale_dtype,
                            y_dtype);
    if (M == 0 || N == 0)
        Py_RETURN_NONE;
    const int64_t chunks = K / chunk;
    W4A8Job job = {
        .M = M, .K = K, .N = N, .tiles = (N + W4A8_ROWS - 1) / W4A8_ROWS, .chunks = chunks,
        .xp_stride = w4a8_xp_stride(K, chunks), .C = chunk, .x_dtype = x_dtype, .y_dtype = y_dtype,
        .x = (const void *)(uintptr_t)x, .w = (const uint8_t *)(uintptr_t)w,
        .scales = (const void *)(uintptr_t)scales, .scale_bf16 = scale_dtype == DTYPE_BF16,
        .y = (void *)(uintptr_t)y,
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

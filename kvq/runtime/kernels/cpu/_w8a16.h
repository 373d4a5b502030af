/* The W8A16 entry of kvq.runtime.kernels.cpu._linear, included by _linear.c after run_job.

   y[m, n] = scale[n] * sum_k w[n, k] * x[m, k], fp32 sums, for int8 weights w [N, K] (one symmetric scale
   per row, fp32 or bf16), activations x [M, K] and output y [M, N] in fp32, bf16 or fp16, all contiguous:
   the lm_head's INT8 runtime copy. Same paths (scalar reference, AVX2 + FMA, AVX-512F), thread pool and
   fp32 activation scratch as the W4A16 kernel; avx512bf16 runs M >= 2 rows of bf16 activations through
   vdpbf16ps (w8_gemm_bf16 in _w8a16_bf16.h, no scratch), the rest as avx512; amx runs M >=
   AMX_W8_FROM_ROWS rows of bf16 activations with K a multiple of 32 through the AMX W4A16 kernel's tiles
   (gemm_w8_amx: the int8 rows widened to bf16 exactly, each row's scale on its fp32 sums at the store;
   ~9x avx512bf16's loops on the SmolLM2 lm_head at 32 rows), fewer rows as avx512bf16.

   gemm_w8(isa, threads, x, x_dtype, M, K, w, scale, scale_dtype, N, y, y_dtype) takes addresses and dtype
   codes; the caller checks shapes, dtypes and contiguity (kvq/runtime/kernels/cpu/w8a16.py).

   gemv_dense(isa, threads, x, K, w, N, y) is the same GEMV over a dense bf16 weight [N, K] and one bf16 row
   x [1, K] into bf16 y [1, N] (no scale): a BF16 Linear's decode row without torch's GEMM dispatch (oneDNN
   copies the whole weight into a blocked buffer at every such call on AVX-512 BF16 CPUs). */

/* The reference: per output, a plain fp32 sum in k order, then times the row's scale. */
static void w8_scalar_rows(const W8Job *job, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < job->M; m++)
        for (int64_t n = n0; n < n1; n++) {
            const float *x = job->xp + m * job->K;
            float sum = 0.0f;
            for (int64_t k = 0; k < job->K; k++)
                sum += (job->w16 != NULL ? load_f32(job->w16, DTYPE_BF16, n * job->K + k)
                                         : (float)job->w[n * job->K + k]) *
                       x[k];
            w8_store(job, m, n, sum);
        }
}

static void w8_rows_task(void *ctx, int64_t chunk, int64_t num_chunks) {
    const W8Job *job = (const W8Job *)ctx;
    int64_t n0, n1;
    if (chunk_rows(job->N, 4, chunk, num_chunks, &n0, &n1))
        RUN_PATH(job, n0, n1, w8_run, w8_gemm_bf16, w8_scalar_rows);
}

static void w8_convert_task(void *ctx, int64_t chunk, int64_t num_chunks) {
    const W8Job *job = (const W8Job *)ctx;
    int64_t size = job->M * job->K;
    for (int64_t i = size * chunk / num_chunks; i < size * (chunk + 1) / num_chunks; i++)
        job->xp[i] = load_f32(job->x, job->x_dtype, i);
}

/* The job on its (non-AMX) path: activations to fp32 first (avx512bf16 reads bf16 as it is), then the
   rows over the pool. -1: out of memory. */
static int w8_run(int threads, W8Job *job) {
    const int64_t useful = job->M * job->N * job->K / MIN_WORK_PER_THREAD, tiles = (job->N + 3) / 4;
    int nt = threads < 1 ? 1 : threads;
    nt = useful < nt ? (int)(useful > 1 ? useful : 1) : nt;
    const int64_t chunks = (int64_t)nt * CHUNKS_PER_THREAD, size = job->M * job->K;
    if (job->isa != ISA_AVX512BF16) {
        job->xp = scratch_of((size_t)size);
        if (job->xp == NULL)
            return -1;
        if (size > 65536)
            run_parallel(w8_convert_task, job, chunks, nt);
        else
            w8_convert_task(job, 0, 1);
    }
    run_parallel(w8_rows_task, job, chunks < tiles ? chunks : tiles, nt);
    return 0;
}

#ifdef KVQ_AMX
#define AMX_W8_FROM_ROWS 4 /* fewer rows: avx512bf16's loops (as the W4A16 amx path's AMX_FROM_ROWS) */

/* W8A16 on the AMX W4A16 kernel: its Job over the int8 weight (weight_bits 8; one "group" per row). */
static int gemm_w8_amx(int threads, const W8Job *w8) {
    Job job = {
        .isa = ISA_AMX,
        .group = 128, /* unused by the int8 rows' decompression; keeps the int4 fields in range */
        .group_shift = 7,
        .x_dtype = w8->x_dtype,
        .scale_dtype = w8->scale_dtype,
        .y_dtype = w8->y_dtype,
        .scale_size = w8->scale_dtype == DTYPE_F32 ? 4 : 2,
        .weight_bits = 8,
        .M = w8->M,
        .K = w8->K,
        .N = w8->N,
        .num_groups = 1,
        .xp_stride = xp_stride_of(ISA_AMX, w8->K, 0),
        .x = w8->x,
        .packed = (const int32_t *)w8->w,
        .scale = (const uint8_t *)w8->scale,
        .y = w8->y,
    };
    return run_job(&job, threads < 1 ? 1 : threads);
}
#endif

/* The job on its path (use_amx: gemm_w8_amx, else w8_run) without the GIL, under call_lock (calls from several
   threads take turns): None, or MemoryError. */
static PyObject *w8_run_released(int threads, W8Job *job, int use_amx) {
    int status;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&call_lock);
#ifdef KVQ_AMX
    status = use_amx ? gemm_w8_amx(threads, job) : w8_run(threads, job);
#else
    (void)use_amx;
    status = w8_run(threads, job);
#endif
    pthread_mutex_unlock(&call_lock);
    Py_END_ALLOW_THREADS;
    if (status < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *gemm_w8(PyObject *self, PyObject *args) {
    (void)self;
    int isa, threads, x_dtype, scale_dtype, y_dtype;
    unsigned long long x, w, scale, y;
    long long M, K, N;
    if (!PyArg_ParseTuple(args, "iiKiLLKKiLKi", &isa, &threads, &x, &x_dtype, &M, &K, &w, &scale, &scale_dtype,
                          &N, &y, &y_dtype))
        return NULL;
    if (!isa_checked(isa))
        return NULL;
#ifdef KVQ_AMX
    const int use_amx = isa == ISA_AMX && M >= AMX_W8_FROM_ROWS && x_dtype == DTYPE_BF16 && K % AMX_KC == 0;
#else
    const int use_amx = 0;
#endif
    if (isa == ISA_AMX)
        isa = ISA_AVX512BF16; /* fewer rows, other activations or K: avx512bf16's loops */
    if (isa == ISA_AVX512BF16 && (M < 2 || x_dtype != DTYPE_BF16))
        isa = ISA_AVX512; /* its GEMV, and other activations, are the AVX-512 path's */
    if (M < 0 || N < 0 || K <= 0)
        return PyErr_Format(PyExc_ValueError, "bad shape M=%lld N=%lld K=%lld", M, N, K);
    if (!dtypes_checked(x_dtype, scale_dtype, y_dtype))
        return NULL;
    if (M == 0 || N == 0)
        Py_RETURN_NONE;
    W8Job job = {
        .isa = isa,
        .x_dtype = x_dtype,
        .scale_dtype = scale_dtype,
        .y_dtype = y_dtype,
        .M = M,
        .K = K,
        .N = N,
        .x = (const void *)(uintptr_t)x,
        .w = (const int8_t *)(uintptr_t)w,
        .scale = (const void *)(uintptr_t)scale,
        .y = (void *)(uintptr_t)y,
    };
    return w8_run_released(threads, &job, use_amx);
}

static PyObject *gemv_dense(PyObject *self, PyObject *args) {
    (void)self;
    int isa, threads;
    unsigned long long x, w, y;
    long long K, N;
    if (!PyArg_ParseTuple(args, "iiKLKLK", &isa, &threads, &x, &K, &w, &N, &y))
        return NULL;
    if (!isa_checked(isa))
        return NULL;
    if (N < 0 || K <= 0)
        return PyErr_Format(PyExc_ValueError, "bad shape N=%lld K=%lld", N, K);
    if (N == 0)
        Py_RETURN_NONE;
    W8Job job = {
        .isa = isa >= ISA_AVX512 ? ISA_AVX512 : isa, /* one row: the AVX-512 GEMV on every AVX-512 path */
        .x_dtype = DTYPE_BF16,
        .scale_dtype = DTYPE_F32,
        .y_dtype = DTYPE_BF16,
        .M = 1,
        .K = K,
        .N = N,
        .x = (const void *)(uintptr_t)x,
        .w16 = (const uint16_t *)(uintptr_t)w,
        .y = (void *)(uintptr_t)y,
    };
    return w8_run_released(threads, &job, 0);
}

/* The dense BF16 entry of kvq.runtime.kernels.cpu._linear, included by _linear.c after the W8A16 one.

   y = x @ w^T for a dense bf16 weight w [N, K] and bf16 activations x [M, K] (K a multiple of 32), fp32
   sums, y [M, N] in fp32, bf16 or fp16, all contiguous, through the AMX W4A16 kernel's tiles with nothing
   to decompress (weight_bits 16): up to 32 rows load their A tiles straight from w's rows
   (amx_pairs_dense), more rows go strip by strip through a copy. The tied lm_head's path on amx machines:
   it reads the weight in place (no blocked copy) at about the speed this core reads memory.

   gemm_dense(threads, x, M, K, w, N, y, y_dtype) takes addresses and a dtype code; the caller checks
   shapes, dtypes and contiguity (kvq/runtime/kernels/cpu/dense.py). Only where isas() has "amx". */

static PyObject *gemm_dense(PyObject *self, PyObject *args) {
    (void)self;
    int threads, y_dtype;
    unsigned long long x, w, y;
    long long M, K, N;
    if (!PyArg_ParseTuple(args, "iKLLKLKi", &threads, &x, &M, &K, &w, &N, &y, &y_dtype))
        return NULL;
    if (!isa_supported(ISA_AMX))
        return PyErr_Format(PyExc_ValueError, "gemm_dense needs the amx path, which this CPU cannot run");
    if (M < 0 || N < 0 || K <= 0 || K % 32)
        return PyErr_Format(PyExc_ValueError, "bad shape M=%lld N=%lld K=%lld (K a multiple of 32)", M, N, K);
    if (y_dtype < 0 || y_dtype > 2)
        return PyErr_Format(PyExc_ValueError, "bad dtype code y=%d", y_dtype);
    if (M == 0 || N == 0)
        Py_RETURN_NONE;
#ifdef KVQ_AMX
    Job job = {
        .isa = ISA_AMX,
        .weight_bits = 16,
        .group = 128, /* the int4 fields: unused by a bf16 weight, kept in range */
        .group_shift = 7,
        .x_dtype = DTYPE_BF16,
        .y_dtype = y_dtype,
        .M = M,
        .K = K,
        .N = N,
        .num_groups = 1,
        .xp_stride = xp_stride_of(ISA_AMX, K, 0),
        .x = (const void *)(uintptr_t)x,
        .packed = (const int32_t *)(uintptr_t)w,
        .y = (void *)(uintptr_t)y,
    };
    return run_job_released(&job, threads);
#else
    Py_RETURN_NONE; /* not reached: isa_supported(ISA_AMX) is 0 without KVQ_AMX */
#endif
}

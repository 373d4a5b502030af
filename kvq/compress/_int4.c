/* kvq.compress._int4: W4A16 group quantize-and-pack of one weight, in one pass over its bytes.

   The arithmetic is kvq.formats.pack_quantized's (compressed-tensors' own, bit for bit) for a bfloat16
   weight, which is what FP8-block sources become first (compressed-tensors' FP8BlockDequantizer rounds
   the fp32 product to bf16):
     y = bf16(value(code) * weight_scale_inv[block])     (FP8 source; a BF16 source is y itself)
     weight_scale = bf16(absmax(group of y) / 7.5), a zero one replaced by bf16's eps (2^-7)
     q = round_half_even(clamp(bf16(y / weight_scale), -8, 7)), packed as nibble q + 8, low first.
   Every fp32 operation is one IEEE operation rounded to nearest even (no FMA contraction, no fast-math;
   see setup.py), and bf16 rounding is done on the bits as torch does. FP8 codes are
   decoded with integer operations, so every loop over a group runs on vectors.

   quantize(kind, weight, scale_inv, rows, cols, group, block_rows, block_cols, weight_packed,
            weight_scale) -> 0, or 1 when a group's scale is not finite (NaN/Inf in the weight or its
   scales): the caller then finds and names the bad element. kind 0: weight is float8_e4m3fn codes with
   fp32 scale_inv [ceil(rows/block_rows), ceil(cols/block_cols)]; kind 1: weight is bfloat16 (scale_inv
   unused). weight_packed receives rows * cols / 2 bytes (int32 words, little-endian), weight_scale rows *
   cols / group bfloat16 values. The GIL is released while it runs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../formats/_pack_quantized.h" /* the nibble layout, f32_bits, bits_f32, bf16_round_bits */

#define MAX_GROUP 1024

/* bf16(value(code) * s) as fp32 bits, for a float8_e4m3fn code (NaN for S.1111.111). Branch-free so the
   loops over a group vectorize: the code's magnitude is built as an fp32 (exact: 1.m * 2^(e-7) for e > 0,
   m * 2^-9 for subnormals), signed, then multiplied by s: one rounding to fp32, then one to bf16. */
static inline uint32_t e4m3_times(uint8_t code, float s) {
    uint32_t c = code, e = (c >> 3) & 0xFu, m = c & 7u;
    uint32_t normal = ((e + 120u) << 23) | (m << 20);
    uint32_t subnormal = f32_bits((float)(int32_t)m * 0.001953125f);
    uint32_t is_normal = 0u - (uint32_t)(e != 0);
    uint32_t magnitude = (normal & is_normal) | (subnormal & ~is_normal);
    uint32_t y = bf16_round_bits(f32_bits(bits_f32(magnitude | ((c & 0x80u) << 24)) * s));
    uint32_t is_nan = 0u - (uint32_t)((c & 0x7Fu) == 0x7Fu);
    return (y & ~is_nan) | (0x7FC00000u & is_nan);
}

/* The group scale's bits (bf16, upper half of fp32) for a group absmax |y| (fp32 bits), or 0xFFFFFFFF
   when it is not finite. */
static inline uint32_t scale_of(uint32_t absmax) {
    if (absmax >= 0x7F800000u)
        return 0xFFFFFFFFu;
    uint32_t scale_bits = bf16_round_bits(f32_bits(bits_f32(absmax) / 7.5f));
    if ((scale_bits & 0x7FFFFFFFu) == 0)
        scale_bits = 0x3C000000u; /* bf16 eps, 2^-7 */
    return scale_bits >= 0x7F800000u ? 0xFFFFFFFFu : scale_bits;
}

/* round_half_even(bf16(y / scale)) for |y / scale| < 2^22: adding and subtracting 1.5 * 2^23 rounds to an
   integer, ties to even (|y / scale| <= ~16 here: the scale is within a factor 2 of absmax / 7.5, even
   when it is a bf16 subnormal). */
static inline int32_t rounded_quotient(uint32_t y, float scale) {
    float q = bits_f32(bf16_round_bits(f32_bits(bits_f32(y) / scale)));
    return (int32_t)((q + 12582912.0f) - 12582912.0f);
}

/* Quantize one group of n bf16-valued floats (as fp32 bits) into n/2 packed bytes; return its scale bits
   or 0xFFFFFFFF when the scale is not finite. */
static inline uint32_t quantize_group(const uint32_t *y, int n, uint8_t *out) {
    uint32_t absmax = 0;
    for (int i = 0; i < n; i++) {
        uint32_t a = y[i] & 0x7FFFFFFFu; /* |y|: integer order is magnitude order, NaN above Inf */
        absmax = a > absmax ? a : absmax;
    }
    uint32_t scale_bits = scale_of(absmax);
    if (scale_bits == 0xFFFFFFFFu)
        return scale_bits;
    float scale = bits_f32(scale_bits);
    int32_t nibbles[MAX_GROUP];
    for (int i = 0; i < n; i++) {
        int32_t r = rounded_quotient(y[i], scale);
        nibbles[i] = (r < -8 ? -8 : (r > 7 ? 7 : r)) + 8; /* clamping before or after rounding: same */
    }
    for (int i = 0; i < n / 2; i++)
        out[i] = int4_pack_byte((uint32_t)nibbles[2 * i], (uint32_t)nibbles[2 * i + 1]);
    return scale_bits;
}

/* One build runs everywhere; where the CPU has wider vectors, the loops use them (same arithmetic). */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

/* An FP8 group inside one block, with block scale s and largest magnitude code `top`, has its scale
   fixed by (s, top) (rounding is monotonic: absmax |y| = bf16(value(top) * |s|)), and every element's
   |q| is then a non-decreasing function of its magnitude code m. So per block and top, kvq evaluates the
   arithmetic above once for m = 0..top and keeps the 8 codes where |q| steps up; an element's |q| is the
   number of those it reaches (capped at 8: q = -8 exists, +8 is clamped to 7). Rows of a block share a
   handful of tops, so the division runs ~10x less often and elements take byte operations only. */
typedef struct {
    uint8_t steps[8]; /* |q| >= k exactly for magnitude codes m >= steps[k - 1] */
    uint16_t scale;   /* bf16 bits */
    uint8_t state;    /* 0 not built, 1 built, 2 scale not finite */
} Steps;

static void build_steps(Steps *out, float abs_s, unsigned top) {
    uint32_t scale_bits = scale_of(e4m3_times((uint8_t)top, abs_s));
    if (scale_bits == 0xFFFFFFFFu) {
        out->state = 2;
        return;
    }
    float scale = bits_f32(scale_bits);
    unsigned below[8] = {0}; /* below[k - 1]: codes m <= top with |q| < k */
    for (unsigned m = 0; m <= top; m++) {
        int32_t r = rounded_quotient(e4m3_times((uint8_t)m, abs_s), scale);
        for (int k = 0; k < 8; k++)
            below[k] += r < k + 1;
    }
    for (int k = 0; k < 8; k++)
        out->steps[k] = (uint8_t)below[k]; /* <= 128: no code of the group reaches a step past top */
    out->scale = (uint16_t)(scale_bits >> 16);
    out->state = 1;
}

/* Pack a group (all in one block of scale s) with its `steps`. */
static inline void pack_steps(const uint8_t *codes, int n, const Steps *st, uint8_t negative_scale, uint8_t *out) {
    const uint8_t t0 = st->steps[0], t1 = st->steps[1], t2 = st->steps[2], t3 = st->steps[3];
    const uint8_t t4 = st->steps[4], t5 = st->steps[5], t6 = st->steps[6], t7 = st->steps[7];
    uint8_t nibbles[MAX_GROUP];
    for (int i = 0; i < n; i++) {
        uint8_t c = codes[i], m = c & 0x7F;
        uint8_t r = (uint8_t)((m >= t0) + (m >= t1) + (m >= t2) + (m >= t3) + (m >= t4) + (m >= t5) +
                              (m >= t6) + (m >= t7));
        uint8_t positive = (uint8_t)(8 + (r > 7 ? 7 : r)), negative = (uint8_t)(8 - r);
        nibbles[i] = ((c >> 7) ^ negative_scale) ? negative : positive;
    }
    for (int i = 0; i < n / 2; i++)
        out[i] = int4_pack_byte((uint32_t)nibbles[2 * i], (uint32_t)nibbles[2 * i + 1]);
}

VECTOR_CLONES
static int quantize_fp8(const uint8_t *w, const float *scale_inv, Py_ssize_t rows, Py_ssize_t cols, int group,
                        Py_ssize_t bm, Py_ssize_t bn, uint8_t *packed, uint16_t *scales) {
    Py_ssize_t scols = (cols + bn - 1) / bn, groups = cols / group;
    Steps *steps = (Steps *)PyMem_RawMalloc(sizeof(Steps) * 128 * (size_t)scols); /* [block column][top] */
    if (steps == NULL)
        return -1;
    uint32_t y[MAX_GROUP];
    int status = 0;
    for (Py_ssize_t r = 0; r < rows && status == 0; r++) {
        const uint8_t *row = w + r * cols;
        const float *block_scales = scale_inv + (r / bm) * scols;
        if (r % bm == 0)
            memset(steps, 0, sizeof(Steps) * 128 * (size_t)scols); /* a new block row: new scales */
        for (Py_ssize_t g = 0; g < groups; g++) {
            Py_ssize_t start = g * group, b = start / bn;
            uint8_t *out = packed + (r * cols + start) / 2;
            uint32_t scale_bits;
            if (b == (start + group - 1) / bn) { /* the group lies in one block */
                uint8_t top = 0;
                for (int i = 0; i < group; i++) {
                    uint8_t m = row[start + i] & 0x7F;
                    top = m > top ? m : top;
                }
                if (top == 0x7F) { /* e4m3fn NaN */
                    status = 1;
                    break;
                }
                uint32_t s_bits = f32_bits(block_scales[b]);
                Steps *st = steps + b * 128 + top;
                if (st->state == 0)
                    build_steps(st, bits_f32(s_bits & 0x7FFFFFFFu), top);
                if (st->state == 2) {
                    status = 1;
                    break;
                }
                pack_steps(row + start, group, st, (uint8_t)(s_bits >> 31), out);
                scale_bits = (uint32_t)st->scale << 16;
            } else {
                for (int i = 0; i < group; i++)
                    y[i] = e4m3_times(row[start + i], block_scales[(start + i) / bn]);
                scale_bits = quantize_group(y, group, out);
                if (scale_bits == 0xFFFFFFFFu) {
                    status = 1;
                    break;
                }
            }
            scales[r * groups + g] = (uint16_t)(scale_bits >> 16);
        }
    }
    PyMem_RawFree(steps);
    return status;
}

VECTOR_CLONES
static int quantize_bf16(const uint16_t *w, Py_ssize_t rows, Py_ssize_t cols, int group, uint8_t *packed,
                         uint16_t *scales) {
    Py_ssize_t groups = cols / group;
    uint32_t y[MAX_GROUP];
    for (Py_ssize_t r = 0; r < rows; r++) {
        for (Py_ssize_t g = 0; g < groups; g++) {
            const uint16_t *src = w + r * cols + g * group;
            for (int i = 0; i < group; i++)
                y[i] = (uint32_t)src[i] << 16;
            uint32_t scale_bits = quantize_group(y, group, packed + (r * cols + g * group) / 2);
            if (scale_bits == 0xFFFFFFFFu)
                return 1;
            scales[r * groups + g] = (uint16_t)(scale_bits >> 16);
        }
    }
    return 0;
}

static PyObject *quantize(PyObject *self, PyObject *args) {
    (void)self;
    int kind, group;
    Py_ssize_t rows, cols, bm, bn;
    Py_buffer w, s, packed, scales;
    if (!PyArg_ParseTuple(args, "iy*y*nninnw*w*", &kind, &w, &s, &rows, &cols, &group, &bm, &bn, &packed,
                          &scales))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t elements = rows * cols, item = kind == 0 ? 1 : 2;
    if (kind != 0 && kind != 1) {
        PyErr_SetString(PyExc_ValueError, "kind must be 0 (float8_e4m3fn) or 1 (bfloat16)");
    } else if (rows < 0 || cols <= 0 || group < 2 || group > MAX_GROUP || group % 2 || cols % group) {
        PyErr_Format(PyExc_ValueError, "bad shape [%zd, %zd] for group size %d", rows, cols, group);
    } else if (w.len != elements * item || packed.len != elements / 2 ||
               scales.len != (elements / group) * 2) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the shape");
    } else if (kind == 0 && (bm <= 0 || bn <= 0 ||
                             s.len != ((rows + bm - 1) / bm) * ((cols + bn - 1) / bn) * 4)) {
        PyErr_SetString(PyExc_ValueError, "scale_inv size does not match the shape and block");
    } else {
        int status;
        Py_BEGIN_ALLOW_THREADS;
        if (kind == 0)
            status = quantize_fp8((const uint8_t *)w.buf, (const float *)s.buf, rows, cols, group, bm, bn,
                                  (uint8_t *)packed.buf, (uint16_t *)scales.buf);
        else
            status = quantize_bf16((const uint16_t *)w.buf, rows, cols, group, (uint8_t *)packed.buf,
                                   (uint16_t *)scales.buf);
        Py_END_ALLOW_THREADS;
        if (status < 0)
            PyErr_NoMemory();
        else
            result = PyLong_FromLong(status);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&s);
    PyBuffer_Release(&packed);
    PyBuffer_Release(&scales);
    return result;
}

static PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS, "W4A16 group quantize-and-pack of one weight (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_int4", .m_doc = "W4A16 quantize-and-pack kernel.", .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__int4(void) { return PyModule_Create(&module); }

/* Check builds only (KVQ_SIMDE_CHECK, see scripts/check_cpu_paths.sh): the AVX-512 intrinsics that the
   SIMDe release at hand may lack, lane by lane, so the AVX-512 path runs (slowly) on any CPU. */

/* Widenings and narrowings lane by lane: T_IN in[N] -> T_OUT out[N] as C converts them. */
#define KVQ_LANES(name, vin, vout, tin, tout, n)                                                             \
    static inline vout name(vin v) {                                                                         \
        tin in[n];                                                                                           \
        tout out[n];                                                                                         \
        vout r;                                                                                              \
        memset(&r, 0, sizeof r);                                                                             \
        memcpy(in, &v, sizeof in);                                                                           \
        for (int i = 0; i < n; i++)                                                                          \
            out[i] = (tout)in[i];                                                                            \
        memcpy(&r, out, sizeof out);                                                                         \
        return r;                                                                                            \
    }

#ifndef _mm512_cvtepi32_ps
KVQ_LANES(kvq_cvtepi32_ps, __m512i, __m512, int32_t, float, 16)
#define _mm512_cvtepi32_ps kvq_cvtepi32_ps
#endif

#ifndef _mm512_maskz_loadu_epi32
static inline __m512i kvq_maskz_loadu_epi32(unsigned k, const void *p) {
    int32_t lanes[16] = {0};
    __m512i r;
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1)
            memcpy(lanes + i, (const int32_t *)p + i, 4);
    memcpy(&r, lanes, sizeof r);
    return r;
}
#define _mm512_maskz_loadu_epi32 kvq_maskz_loadu_epi32
#endif

#ifndef _mm512_reduce_add_ps
static inline float kvq_reduce_add_ps(__m512 v) {
    float lanes[16], sum = 0.0f;
    memcpy(lanes, &v, sizeof lanes);
    for (int i = 0; i < 16; i++)
        sum += lanes[i];
    return sum;
}
#define _mm512_reduce_add_ps kvq_reduce_add_ps
#endif

#ifndef _mm512_cvtepi8_epi32
KVQ_LANES(kvq_cvtepi8_epi32, __m128i, __m512i, int8_t, int32_t, 16)
#define _mm512_cvtepi8_epi32 kvq_cvtepi8_epi32
#endif

#ifndef _mm512_cvtepu8_epi32
KVQ_LANES(kvq_cvtepu8_epi32, __m128i, __m512i, uint8_t, int32_t, 16)
#define _mm512_cvtepu8_epi32 kvq_cvtepu8_epi32
#endif

#ifndef _mm512_cvtepu16_epi32
KVQ_LANES(kvq_cvtepu16_epi32, __m256i, __m512i, uint16_t, int32_t, 16)
#define _mm512_cvtepu16_epi32 kvq_cvtepu16_epi32
#endif

#ifndef _mm512_cvtepi32_epi8 /* vpmovdb: truncation */
KVQ_LANES(kvq_cvtepi32_epi8, __m512i, __m128i, int32_t, int8_t, 16)
#define _mm512_cvtepi32_epi8 kvq_cvtepi32_epi8
#endif

#ifndef _mm512_cvtepi32_epi16 /* vpmovdw: truncation */
KVQ_LANES(kvq_cvtepi32_epi16, __m512i, __m256i, int32_t, int16_t, 16)
#define _mm512_cvtepi32_epi16 kvq_cvtepi32_epi16
#endif

#ifndef _mm512_srai_epi32
static inline __m512i kvq_srai_epi32(__m512i v, int shift) {
    int32_t lanes[16];
    memcpy(lanes, &v, sizeof lanes);
    for (int i = 0; i < 16; i++)
        lanes[i] >>= shift; /* arithmetic on GCC and clang */
    memcpy(&v, lanes, sizeof v);
    return v;
}
#define _mm512_srai_epi32 kvq_srai_epi32
#endif

#ifndef __mmask32
typedef uint32_t kvq_mmask32;
#define __mmask32 kvq_mmask32
#endif

#ifndef _mm512_cmpeq_epi16_mask
static inline uint32_t kvq_cmpeq_epi16_mask(__m512i a, __m512i b) {
    uint16_t x[32], y[32];
    uint32_t mask = 0;
    memcpy(x, &a, sizeof x);
    memcpy(y, &b, sizeof y);
    for (int i = 0; i < 32; i++)
        mask |= (uint32_t)(x[i] == y[i]) << i;
    return mask;
}
#define _mm512_cmpeq_epi16_mask kvq_cmpeq_epi16_mask
#endif

#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif

#ifndef _mm512_cvt_roundps_epi32 /* only to nearest even here (the default rounding mode) */
static inline __m512i kvq_cvt_roundps_epi32(__m512 v, int rounding) {
    float in[16];
    int32_t out[16];
    __m512i r;
    (void)rounding;
    memcpy(in, &v, sizeof in);
    for (int i = 0; i < 16; i++)
        out[i] = (int32_t)lrintf(in[i]);
    memcpy(&r, out, sizeof r);
    return r;
}
#define _mm512_cvt_roundps_epi32 kvq_cvt_roundps_epi32
#endif

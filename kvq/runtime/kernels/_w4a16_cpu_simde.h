/* Check builds only (KVQ_SIMDE_CHECK, see scripts/check_cpu_paths.sh): the AVX-512 intrinsics that the
   SIMDe release at hand may lack, lane by lane, so the AVX-512 path runs (slowly) on any CPU. */

#ifndef _mm512_cvtepi32_ps
static inline __m512 kvq_cvtepi32_ps(__m512i v) {
    int32_t in[16];
    float out[16];
    __m512 r;
    memcpy(in, &v, sizeof in);
    for (int i = 0; i < 16; i++)
        out[i] = (float)in[i];
    memcpy(&r, out, sizeof r);
    return r;
}
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
static inline __m512i kvq_cvtepi8_epi32(__m128i v) {
    int8_t in[16];
    int32_t out[16];
    __m512i r;
    memcpy(in, &v, sizeof in);
    for (int i = 0; i < 16; i++)
        out[i] = in[i];
    memcpy(&r, out, sizeof r);
    return r;
}
#define _mm512_cvtepi8_epi32 kvq_cvtepi8_epi32
#endif

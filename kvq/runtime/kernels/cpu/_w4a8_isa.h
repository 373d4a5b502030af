/* The W4A8 loops both kernels share (see _w4a8.h), included by _w4a8.h once per kernel after its file, with
   W4A8_ISA (the name suffix: vnni, avx2) and W4A8_TARGET (its function attribute); the kernel's file defines
   w4a8_chunk_amax_ISA, w4a8_chunk_quantize_ISA and w4a8_tile_ISA, inlined here. */

#define W4A8_FN(name) CAT(name, W4A8_ISA)

/* Row m's chunks quantized (_w4a8.h) into its xp row: the same values from both kernels. */
W4A8_TARGET static void W4A8_FN(w4a8_convert_row)(const W4A8Job *job, int64_t m) {
    uint8_t *row = job->xp + m * job->xp_stride;
    float *xs = (float *)row;
    int32_t *seeds = (int32_t *)(row + 4 * job->chunks);
    int8_t *xq = (int8_t *)(row + 8 * job->chunks);
    for (int64_t c = 0; c < job->chunks; c++) {
        int special; /* the chunk holds inf or NaN */
        const float amax = W4A8_FN(w4a8_chunk_amax)(job, m, c * job->C, &special);
        const float inv = amax > 0.0f && !special ? 127.0f / amax : 0.0f;
        xs[c] = special ? NAN : amax / 127.0f;
        seeds[c] = (job->wide ? -128 : -8) * W4A8_FN(w4a8_chunk_quantize)(job, m, c * job->C, inv, xq);
    }
}

/* Tiles [t0, t1) for every activation row, W4A8_MB rows per pass: one copy of the tile per chunk size (C / 8
   steps) and weight width. */
W4A8_TARGET static void W4A8_FN(w4a8_tiles)(const W4A8Job *job, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
        for (int64_t m0 = 0; m0 < job->M; m0 += W4A8_MB) {
            const int64_t mb = job->M - m0 < W4A8_MB ? job->M - m0 : W4A8_MB;
            if (job->C == 64)
                job->wide ? W4A8_FN(w4a8_tile)(job, t, m0, mb, 8, 1) : W4A8_FN(w4a8_tile)(job, t, m0, mb, 8, 0);
            else
                job->wide ? W4A8_FN(w4a8_tile)(job, t, m0, mb, 4, 1) : W4A8_FN(w4a8_tile)(job, t, m0, mb, 4, 0);
        }
}

#undef W4A8_FN

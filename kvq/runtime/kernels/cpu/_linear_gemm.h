/* The W4A16 GEMM (M >= 2) over tiles of decompressed weights, FN(gemm): included by _linear_simd.h once per
   ISA (gemm_avx2, gemm_avx512: fp32 q * scale) and by _linear_bf16.h (gemm_bf16: pair planes of
   bf16(q * scale)), with that ISA's macros (ISA, TARGET, L, VF, VI, V_ZERO, V_HSUM, V_HSUM4) and:
     GEMM_TILE: the tile's vector type, GEMM_TILE_VECS: its vectors per weight row (GEMM_KC blocks);
     GEMM_INDEX(job): the vector that FN(dequantize) takes for the job's groups;
     FN(dequantize)(job, n, b0, nb, index, tile): blocks b0..b0+nb of weight row n into one tile row;
     FN(tile_rows)(job, m0, mb, b0, nb, tile, acc): acc[4m + r] += activation row m0 + m (m < mb) . tile
       row r, over those blocks.
   Per tile of 4 weight rows x GEMM_KC blocks the weights are decompressed once, then every activation row
   (GEMM_M_BLOCK per pass) goes through them; a row past n1 is zero weights. */

TARGET static void FN(gemm)(const Job *job, int64_t n0, int64_t n1) {
    const int64_t num_blocks = (job->K / 8 + L - 1) / L;
    const VI index = GEMM_INDEX(job);
    GEMM_TILE tile[4 * GEMM_TILE_VECS];
    VF acc[GEMM_M_BLOCK * 4];
    for (int64_t n = n0; n < n1; n += 4) {
        int num_rows = n1 - n < 4 ? (int)(n1 - n) : 4;
        if (num_rows < 4) /* the last tile's missing rows: zero weights */
            memset(tile + num_rows * GEMM_TILE_VECS, 0, (size_t)(4 - num_rows) * GEMM_TILE_VECS * sizeof *tile);
        for (int64_t m0 = 0; m0 < job->M; m0 += GEMM_M_BLOCK) {
            int64_t mb = job->M - m0 < GEMM_M_BLOCK ? job->M - m0 : GEMM_M_BLOCK;
            for (int64_t i = 0; i < mb * 4; i++)
                acc[i] = V_ZERO();
            for (int64_t b0 = 0; b0 < num_blocks; b0 += GEMM_KC) {
                int64_t nb = num_blocks - b0 < GEMM_KC ? num_blocks - b0 : GEMM_KC;
                for (int r = 0; r < num_rows; r++)
                    FN(dequantize)(job, n + r, b0, nb, index, tile + r * GEMM_TILE_VECS);
                FN(tile_rows)(job, m0, mb, b0, nb, tile, acc);
            }
            for (int64_t m = 0; m < mb; m++) {
                const VF *a = acc + m * 4;
                if (num_rows == 4)
                    store_y4(job, m0 + m, n, V_HSUM4(a[0], a[1], a[2], a[3]));
                else
                    for (int r = 0; r < num_rows; r++)
                        store_y(job, m0 + m, n + r, V_HSUM(a[r]));
            }
        }
    }
}

/* The AMX kernel (path amx: bf16 activations, M >= 2 rows; cpu/linear.py runs it from AMX_FROM_ROWS):
   y = x @ bf16(q * scale)^T with AMX-BF16's tdpbf16ps. Included by _linear.c after the AVX-512 BF16
   path; not in the SIMDe check build.

   The weight goes through the tiles as compressed-tensors decompresses it, bf16(q * scale) (q * scale
   exact in fp32, rounded once to nearest even: `dequantize`'s bits), the activations as they are, so y is
   a BF16 GEMM over the decompressed weight with fp32 sums (tdpbf16ps flushes denormals). The weight is
   the A operand: a strip of 16 weight rows gives one A tile (16 rows x 32 bf16) per 32 inputs, with no
   reordering across rows; the activations are the B one (pairs of inputs of 16 rows per 32-bit column,
   laid out once per call 16 rows at a time, zero past row M: convert_row_amx); C[n][m] is y transposed,
   turned back 16 x 16 in registers when stored. Inputs within a block of 128 go in the order that
   decompresses cheapest (amx_decompress_block), the activations' pairs in the same order.
   M <= 32 (one pass): two strips at a time (amx_pairs, 4 accumulators, each B tile loaded once for both),
   decompressed a chunk of 4 tiles at a time into a two-slot ring that stays in L1, interleaved with the
   previous chunk's tdpbf16ps, in one pipeline over all of a thread's pairs (a pair's results go into y a
   chunk after its tiles are stored). M > 32: per strip, the first pass decompresses into the whole strip,
   which the other passes (32 activation rows each) read back. The weight rows 32 ahead are prefetched into
   L2. Threads split the strips. The same tiles run W8A16's int8 weight (weight_bits 8: rows widened to
   bf16(q) exactly, the row scale at the store) and a dense bf16 weight (weight_bits 16: up to 32 rows the A
   tiles load straight from its rows, amx_pairs_dense; more rows copy it strip by strip), both in natural
   input order. */

#define AMX_ROWS 16      /* weight rows per strip (A tile rows) and activation rows per B / C tile */
#define AMX_KC 32        /* inputs per tile (K is a multiple of the group size, so of 32) */
#define AMX_TILE_ELEMS (AMX_ROWS * AMX_KC) /* bf16 in a tile */
#define AMX_TILE_PAIRS (AMX_TILE_ELEMS / 2)
#define AMX_CHUNK 4 /* tiles decompressed at a time: 128 inputs, whole groups of 32, 64 or 128 */
/* a ring slot (one strip's chunk) in bf16, padded: slots 4 KiB apart made the tile loads of one alias the
   stores into the next (~1.7x slower at K = 4096) */
#define AMX_RING_SLOT (AMX_CHUNK * AMX_TILE_ELEMS + 128)

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Every tile 16 rows x 64 bytes; a thread must load this before its first tile instruction. */
TARGET_AMX static void amx_load_config(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = AMX_ROWS;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* A whole block of 128 inputs of a row (16 words, 4 tiles) as bf16(q * scale) (scaled_planes_bf16): tile p
   holds pairs (8kk + p, 8kk + 4 + p). */
TARGET_AMX static inline void amx_decompress_block(const uint8_t *w, const uint8_t *srow, int scale_dtype, int64_t b,
                                                   int64_t groups, __m512i group_bits, uint16_t *out) {
    scaled_planes_bf16(_mm512_loadu_si512(w + 64 * b), srow, scale_dtype, b * groups, groups, groups, group_bits, out,
                       AMX_TILE_ELEMS);
}

/* Tiles c0..c1 of a row past its last whole block, in natural input order: per 32 weights 16 bytes
   widen to 16 dwords, byte t (inputs 2t, 2t + 1) in dword t; one shift and or put the high nibble into
   the dword's high half and one vpermw looks both up (it reads 5 index bits: bit 4 of the low half is
   the high nibble's, the group's table repeats). */
TARGET_AMX static inline void amx_decompress_tail(const Job *job, const uint8_t *w, const uint8_t *srow,
                                                  int64_t c0, int64_t c1, uint16_t *out) {
    const int64_t tiles_shift = job->group_shift - 5; /* tiles per group: 1 << tiles_shift */
    __m512i table = _mm512_setzero_si512();
    for (int64_t c = c0; c < c1; c++, out += AMX_TILE_ELEMS) {
        if (((c >> tiles_shift) << tiles_shift) == c) {
            __m512 s = scaled_q_bf16(scale_at(job, srow, c >> tiles_shift));
            table = scaled_table_bf16(s, s);
        }
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 16 * c)));
        __m512i idx = _mm512_or_si512(bytes, _mm512_slli_epi32(bytes, 12));
        _mm512_storeu_si512(out, _mm512_permutexvar_epi16(idx, table));
    }
}

/* Tiles c0..c1 of an int8 row (W8A16, inputs in natural order) as bf16(q), exact (|q| <= 127 needs 7
   bits): 32 bytes per tile widened to int32, converted to fp32 and packed by vcvtne2ps2bf16. The row's
   scale goes on the fp32 sums as they are stored (amx_store). */
TARGET_AMX static inline void amx_decompress_w8(const int8_t *w, int64_t c0, int64_t c1, uint16_t *out) {
    for (int64_t c = c0; c < c1; c++, out += AMX_TILE_ELEMS) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + AMX_KC * c));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
        const __m512bh pairs = _mm512_cvtne2ps_pbh(hi, lo);
        memcpy(out, &pairs, sizeof pairs);
    }
}

/* Weight rows n0..n0+16, input tiles c0..c1 (a whole block: c0 = 4b, c1 = c0 + 4; or the tiles past the
   last block; any tiles of an int8 or bf16 weight) as bf16(q * scale) (int8: bf16(q); bf16: copied) into
   out [c1 - c0][16][32]; rows past N zero. */
TARGET_AMX static void amx_decompress_rows(const Job *job, int64_t n0, int r0, int r1, int64_t c0, int64_t c1,
                                           uint16_t *out) {
    /* job's fields in locals: the tile stores may alias them, which would reload them every row */
    const int bits = job->weight_bits;
    const int64_t row_bytes = job->K * bits / 8, tile_bytes = AMX_KC * bits / 8;
    const int64_t scale_bytes = job->num_groups * job->scale_size, N = job->N;
    const int64_t groups = 128 / job->group, is_block = c0 + 4 <= job->K / 128 * 4; /* groups in a block: 1, 2, 4 */
    const int scale_dtype = job->scale_dtype;
    const __m512i group_bits = group_bits_bf16(groups);
    const uint8_t *w = (const uint8_t *)job->packed + (n0 + r0) * row_bytes;
    const uint8_t *srow = job->scale + (n0 + r0) * scale_bytes;
    out += r0 * AMX_KC;
    for (int r = r0; r < r1; r++, out += AMX_KC, w += row_bytes, srow += scale_bytes) {
        if (n0 + r >= N) {
            for (int64_t c = c0; c < c1; c++)
                memset(out + (c - c0) * AMX_TILE_ELEMS, 0, AMX_KC * sizeof(uint16_t));
            continue;
        }
        if (n0 + r + 2 * AMX_ROWS < N) /* 32 rows ahead into L2: cold weights ran ~1.7x slower without */
            _mm_prefetch((const char *)(w + 2 * AMX_ROWS * row_bytes + c0 * tile_bytes), _MM_HINT_T1);
        if (bits == 16)
            for (int64_t c = c0; c < c1; c++)
                memcpy(out + (c - c0) * AMX_TILE_ELEMS, w + c * tile_bytes, tile_bytes);
        else if (bits == 8)
            amx_decompress_w8((const int8_t *)w, c0, c1, out);
        else if (is_block)
            amx_decompress_block(w, srow, scale_dtype, c0 / 4, groups, group_bits, out);
        else
            amx_decompress_tail(job, w, srow, c0, c1, out);
    }
}

TARGET_AMX static void amx_decompress(const Job *job, int64_t n0, int64_t c0, int64_t c1, uint16_t *out) {
    amx_decompress_rows(job, n0, 0, AMX_ROWS, c0, c1, out);
}

/* y[m, n..n+count) = v's first count lanes, rounded as store_y rounds. */
TARGET_AMX static inline void store_y16(const Job *job, int64_t m, int64_t n, int count, __m512 v) {
    const __mmask16 mask = (__mmask16)((1u << count) - 1u);
    if (job->y_dtype == DTYPE_F32) {
        _mm512_mask_storeu_ps((float *)job->y + m * job->N + n, mask, v);
        return;
    }
    if (job->y_dtype == DTYPE_F16) {
        float lanes[16];
        _mm512_storeu_ps(lanes, v);
        for (int i = 0; i < count; i++)
            store_y(job, m, n + i, lanes[i]);
        return;
    }
    const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
    __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); /* NaN: kept, made quiet */
    rounded = _mm512_mask_or_epi32(rounded, nan, high, _mm512_set1_epi32(0x40));
    _mm256_mask_storeu_epi16((uint16_t *)job->y + m * job->N + n, mask, _mm512_cvtepi32_epi16(rounded));
}

/* C0 += strip . B tile b, over the strip's chunks: A and B loads alternate between two pairs of tiles, so
   a load never waits for a tdpbf16ps still reading its tile (reusing a tile at once: ~1.6x slower). */
TARGET_AMX static void amx_dot_1(const uint16_t *a, const uint32_t *b, int64_t num_kc) {
    int64_t c = 0;
    for (; c + 2 <= num_kc; c += 2) {
        _tile_loadd(4, a + c * AMX_TILE_ELEMS, 64);
        _tile_loadd(5, b + c * AMX_TILE_PAIRS, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, a + (c + 1) * AMX_TILE_ELEMS, 64);
        _tile_loadd(7, b + (c + 1) * AMX_TILE_PAIRS, 64);
        _tile_dpbf16ps(0, 6, 7);
    }
    if (c < num_kc) {
        _tile_loadd(4, a + c * AMX_TILE_ELEMS, 64);
        _tile_loadd(5, b + c * AMX_TILE_PAIRS, 64);
        _tile_dpbf16ps(0, 4, 5);
    }
}

/* C0, C1 += strip . B tiles b, b + next: each A tile loaded once for both, the tiles alternating. */
TARGET_AMX static void amx_dot_2(const uint16_t *a, const uint32_t *b, int64_t next, int64_t num_kc) {
    int64_t c = 0;
    for (; c + 2 <= num_kc; c += 2) {
        _tile_loadd(2, a + c * AMX_TILE_ELEMS, 64);
        _tile_loadd(4, b + c * AMX_TILE_PAIRS, 64);
        _tile_loadd(5, b + next + c * AMX_TILE_PAIRS, 64);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 2, 5);
        _tile_loadd(3, a + (c + 1) * AMX_TILE_ELEMS, 64);
        _tile_loadd(6, b + (c + 1) * AMX_TILE_PAIRS, 64);
        _tile_loadd(7, b + next + (c + 1) * AMX_TILE_PAIRS, 64);
        _tile_dpbf16ps(0, 3, 6);
        _tile_dpbf16ps(1, 3, 7);
    }
    if (c < num_kc) {
        _tile_loadd(2, a + c * AMX_TILE_ELEMS, 64);
        _tile_loadd(4, b + c * AMX_TILE_PAIRS, 64);
        _tile_loadd(5, b + next + c * AMX_TILE_PAIRS, 64);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 2, 5);
    }
}

/* The 16 x 16 fp32 block c [n][m] transposed in registers: rows[m] = activation row m's 16 outputs. */
TARGET_AMX static void amx_transpose(const float *c, __m512 rows[AMX_ROWS]) {
    __m512 t[AMX_ROWS];
    for (int i = 0; i < AMX_ROWS; i += 2) { /* t[i + h]: rows i, i + 1 interleaved (h: high halves) */
        __m512 r0 = _mm512_load_ps(c + i * AMX_ROWS), r1 = _mm512_load_ps(c + (i + 1) * AMX_ROWS);
        t[i] = _mm512_unpacklo_ps(r0, r1);
        t[i + 1] = _mm512_unpackhi_ps(r0, r1);
    }
    for (int i = 0; i < AMX_ROWS; i += 4) /* rows[i + r], 128-bit lane l: n = i..i+3 of m = 4l + r */
        for (int h = 0; h < 2; h++) {
            __m512d lo = _mm512_castps_pd(t[i + h]), hi = _mm512_castps_pd(t[i + 2 + h]);
            rows[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi));
            rows[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi));
        }
    for (int r = 0; r < 4; r++) { /* the 128-bit lanes: lane l of rows[4q + r] to lane q of m = 4l + r */
        __m512 a0 = _mm512_shuffle_f32x4(rows[r], rows[4 + r], 0x88);
        __m512 a1 = _mm512_shuffle_f32x4(rows[r], rows[4 + r], 0xDD);
        __m512 b0 = _mm512_shuffle_f32x4(rows[8 + r], rows[12 + r], 0x88);
        __m512 b1 = _mm512_shuffle_f32x4(rows[8 + r], rows[12 + r], 0xDD);
        t[r] = _mm512_shuffle_f32x4(a0, b0, 0x88);
        t[8 + r] = _mm512_shuffle_f32x4(a0, b0, 0xDD);
        t[4 + r] = _mm512_shuffle_f32x4(a1, b1, 0x88);
        t[12 + r] = _mm512_shuffle_f32x4(a1, b1, 0xDD);
    }
    for (int i = 0; i < AMX_ROWS; i++)
        rows[i] = t[i];
}

/* Activation rows m..m+16 (m a multiple of 16; other m: nothing, that tile's first row did it) as B
   tiles: layout [m tile][input tile c][pair kk 0..15][row 0..15] of 32-bit pairs, in the weight tiles'
   input order (amx_decompress): tile c = 4b + p of a whole block b of 128 inputs holds
   (x[m, 128b + 8kk + p], x[m, 128b + 8kk + 4 + p]); a tile past the last whole block (K % 128), and every
   tile of an int8 or bf16 weight, holds (x[m, 32c + 2kk], x[m, 32c + 2kk + 1]). Rows M..(M rounded up to
   16) zero. Per row one vpermt2w per 64 inputs and tile gives its 16 pairs, a 16 x 16 transpose
   (amx_transpose) the tile's whole lines. */
TARGET_AMX static void convert_row_amx(const Job *job, int64_t m) {
    if (m % AMX_ROWS)
        return;
    const int64_t num_kc = job->K / AMX_KC, block_tiles = job->weight_bits == 4 ? job->K / 128 * 4 : 0;
    const int num_rows = job->M - m < AMX_ROWS ? (int)(job->M - m) : AMX_ROWS;
    uint32_t *out = (uint32_t *)job->xp + (m / AMX_ROWS) * num_kc * AMX_TILE_PAIRS;
    const uint16_t *x = (const uint16_t *)job->x + m * job->K;
    /* word 2kk + h of tile p (kk < 8) is input 8kk + 4h + p of 64 */
    const __m512i idx0 = _mm512_set_epi16(60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0, 60, 56, 52, 48,
                                          44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
    float pairs[4][AMX_ROWS * AMX_ROWS] __attribute__((aligned(64))); /* [tile p][row][kk] */
    memset(pairs, 0, sizeof pairs);
    __m512 lines[AMX_ROWS];
    for (int64_t c = 0; c < num_kc; c += 4) {
        const int is_block = c < block_tiles, num_tiles = is_block ? 4 : (int)(num_kc - c < 4 ? num_kc - c : 4);
        for (int r = 0; r < num_rows; r++) {
            const uint16_t *xr = x + r * job->K + c * AMX_KC;
            for (int p = 0; p < num_tiles; p++) {
                __m512i v;
                if (is_block) {
                    __m512i idx = _mm512_add_epi16(idx0, _mm512_set1_epi16((short)p));
                    __m512i lo = _mm512_permutex2var_epi16(_mm512_loadu_si512(xr), idx, _mm512_loadu_si512(xr + 32));
                    __m512i hi =
                        _mm512_permutex2var_epi16(_mm512_loadu_si512(xr + 64), idx, _mm512_loadu_si512(xr + 96));
                    v = _mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1);
                } else {
                    v = _mm512_loadu_si512(xr + p * AMX_KC);
                }
                _mm512_store_si512(pairs[p] + r * AMX_ROWS, v);
            }
        }
        for (int p = 0; p < num_tiles; p++, out += AMX_TILE_PAIRS) {
            amx_transpose(pairs[p], lines);
            for (int kk = 0; kk < AMX_ROWS; kk++)
                _mm512_store_ps(out + kk * AMX_ROWS, lines[kk]);
        }
    }
}

/* amx_store for bf16 y with half the shuffle-port work of the fp32 transpose and store_y16's rounding
   (the y stores were ~10% of the kernel at 32 rows): rows 2k and 2k + 1 of c rounded together by
   vcvtne2ps2bf16 (to nearest even, NaN made quiet: f32_to_bf16's bits; it would flush a denormal, which
   tdpbf16ps's sums never are), one vpermw makes dword m of d[k] (c[2k][m], c[2k + 1][m]), and the 8 x 16
   dwords are transposed in three steps: d[k] dword m -> y row m, dword k. */
TARGET_AMX static void amx_store_bf16(const Job *job, const float *c, int64_t n0, int64_t m0) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i d[8], e[8];
    for (int k = 0; k < 8; k++) {
        const float *row = c + 2 * k * AMX_ROWS;
        __m512bh h = _mm512_cvtne2ps_pbh(_mm512_load_ps(row + AMX_ROWS), _mm512_load_ps(row));
        __m512i words;
        memcpy(&words, &h, sizeof words);
        d[k] = _mm512_permutexvar_epi16(pairs, words);
    }
    for (int k = 0; k < 8; k += 2) { /* 128-bit lane l: e[k] d[k], d[k + 1] at 4l, 4l + 1; e[k + 1] at 4l + 2, 3 */
        e[k] = _mm512_unpacklo_epi32(d[k], d[k + 1]);
        e[k + 1] = _mm512_unpackhi_epi32(d[k], d[k + 1]);
    }
    for (int h = 0; h < 8; h += 4) { /* lane l of d[h + j]: the old d[h..h+3] at m = 4l + j */
        d[h] = _mm512_unpacklo_epi64(e[h], e[h + 2]);
        d[h + 1] = _mm512_unpackhi_epi64(e[h], e[h + 2]);
        d[h + 2] = _mm512_unpacklo_epi64(e[h + 1], e[h + 3]);
        d[h + 3] = _mm512_unpackhi_epi64(e[h + 1], e[h + 3]);
    }
    const int count = job->N - n0 < AMX_ROWS ? (int)(job->N - n0) : AMX_ROWS;
    const __mmask16 mask = (__mmask16)((1u << count) - 1u);
    uint16_t *y = (uint16_t *)job->y + m0 * job->N + n0;
    for (int j = 0; j < 4; j++) /* rows m = 4l + j: lane l of d[j] (n 0..7), then of d[4 + j] (n 8..15) */
        for (int l = 0; l < 4; l += 2) {
            const __m512i idx = _mm512_set_epi64(8 + 2 * l + 3, 8 + 2 * l + 2, 2 * l + 3, 2 * l + 2, 8 + 2 * l + 1,
                                                 8 + 2 * l, 2 * l + 1, 2 * l);
            const __m512i rows = _mm512_permutex2var_epi64(d[j], idx, d[4 + j]); /* m = 4l + j, 4(l + 1) + j */
            const int64_t m = 4 * l + j;
            if (m0 + m < job->M)
                _mm256_mask_storeu_epi16(y + m * job->N, mask, _mm512_castsi512_si256(rows));
            if (m0 + m + 4 < job->M)
                _mm256_mask_storeu_epi16(y + (m + 4) * job->N, mask, _mm512_extracti64x4_epi64(rows, 1));
        }
}

/* c [n][m] times row n0 + n's scale into scaled (W8A16's int8 weight: one scale per output row). */
TARGET_AMX static const float *amx_scale_rows(const Job *job, const float *c, int64_t n0, float *scaled) {
    for (int64_t n = 0; n < AMX_ROWS; n++) {
        const float s = n0 + n < job->N ? row_scale(job->scale + (n0 + n) * job->scale_size, job->scale_dtype, 0)
                                        : 0.0f;
        _mm512_store_ps(scaled + n * AMX_ROWS, _mm512_mul_ps(_mm512_load_ps(c + n * AMX_ROWS), _mm512_set1_ps(s)));
    }
    return scaled;
}

/* The 16 x 16 accumulator block c (C[n][m], weight rows n0.., activation rows m0..) into y. */
TARGET_AMX static void amx_store(const Job *job, const float *c, int64_t n0, int64_t m0) {
    float scaled[AMX_ROWS * AMX_ROWS] __attribute__((aligned(64)));
    if (job->weight_bits == 8)
        c = amx_scale_rows(job, c, n0, scaled);
    if (job->y_dtype == DTYPE_BF16) {
        amx_store_bf16(job, c, n0, m0);
        return;
    }
    __m512 rows[AMX_ROWS];
    amx_transpose(c, rows);
    const int count = job->N - n0 < AMX_ROWS ? (int)(job->N - n0) : AMX_ROWS;
    for (int64_t i = 0; i < AMX_ROWS && m0 + i < job->M; i++)
        store_y16(job, m0 + i, n0, count, rows[i]);
}

/* Accumulators C0 (and, if two, C1) into y: activation tiles mt (and mt + 1), weight rows n0... */
TARGET_AMX static void amx_flush(const Job *job, int64_t n0, int64_t mt, int two) {
    float c[AMX_ROWS * AMX_ROWS] __attribute__((aligned(64)));
    _tile_stored(0, c, 64);
    amx_store(job, c, n0, mt * AMX_ROWS);
    if (two) {
        _tile_stored(1, c, 64);
        amx_store(job, c, n0, (mt + 1) * AMX_ROWS);
    }
}

/* C0 (and, if two, C1) += tiles c0..c1 of a (A tile c at a + (c - c0) * AMX_TILE_ELEMS) . B. */
TARGET_AMX static void amx_dot(const Job *job, const uint16_t *a, int64_t mt, int two, int64_t c0, int64_t c1) {
    const int64_t next = job->K / AMX_KC * AMX_TILE_PAIRS; /* one activation tile's pairs */
    const uint32_t *b = (const uint32_t *)job->xp + mt * next + c0 * AMX_TILE_PAIRS;
    if (two)
        amx_dot_2(a, b, next, c1 - c0);
    else
        amx_dot_1(a, b, c1 - c0);
}

/* C0, C2 (and, if two, C1, C3) += A tiles a0, a1 (one input tile of two strips) . B tiles b (and b + next):
   2 A and 1 or 2 B loads for 2 or 4 tdpbf16ps. Every tile is loaded again for the next input tile, and
   that load waits for the last tdpbf16ps reading it, so the order frees first the tiles that load slowest:
   B0 (from L2: a call's activation tiles do not stay in L1 beside the ring) is last read by the second,
   A0 by the third, and B1's load has two tdpbf16ps to hide behind. (A0 B0, A0 B1, A1 B0, A1 B1: ~5% slower
   at 32 rows; B tiles from an L1-hot buffer instead: ~20% faster, so the B loads still cost.) */
TARGET_AMX static inline void amx_dot_pair(const uint16_t *a0, const uint16_t *a1, int64_t a_stride,
                                           const uint32_t *b, int64_t next, int two) {
    _tile_loadd(6, b, 64);
    _tile_loadd(4, a0, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a1, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    if (two) {
        _tile_loadd(7, b + next, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* A finished pair's accumulators, C0 (C1), C2 (C3), tile-stored into acc, into y: strips n and n + 16. */
TARGET_AMX static void amx_pair_store(const Job *job, float (*acc)[AMX_ROWS * AMX_ROWS], int64_t n, int two) {
    amx_store(job, acc[0], n, 0);
    if (two)
        amx_store(job, acc[1], n, AMX_ROWS);
    amx_store(job, acc[2], n + AMX_ROWS, 0);
    if (two)
        amx_store(job, acc[3], n + AMX_ROWS, AMX_ROWS);
}

/* num_pairs pairs of strips from weight row n0 (32 rows a pair) when M <= 32 (one pass): C0..C3 are strip
   x activation tile, so a B tile is loaded once for both strips. One pipeline runs over all the pairs'
   chunks: chunk g (of its pair's strips) is decompressed into one slot of a two-slot ring while chunk
   g - 1 goes through the tiles from the other, interleaved a quarter of the rows per input tile (run one
   after the other, the two did not overlap; chunk-at-a-time pipelining alone gave half the gain). When a
   pair's last chunk is through, its accumulators are tile-stored and zeroed for the next pair, and they
   go into y a chunk later: with the pipeline restarted per pair and the tile stores read back at once,
   [3072, 576] at 32 rows took ~12% longer. */
TARGET_AMX static void amx_pairs(const Job *job, int64_t n0, int64_t num_pairs, uint16_t *ring) {
    const int64_t num_kc = job->K / AMX_KC, next = num_kc * AMX_TILE_PAIRS;
    const int64_t per_pair = (num_kc + AMX_CHUNK - 1) / AMX_CHUNK, num_chunks = num_pairs * per_pair;
    const int two = job->M > AMX_ROWS;
    float acc[2][4][AMX_ROWS * AMX_ROWS] __attribute__((aligned(64))); /* pair p's in acc[p % 2] */
    int64_t waiting = -1; /* the pair whose accumulators wait in acc for their store into y */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t g = 0; g <= num_chunks; g++) {
        uint16_t *a = ring + g % 2 * 2 * AMX_RING_SLOT;
        const uint16_t *prev = ring + (g + 1) % 2 * 2 * AMX_RING_SLOT;
        const int64_t n = n0 + g / per_pair * 2 * AMX_ROWS, c0 = g % per_pair * AMX_CHUNK;
        const int64_t c1 = c0 + AMX_CHUNK < num_kc ? c0 + AMX_CHUNK : num_kc;
        const int64_t d0 = g > 0 ? (g - 1) % per_pair * AMX_CHUNK : num_kc; /* chunk g - 1's first tile */
        for (int q = 0; q < 4; q++) { /* a quarter of chunk g's rows per input tile of chunk g - 1 */
            if (d0 + q < num_kc)
                amx_dot_pair(prev + q * AMX_TILE_ELEMS, prev + AMX_RING_SLOT + q * AMX_TILE_ELEMS, 64,
                             (const uint32_t *)job->xp + (d0 + q) * AMX_TILE_PAIRS, next, two);
            if (g < num_chunks)
                amx_decompress_rows(job, n + q / 2 * AMX_ROWS, q % 2 * 8, q % 2 * 8 + 8, c0, c1,
                                    a + q / 2 * AMX_RING_SLOT);
        }
        if (waiting >= 0) {
            amx_pair_store(job, acc[waiting % 2], n0 + waiting * 2 * AMX_ROWS, two);
            waiting = -1;
        }
        if (g > 0 && g % per_pair == 0) { /* chunk g - 1 was its pair's last */
            waiting = (g - 1) / per_pair;
            float(*c)[AMX_ROWS * AMX_ROWS] = acc[waiting % 2];
            _tile_stored(0, c[0], 64); /* in the order of their last tdpbf16ps (amx_dot_pair) */
            _tile_zero(0);
            _tile_stored(2, c[2], 64);
            _tile_zero(2);
            if (two) {
                _tile_stored(1, c[1], 64);
                _tile_zero(1);
                _tile_stored(3, c[3], 64);
                _tile_zero(3);
            }
        }
    }
    if (waiting >= 0)
        amx_pair_store(job, acc[waiting % 2], n0 + waiting * 2 * AMX_ROWS, two);
}

/* A dense bf16 weight (weight_bits 16), M <= 32: num_pairs pairs of strips from weight row n0, all rows
   below N, with the A tiles loaded straight from the weight's rows (stride 2K bytes): nothing to
   decompress, so no ring and no pipeline. The next pair's rows are prefetched into L2 a tile at a time. */
TARGET_AMX static void amx_pairs_dense(const Job *job, int64_t n0, int64_t num_pairs) {
    const int64_t K = job->K, num_kc = K / AMX_KC, next = num_kc * AMX_TILE_PAIRS;
    const int two = job->M > AMX_ROWS;
    const uint32_t *b = (const uint32_t *)job->xp;
    float acc[4][AMX_ROWS * AMX_ROWS] __attribute__((aligned(64)));
    for (int64_t p = 0; p < num_pairs; p++) {
        const int64_t n = n0 + p * 2 * AMX_ROWS;
        const uint16_t *a = (const uint16_t *)job->packed + n * K;
        const int prefetch = p + 1 < num_pairs;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < num_kc; c++) {
            if (prefetch)
                for (int r = 0; r < 2 * AMX_ROWS; r++)
                    _mm_prefetch((const char *)(a + (2 * AMX_ROWS + r) * K + c * AMX_KC), _MM_HINT_T1);
            amx_dot_pair(a + c * AMX_KC, a + AMX_ROWS * K + c * AMX_KC, 2 * K, b + c * AMX_TILE_PAIRS, next, two);
        }
        _tile_stored(0, acc[0], 64);
        _tile_stored(2, acc[2], 64);
        if (two) {
            _tile_stored(1, acc[1], 64);
            _tile_stored(3, acc[3], 64);
        }
        amx_pair_store(job, acc, n, two);
    }
}

/* Weight rows n0..n0+16 (a strip) through all activation rows. The first pass (activation tiles 0 and 1)
   decompresses the strip AMX_CHUNK tiles at a time just before their tdpbf16ps: into a ring of two chunks
   when that is the only pass (M <= 32), which stays in L1, else into the whole strip buffer, which the
   other passes read. (Decompressing a whole 16 x K strip first and then loading its tiles ran ~2x
   slower: its stores missed L1.) */
TARGET_AMX static void amx_strip(const Job *job, int64_t n0, uint16_t *strip) {
    const int64_t num_kc = job->K / AMX_KC, num_mt = (job->M + AMX_ROWS - 1) / AMX_ROWS;
    const int is_ring = num_mt <= 2;
    _tile_zero(0);
    _tile_zero(1);
    uint16_t *prev = NULL;
    int64_t p0 = 0, p1 = 0;
    for (int64_t c0 = 0; c0 < num_kc; c0 += AMX_CHUNK) {
        int64_t c1 = c0 + AMX_CHUNK < num_kc ? c0 + AMX_CHUNK : num_kc;
        uint16_t *a = strip + (is_ring ? (c0 / AMX_CHUNK) % 2 * AMX_RING_SLOT : c0 * AMX_TILE_ELEMS);
        amx_decompress(job, n0, c0, c1, a);
        if (prev)
            amx_dot(job, prev, 0, num_mt > 1, p0, p1);
        prev = a, p0 = c0, p1 = c1;
    }
    amx_dot(job, prev, 0, num_mt > 1, p0, p1);
    amx_flush(job, n0, 0, num_mt > 1);
    for (int64_t mt = 2; mt < num_mt; mt += 2) {
        _tile_zero(0);
        _tile_zero(1);
        amx_dot(job, strip, mt, mt + 1 < num_mt, 0, num_kc);
        amx_flush(job, n0, mt, mt + 1 < num_mt);
    }
}

/* This thread's strip buffer: a whole strip (16 x K bf16) or the ring; NULL when out of memory. Grown
   when K grows, kept for the thread's life. */
static uint16_t *amx_strip_of(int64_t K) {
    static _Thread_local uint16_t *strip;
    static _Thread_local int64_t strip_k;
    K = K > 4 * AMX_RING_SLOT / AMX_ROWS ? K : 4 * AMX_RING_SLOT / AMX_ROWS; /* a pair's ring */
    if (K > strip_k) {
        free(strip);
        strip_k = 0;
        if (posix_memalign((void **)&strip, 64, (size_t)(AMX_ROWS * K) * sizeof(uint16_t)) != 0) {
            strip = NULL;
            return NULL;
        }
        strip_k = K;
    }
    return strip;
}

/* Output rows [n0, n1) (n0 a multiple of 16) on this thread's tiles. */
TARGET_AMX static void gemm_amx(Job *job, int64_t n0, int64_t n1) {
    uint16_t *strip = amx_strip_of(job->K);
    if (strip == NULL) {
        atomic_store(&job->failed, 1);
        return;
    }
    amx_load_config();
    int64_t n = n0;
    if (job->M <= 2 * AMX_ROWS && job->weight_bits == 16) { /* whole pairs straight from the weight */
        const int64_t num_pairs = (n1 - n0) / (2 * AMX_ROWS);
        amx_pairs_dense(job, n0, num_pairs);
        n += num_pairs * 2 * AMX_ROWS;
    } else if (job->M <= 2 * AMX_ROWS) { /* pairs while a second strip starts before n1, then a strip if one is left */
        const int64_t num_pairs = (n1 - n0 + AMX_ROWS - 1) / (2 * AMX_ROWS);
        amx_pairs(job, n0, num_pairs, strip);
        n += num_pairs * 2 * AMX_ROWS;
    }
    for (; n < n1; n += AMX_ROWS)
        amx_strip(job, n, strip);
    _tile_release(); /* the thread's tiles back to their init state (oneDNN runs AMX on it too) */
}

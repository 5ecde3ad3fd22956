// The native engine's products y = x w^T, by the three kernels of specdec_matmul:
// - the step kernel: fp32 activations times any weight but paired blocks: blk4 (Q4_1), blk8 (Q8_0), blk5 (5-bit codes:
//   Q5_0, Q5_1, Q5_K), blk6 (Q8 with a scale per 16: Q6_K) or rows of bf16, f16 or f32 (a checkpoint's own precision).
//   A loop's tasks are groups of output columns, each over every row, so a weight is read from memory once for all
//   the rows of a call (a decode step's one, a verify pass's several).
// - a prompt's kernel: the same weights, a task's columns decoded to fp32 once, then multiplied in tiles of rows and
//   columns.
// - the draft's: activations rounded to two int8 parts times paired Q4_1 blocks (blk4p) or blk8.
// Which kernels take which weight kind is specdec_kinds.h's table; KIND_OPS below holds each kind's code.
// (The int8 activations mode's kernels, one int8 part per block, are linear_q8a.c's.)
// AVX2 + FMA + F16C; the builds for CPUs that have them add AVX-512 + VNNI, and VBMI's multishift for blk5's codes
// (build.py: isa()). Every build gives the same bits.
//
// Summation order: every output is the sum over its blocks, elements 0-7 and 16-23 of each block in one chain and
// 8-15 and 24-31 in another, then the two chains added; the same for every row, whatever the number of rows, the
// tile a row falls in, the thread count or the kernel (a prompt's decodes its weights first and tiles rows and
// columns differently, in the same order per output). So a row's result depends only on its own activations.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "pool.h"

#ifdef __AVX512F__
#define MAXR 8      /* rows per read of the weights (the step kernel): one 16-lane accumulator a row */
#else
#define MAXR 6      /* rows per read of the weights (the step kernel) */
#endif
#define COLUMNS 16  /* output columns per task of the step kernel (their weights stay in L1 over the row tiles) */
#ifdef __AVX512F__
#define PR 4  /* a prompt tile's rows: 4 x 6 outputs of one 16-lane accumulator, 6 weights, 1 activation: 31 registers */
#define PC 6  /* ... and columns */
#else
#define PR 2  /* a prompt tile's rows: 2 x 3 outputs of two chains each, 3 weights and 1 activation in 16 registers */
#define PC 3  /* ... and columns */
#endif
#define PREFILL_COLUMNS 24  /* columns per task of a prompt: their decoded weights stay in L2 while the rows pass */
#ifndef PREFETCH
#define PREFETCH 4096  /* bytes ahead (benchmarks/native_ab.py measures other distances) */
#endif
#ifndef FAR
#define FAR 8192  /* bytes ahead, into L2, for bf16 / f16 / f32 rows read for several rows (see rows_cols) */
#endif
#define S8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define FETCH(p) _mm_prefetch((const char *)(p) + PREFETCH, _MM_HINT_T0)
#define FETCH_FAR(p) _mm_prefetch((const char *)(p) + FAR, _MM_HINT_T1)

// R rows (1..MAXR) of fp32 activations at x (row stride K) times columns n0..n1 of w -> y (row stride N).
// Two accumulators per row keep the FMA chains short.
static inline __attribute__((always_inline)) void rows_times(const int R, const float *x, int K, __m256 w0, __m256 w1,
                                                             __m256 w2, __m256 w3, __m256 acc[][2]) {
    for (int r = 0; r < R; r++) {
        const float *xr = x + (size_t)r * K;
        acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r][1]);
        acc[r][0] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), acc[r][1]);
    }
}
// A Q4_1 block's 32 weights as four vectors of 8 (q[0..7], q[8..15], q[16..23], q[24..31]): each half of qs
// zero-extended to 8 lanes straight from memory, then its low and high nibbles (6 integer operations a block;
// benchmarks/native_ab.py times two builds, one with another decode)
#define Z8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define Q4_DECODE(blk, mask, w0, w1, w2, w3) \
    const __m256i lo8_ = Z8((blk).qs), hi8_ = Z8((blk).qs + 8); \
    const __m256 d_ = _mm256_broadcast_ss(&(blk).d), m_ = _mm256_broadcast_ss(&(blk).m); \
    const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(lo8_, mask)), d_, m_); \
    const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(hi8_, mask)), d_, m_); \
    const __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo8_, 4)), d_, m_); \
    const __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi8_, 4)), d_, m_)
// (blk5's Q5_BIT: internal.h)
// a dword lane's shuffle of q[k]'s two bytes (the code within bits Q5_BIT(k) % 8 .. + 4 of them) and two zeros
#define Q5_BYTES(k) ((int)((unsigned)(Q5_BIT(k) >> 3) | (unsigned)((Q5_BIT(k) >> 3) + 1) << 8 | 0x80800000u))
#define Q5_BYTES8(k) _mm256_setr_epi32(Q5_BYTES(k), Q5_BYTES(k + 1), Q5_BYTES(k + 2), Q5_BYTES(k + 3), \
                                        Q5_BYTES(k + 4), Q5_BYTES(k + 5), Q5_BYTES(k + 6), Q5_BYTES(k + 7))
#define Q5_SHIFTS8(k) _mm256_setr_epi32(Q5_BIT(k) & 7, Q5_BIT(k + 1) & 7, Q5_BIT(k + 2) & 7, Q5_BIT(k + 3) & 7, \
                                         Q5_BIT(k + 4) & 7, Q5_BIT(k + 5) & 7, Q5_BIT(k + 6) & 7, Q5_BIT(k + 7) & 7)
// codes k..k+7 of a half's 16 bytes, broadcast to both 128-bit lanes (a shuffle stays within its lane)
#define Q5_PICK(v, k) _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(v, Q5_BYTES8(k)), Q5_SHIFTS8(k)), \
                                       _mm256_set1_epi32(31))
// A 5-bit block's 32 weights as four vectors of 8, d * q + m as Q4_DECODE's: 12 integer operations a block, where
// a nibble and a fifth bit apart took 30
#define Q5_DECODE(blk, w0, w1, w2, w3) \
    const __m256i lo_ = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk).codes)); \
    const __m256i hi_ = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((blk).codes + 5))); \
    const __m256 d_ = _mm256_broadcast_ss(&(blk).d), m_ = _mm256_broadcast_ss(&(blk).m); \
    const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Q5_PICK(lo_, 0)), d_, m_); \
    const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Q5_PICK(lo_, 8)), d_, m_); \
    const __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Q5_PICK(hi_, 0)), d_, m_); \
    const __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Q5_PICK(hi_, 8)), d_, m_)
#ifdef __AVX512F__
// The same products with 16 lanes (AVX-512 builds): a row's accumulator holds both chains, lanes 0-7 the first and
// 8-15 the second. A block's weights are two vectors, elements 0-15 and 16-31, so lane l takes element l and then
// element 16 + l: the first chain's elements 0-7 then 16-23, the second's 8-15 then 24-31, as with 8 lanes; the
// halves are added as the two chains are. Same order, same bits, and every row of a call in one read of the weights.
static inline __attribute__((always_inline)) void rows_times16(const int R, const float *x, int K, __m512 wa,
                                                               __m512 wb, __m512 *acc) {
    for (int r = 0; r < R; r++) {
        const float *xr = x + (size_t)r * K;
        acc[r] = _mm512_fmadd_ps(wa, _mm512_loadu_ps(xr), acc[r]);
        acc[r] = _mm512_fmadd_ps(wb, _mm512_loadu_ps(xr + 16), acc[r]);
    }
}
static inline float hsum16(__m512 v) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
// A block's weights as elements 0-15 and 16-31
// (Q4_1: the block's 16 values d * q + m, q = 0..15, by one FMA, then each weight's own by its nibble: vpermps reads
// an index's low 4 bits, so the low nibbles need no mask. The same bits as d * q + m of each weight, in 5 vector
// operations a block against 7.)
static inline __attribute__((always_inline)) void q4_decode16(const blk4 *blk, __m512 *wa, __m512 *wb) {
    const __m512 levels = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_ps(blk->d), _mm512_set1_ps(blk->m));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blk->qs));
    *wa = _mm512_permutexvar_ps(q, levels);
    *wb = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), levels);
}
static inline __attribute__((always_inline)) void q8_decode16(const blk8 *blk, __m512 *wa, __m512 *wb) {
    const __m512 d = _mm512_set1_ps(blk->d);
    *wa = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)blk->qs))), d);
    *wb = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk->qs + 16)))), d);
}
// (blk5: the block's 32 values d * q + m, q = 0..31, by two FMAs, then each half's 16 weights by one 32-entry lookup,
// vpermt2ps reading an index's low 5 bits. Each half's 16 bytes are broadcast to the four 128-bit lanes, so each
// 8-byte half of them lands in every other 64-bit lane, the one whose two codes it holds (specdec_native.h). With
// VBMI one multishift puts each code's bits at its dword's bottom: 8 vector operations a block, as Q4_1's 7;
// without, a byte shuffle and a shift: 10. The per-element conversion it replaces took 13.)
#ifdef __AVX512VBMI__
#define Q5_INDEX(v) _mm512_multishift_epi64_epi8(_mm512_setr_epi32( \
    Q5_BIT(0), Q5_BIT(1), Q5_BIT(2) - 64, Q5_BIT(3) - 64, Q5_BIT(4), Q5_BIT(5), Q5_BIT(6) - 64, Q5_BIT(7) - 64, \
    Q5_BIT(8), Q5_BIT(9), Q5_BIT(10) - 64, Q5_BIT(11) - 64, Q5_BIT(12), Q5_BIT(13), Q5_BIT(14) - 64, \
    Q5_BIT(15) - 64), v)
#else
#define Q5_INDEX(v) _mm512_srlv_epi32(_mm512_shuffle_epi8(v, _mm512_inserti64x4(_mm512_castsi256_si512(Q5_BYTES8(0)), \
                                                                                 Q5_BYTES8(8), 1)), \
                                      _mm512_inserti64x4(_mm512_castsi256_si512(Q5_SHIFTS8(0)), Q5_SHIFTS8(8), 1))
#endif
static inline __attribute__((always_inline)) void q5_decode16(const blk5 *blk, __m512 *wa, __m512 *wb) {
    const __m512 d = _mm512_set1_ps(blk->d), m = _mm512_set1_ps(blk->m);
    const __m512 low = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), d, m);
    const __m512 high = _mm512_fmadd_ps(_mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31),
                                        d, m);
    const __m512i a = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)blk->codes));
    const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(blk->codes + 5)));
    *wa = _mm512_permutex2var_ps(low, Q5_INDEX(a), high);
    *wb = _mm512_permutex2var_ps(low, Q5_INDEX(b), high);
}
static inline __attribute__((always_inline)) void q6_decode16(const blk6 *blk, __m512 *wa, __m512 *wb) {
    *wa = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)blk->qs))),
                        _mm512_set1_ps(blk->d[0]));
    *wb = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk->qs + 16)))),
                        _mm512_set1_ps(blk->d[1]));
}
// (a block of a row from p: its elements 16-31 start 64 bytes on for f32, 32 for f16 and bf16)
static inline __attribute__((always_inline)) void row_decode16(const int kind, const char *p, __m512 *wa, __m512 *wb) {
    if (kind == W_F32) {
        *wa = _mm512_loadu_ps(p), *wb = _mm512_loadu_ps(p + 64);
    } else if (kind == W_F16) {
        *wa = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        *wb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
    } else {
        #define BF16X16(v) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(v)), 16))
        *wa = BF16X16((const __m256i *)p), *wb = BF16X16((const __m256i *)(p + 32));
        #undef BF16X16
    }
}
// Blocks' columns two at a time (16 + 4 + 2 registers at 8 rows): a row's activations are loaded once for both, and
// one row's step has two accumulator chains in flight, not one (its FMAs wait on each other otherwise); rows of
// bf16 / f16 / f32 weights go a column at a time, as their verify passes were slower in pairs where measured. AT(n, b) is
// the address of column n's block b, DECODE(address, &wa, &wb) its weights; each output's sums in the order above.
// FAR_TOO: also fetch FAR bytes ahead into L2 (see rows_cols).
// A row's activations held in registers for both columns: GCC would otherwise fold each load into both columns' FMAs,
// loading them twice, and with several rows the loads, not the FMAs, would bound the loop
#define IN_REGISTERS(a, b) __asm__("" : "+v"(a), "+v"(b))
#define STEP16(PAIRS, R, nb, AT, DECODE, FAR_TOO) \
    int n = n0; \
    for (; PAIRS && n + 2 <= n1; n += 2) { \
        __m512 acc0[MAXR], acc1[MAXR]; \
        for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm512_setzero_ps(); \
        for (int b = 0; b < nb; b++) { \
            __m512 wa0, wb0, wa1, wb1; \
            FETCH(AT(n, b)); FETCH(AT(n + 1, b)); \
            DECODE(AT(n, b), &wa0, &wb0); DECODE(AT(n + 1, b), &wa1, &wb1); \
            for (int r = 0; r < R; r++) { \
                const float *xr = x + (size_t)r * K + b * BLOCK; \
                __m512 xa = _mm512_loadu_ps(xr), xb = _mm512_loadu_ps(xr + 16); \
                IN_REGISTERS(xa, xb); \
                acc0[r] = _mm512_fmadd_ps(wb0, xb, _mm512_fmadd_ps(wa0, xa, acc0[r])); \
                acc1[r] = _mm512_fmadd_ps(wb1, xb, _mm512_fmadd_ps(wa1, xa, acc1[r])); \
            } \
        } \
        for (int r = 0; r < R; r++) { \
            y[(size_t)r * N + n] = hsum16(acc0[r]); y[(size_t)r * N + n + 1] = hsum16(acc1[r]); \
        } \
    } \
    for (; n < n1; n++) { \
        __m512 acc[MAXR]; \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(); \
        for (int b = 0; b < nb; b++) { \
            __m512 wa, wb; \
            FETCH(AT(n, b)); \
            if (FAR_TOO) FETCH_FAR(AT(n, b)); \
            DECODE(AT(n, b), &wa, &wb); \
            rows_times16(R, x + b * BLOCK, K, wa, wb, acc); \
        } \
        for (int r = 0; r < R; r++) y[(size_t)r * N + n] = hsum16(acc[r]); \
    }
static inline __attribute__((always_inline)) void q4_cols(const int R, const float *x, int K, const blk4 *w, float *y,
                                                          int N, int n0, int n1) {
    const int nb = K / BLOCK;
    #define Q4_AT(n, b) (w + (size_t)(n) * nb + (b))
    STEP16(1, R, nb, Q4_AT, q4_decode16, 0)
    #undef Q4_AT
}
static inline __attribute__((always_inline)) void q8_cols(const int R, const float *x, int K, const blk8 *w, float *y,
                                                          int N, int n0, int n1) {
    const int nb = K / BLOCK;
    #define Q8_AT(n, b) (w + (size_t)(n) * nb + (b))
    STEP16(1, R, nb, Q8_AT, q8_decode16, 0)
    #undef Q8_AT
}
static inline __attribute__((always_inline)) void q6_cols(const int R, const float *x, int K, const blk6 *w, float *y,
                                                          int N, int n0, int n1) {
    const int nb = K / BLOCK;
    #define Q6_AT(n, b) (w + (size_t)(n) * nb + (b))
    STEP16(1, R, nb, Q6_AT, q6_decode16, 0)
    #undef Q6_AT
}
static inline __attribute__((always_inline)) void q5_cols(const int R, const float *x, int K, const blk5 *w, float *y,
                                                          int N, int n0, int n1) {
    const int nb = K / BLOCK;
    #define Q5_AT(n, b) (w + (size_t)(n) * nb + (b))
    STEP16(1, R, nb, Q5_AT, q5_decode16, 0)
    #undef Q5_AT
}
#else
static inline __attribute__((always_inline)) void q4_cols(const int R, const float *x, int K, const blk4 *w, float *y,
                                                          int N, int n0, int n1) {
    const int nb = K / BLOCK; const __m256i mask = _mm256_set1_epi32(0x0F);
    for (int n = n0; n < n1; n++) {
        const blk4 *c = w + (size_t)n * nb;
        __m256 acc[MAXR][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            FETCH(c + b);
            Q4_DECODE(c[b], mask, w0, w1, w2, w3);
            rows_times(R, x + b * BLOCK, K, w0, w1, w2, w3, acc);
        }
        for (int r = 0; r < R; r++) y[(size_t)r * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}
static inline __attribute__((always_inline)) void q8_cols(const int R, const float *x, int K, const blk8 *w, float *y,
                                                          int N, int n0, int n1) {
    const int nb = K / BLOCK;
    for (int n = n0; n < n1; n++) {
        const blk8 *c = w + (size_t)n * nb;
        __m256 acc[MAXR][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            FETCH(c + b);
            const __m256 d = _mm256_broadcast_ss(&c[b].d);
            rows_times(R, x + b * BLOCK, K, _mm256_mul_ps(S8(c[b].qs), d), _mm256_mul_ps(S8(c[b].qs + 8), d),
                       _mm256_mul_ps(S8(c[b].qs + 16), d), _mm256_mul_ps(S8(c[b].qs + 24), d), acc);
        }
        for (int r = 0; r < R; r++) y[(size_t)r * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}
static inline __attribute__((always_inline)) void q5_cols(const int R, const float *x, int K, const blk5 *w, float *y,
                                                          int N, int n0, int n1) {
    const int nb = K / BLOCK;
    for (int n = n0; n < n1; n++) {
        const blk5 *c = w + (size_t)n * nb;
        __m256 acc[MAXR][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            FETCH(c + b);
            Q5_DECODE(c[b], w0, w1, w2, w3);
            rows_times(R, x + b * BLOCK, K, w0, w1, w2, w3, acc);
        }
        for (int r = 0; r < R; r++) y[(size_t)r * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}
static inline __attribute__((always_inline)) void q6_cols(const int R, const float *x, int K, const blk6 *w, float *y,
                                                          int N, int n0, int n1) {
    const int nb = K / BLOCK;
    for (int n = n0; n < n1; n++) {
        const blk6 *c = w + (size_t)n * nb;
        __m256 acc[MAXR][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            FETCH(c + b);
            const __m256 d0 = _mm256_broadcast_ss(&c[b].d[0]), d1 = _mm256_broadcast_ss(&c[b].d[1]);
            rows_times(R, x + b * BLOCK, K, _mm256_mul_ps(S8(c[b].qs), d0), _mm256_mul_ps(S8(c[b].qs + 8), d0),
                       _mm256_mul_ps(S8(c[b].qs + 16), d1), _mm256_mul_ps(S8(c[b].qs + 24), d1), acc);
        }
        for (int r = 0; r < R; r++) y[(size_t)r * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}
#endif
// A column's K weights as fp32 (a prompt's kernel; a tied embedding's row), out at any alignment (KIND_OPS' decode)
#define STORE4(out, w0, w1, w2, w3) \
    _mm256_storeu_ps(out, w0), _mm256_storeu_ps(out + 8, w1), _mm256_storeu_ps(out + 16, w2), \
    _mm256_storeu_ps(out + 24, w3)
static void decode_q41(const void *column, int K, float *out) {
    const blk4 *c = column;
    const __m256i mask = _mm256_set1_epi32(0x0F);
    for (int b = 0; b < K / BLOCK; b++, out += BLOCK) {
        FETCH(c + b);
        Q4_DECODE(c[b], mask, w0, w1, w2, w3);
        STORE4(out, w0, w1, w2, w3);
    }
}
static void decode_q80(const void *column, int K, float *out) {
    const blk8 *c = column;
    for (int b = 0; b < K / BLOCK; b++, out += BLOCK) {
        FETCH(c + b);
        const __m256 d = _mm256_broadcast_ss(&c[b].d);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(S8(c[b].qs + 8 * j), d));
    }
}
static void decode_q5(const void *column, int K, float *out) {
    const blk5 *c = column;
    for (int b = 0; b < K / BLOCK; b++, out += BLOCK) {
        FETCH(c + b);
        Q5_DECODE(c[b], w0, w1, w2, w3);
        STORE4(out, w0, w1, w2, w3);
    }
}
static void decode_q6(const void *column, int K, float *out) {  // d[0] * q of elements 0-15, d[1] * q of 16-31
    const blk6 *c = column;
    for (int b = 0; b < K / BLOCK; b++, out += BLOCK) {
        FETCH(c + b);
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(S8(c[b].qs + 8 * j), _mm256_broadcast_ss(&c[b].d[j / 2])));
    }
}
#ifdef __AVX512F__
// ... with 16 lanes: lane l takes element k + l for k = 0, 16, 32, ..., the two chains' elements in their order
static inline __attribute__((always_inline)) void prefill_tile(const int R, const int C, const float *x, int K,
                                                               const float *w, float *y, int N) {
    __m512 acc[PR][PC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        __m512 wv[PC];
        for (int c = 0; c < C; c++) wv[c] = _mm512_load_ps(w + (size_t)c * K + k);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_loadu_ps(x + (size_t)r * K + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(size_t)r * N + c] = hsum16(acc[r][c]);
}
#define EACH_C(R, C, CALL) switch (C) { case 1: CALL(R, 1); break; case 2: CALL(R, 2); break; \
    case 3: CALL(R, 3); break; case 4: CALL(R, 4); break; case 5: CALL(R, 5); break; default: CALL(R, 6); }
#define EACH_RC(R, C, CALL) switch (R) { case 1: EACH_C(1, C, CALL) break; case 2: EACH_C(2, C, CALL) break; \
    case 3: EACH_C(3, C, CALL) break; default: EACH_C(4, C, CALL) }
#else
// R rows of x (stride K) times C decoded columns at w (stride K) -> y[r * N + c], in the step kernel's order: two
// chains per output, elements k..k+7 into the first and k+8..k+15 into the second for k = 0, 16, 32, ...
static inline __attribute__((always_inline)) void prefill_tile(const int R, const int C, const float *x, int K,
                                                               const float *w, float *y, int N) {
    __m256 acc[PR][PC][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        for (int half = 0; half < 2; half++) {
            __m256 wv[PC];
            for (int c = 0; c < C; c++) wv[c] = _mm256_load_ps(w + (size_t)c * K + k + 8 * half);
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_loadu_ps(x + (size_t)r * K + k + 8 * half);
                for (int c = 0; c < C; c++) acc[r][c][half] = _mm256_fmadd_ps(wv[c], xv, acc[r][c][half]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(size_t)r * N + c] = hsum(_mm256_add_ps(acc[r][c][0], acc[r][c][1]));
}
#define EACH_RC(R, C, CALL) switch ((R) * 4 + (C)) { \
    case 5: CALL(1, 1); break; case 6: CALL(1, 2); break; case 7: CALL(1, 3); break; \
    case 9: CALL(2, 1); break; case 10: CALL(2, 2); break; default: CALL(2, 3); }
#endif
// x [M, K] -> a [M, K / BLOCK]: per block of 32, x ~ d * (128 * qs + lo): qs = round(x / step) (|qs| <= 127, step =
// max |x| / 127), lo the remainder in 1/128ths of a step (|lo| <= 64), d = step / 128; s the exact block sum
static inline void quantize_block(const float *xb, float *d, float *s, int8_t *qs, int8_t *lo) {
    const __m256 sign = _mm256_set1_ps(-0.0f), fine = _mm256_set1_ps(128.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256 v[4] = {_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16),
                         _mm256_loadu_ps(xb + 24)};
    const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t)); t = _mm_max_ss(t, _mm_movehdup_ps(t));
    const float amax = _mm_cvtss_f32(t);
    *d = amax / (127.f * 128.f);
    *s = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i code[4], rest[4];
    for (int k = 0; k < 4; k++) {
        const __m256 steps = _mm256_mul_ps(v[k], inv);
        code[k] = _mm256_cvtps_epi32(steps);  // to nearest
        rest[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(steps, _mm256_cvtepi32_ps(code[k])), fine));
    }
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(code[0], code[1]), _mm256_packs_epi32(code[2], code[3]));
    _mm256_storeu_si256((__m256i *)qs, _mm256_permutevar8x32_epi32(packed, order));
    packed = _mm256_packs_epi16(_mm256_packs_epi32(rest[0], rest[1]), _mm256_packs_epi32(rest[2], rest[3]));
    _mm256_storeu_si256((__m256i *)lo, _mm256_permutevar8x32_epi32(packed, order));
}
static void quantize_rows(const float *x, int M, int K, void *rounded) {
    blkq *a = rounded;
    for (int i = 0; i < M * (K / BLOCK); i++) quantize_block(x + (size_t)i * BLOCK, &a[i].d, &a[i].s, a[i].qs, a[i].lo);
}
// ... in pairs of blocks (blkqp), [M, (K / BLOCK + 1) / 2]
static void quantize_pairs(const float *x, int M, int K, void *rounded) {
    blkqp *a = rounded;
    const int nb = K / BLOCK, np = kind_elements(W_Q41P, K);
    for (int r = 0; r < M; r++)
        for (int b = 0; b < nb; b++) {
            blkqp *p = a + (size_t)r * np + b / 2; const int h = b % 2;
            quantize_block(x + (size_t)r * K + (size_t)b * BLOCK, &p->sc[h], &p->sc[2 + h], p->qs[h], p->lo[h]);
        }
    if (nb % 2)
        for (int r = 0; r < M; r++) {
            blkqp *p = a + (size_t)r * np + np - 1;
            p->sc[1] = p->sc[3] = 0.f; memset(p->qs[1], 0, sizeof p->qs[1]); memset(p->lo[1], 0, sizeof p->lo[1]);
        }
}
// The integer products of a block: 128 * (u . qs) + u . lo for unsigned u (maddubs' pairs stay within int16: u <= 128,
// |qs| <= 127), 8 int32 lanes of 4 products each
static inline __attribute__((always_inline)) __m256i products(__m256i u, __m256i qs, __m256i lo) {
#ifdef __AVX512VNNI__  // the same integers in three instructions: no pair of products can overflow in either
    return _mm256_dpbusd_epi32(_mm256_slli_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, qs), 7), u, lo);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, qs), _mm256_set1_epi16(128)),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(u, lo), _mm256_set1_epi16(1)));
#endif
}
// two blocks per step (blk4p x blkqp): one load of 64 codes, one conversion of both scales and minimums, both
// blocks' scales times the activations' in one multiply, the minimums' terms summed in lanes 2 and 3
static inline __attribute__((always_inline)) void q4p_cols(const int R, const blkqp *a, int np, const blk4p *w,
                                                           float *y, int N, int n0, int n1) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int n = n0; n < n1; n++) {
        const blk4p *c = w + (size_t)n * np;
        __m256 acc[MAXR][2]; __m128 terms[MAXR];
        for (int r = 0; r < R; r++) { acc[r][0] = acc[r][1] = _mm256_setzero_ps(); terms[r] = _mm_setzero_ps(); }
        for (int p = 0; p < np; p++) {
            FETCH(c + p);
            const __m256i v = _mm256_loadu_si256((const __m256i *)c[p].qs);
            const __m256i q0 = _mm256_and_si256(v, mask), q1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            const __m128 h = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)c[p].h));  // d0 d1 m0 m1
            for (int r = 0; r < R; r++) {
                const blkqp *ab = a + (size_t)r * np + p;
                // the weights' by the activations': d0 d0', d1 d1', m0 s0, m1 s1
                const __m128 sc = _mm_mul_ps(h, _mm_loadu_ps(ab->sc));
                const __m256i p0 = products(q0, _mm256_loadu_si256((const __m256i *)ab->qs[0]),
                                            _mm256_loadu_si256((const __m256i *)ab->lo[0]));
                const __m256i p1 = products(q1, _mm256_loadu_si256((const __m256i *)ab->qs[1]),
                                            _mm256_loadu_si256((const __m256i *)ab->lo[1]));
                acc[r][0] = _mm256_fmadd_ps(_mm256_broadcastss_ps(sc), _mm256_cvtepi32_ps(p0), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(sc)), _mm256_cvtepi32_ps(p1),
                                            acc[r][1]);
                terms[r] = _mm_add_ps(terms[r], sc);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m128 t = _mm_add_ss(_mm_movehl_ps(terms[r], terms[r]), _mm_shuffle_ps(terms[r], terms[r], 3));
            y[(size_t)r * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + _mm_cvtss_f32(t);
        }
    }
}
static inline __attribute__((always_inline)) void q8q_cols(const int R, const blkq *a, int nb, const blk8 *w, float *y,
                                                           int N, int n0, int n1) {
    for (int n = n0; n < n1; n++) {
        const blk8 *c = w + (size_t)n * nb;
        __m256 acc[MAXR];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            FETCH(c + b);
            const __m256i q = _mm256_loadu_si256((const __m256i *)c[b].qs), size = _mm256_sign_epi8(q, q);
            for (int r = 0; r < R; r++) {
                const blkq *ab = a + (size_t)r * nb + b;  // |q| times the activations with q's sign
                const __m256i p = products(size, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)ab->qs), q),
                                           _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)ab->lo), q));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(c[b].d * ab->d), _mm256_cvtepi32_ps(p), acc[r]);
            }
        }
        for (int r = 0; r < R; r++) y[(size_t)r * N + n] = hsum(acc[r]);
    }
}


// ---- rows: bf16, f16 or f32 weights [N, K] (a checkpoint's own precision) ----
// These weights are 2 or 4 bytes each, so a step is bound by memory; with several rows (a verify pass) it also does
// as many multiply-adds as a Q4_1 one, and the near fetch (PREFETCH) alone leaves memory idle while they run. A second
// fetch FAR bytes ahead into L2 keeps it reading (benchmarks/native_ab.py); one row does without, as its loop waits on
// memory anyway.
// A block of 32 of a row as four vectors of 8, exactly: bf16 is the top half of an fp32, f16 converts exactly (F16C)
static inline __attribute__((always_inline)) void row_block(const int kind, const char *p, __m256 *w0, __m256 *w1,
                                                            __m256 *w2, __m256 *w3) {
    if (kind == W_F32) {
        const float *f = (const float *)p;
        *w0 = _mm256_loadu_ps(f), *w1 = _mm256_loadu_ps(f + 8), *w2 = _mm256_loadu_ps(f + 16);
        *w3 = _mm256_loadu_ps(f + 24);
    } else if (kind == W_F16) {
        const __m128i *h = (const __m128i *)p;
        *w0 = _mm256_cvtph_ps(_mm_loadu_si128(h)), *w1 = _mm256_cvtph_ps(_mm_loadu_si128(h + 1));
        *w2 = _mm256_cvtph_ps(_mm_loadu_si128(h + 2)), *w3 = _mm256_cvtph_ps(_mm_loadu_si128(h + 3));
    } else {
        const __m128i *h = (const __m128i *)p;
        #define BF16(v) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(v)), 16))
        *w0 = BF16(h), *w1 = BF16(h + 1), *w2 = BF16(h + 2), *w3 = BF16(h + 3);
        #undef BF16
    }
}
static inline size_t row_bytes(const int kind) { return KINDS[kind].bytes; }
#ifdef __AVX512F__
static inline __attribute__((always_inline)) void rows_cols(const int R, const int kind, const float *x, int K,
                                                            const void *w, float *y, int N, int n0, int n1) {
    const int nb = K / BLOCK;
    const size_t block = BLOCK * row_bytes(kind), column = (size_t)K * row_bytes(kind);
    #define ROW_AT(n, b) ((const char *)w + (size_t)(n) * column + (size_t)(b) * block)
    #define ROW_DECODE(p, wa, wb) row_decode16(kind, p, wa, wb)
    STEP16(0, R, nb, ROW_AT, ROW_DECODE, R > 1)
    #undef ROW_AT
    #undef ROW_DECODE
}
#else
static inline __attribute__((always_inline)) void rows_cols(const int R, const int kind, const float *x, int K,
                                                            const void *w, float *y, int N, int n0, int n1) {
    const int nb = K / BLOCK;
    const size_t block = BLOCK * row_bytes(kind);
    for (int n = n0; n < n1; n++) {
        const char *c = (const char *)w + (size_t)n * K * row_bytes(kind);
        __m256 acc[MAXR][2], w0, w1, w2, w3;
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            FETCH(c + b * block);
            if (R > 1) FETCH_FAR(c + b * block);
            row_block(kind, c + b * block, &w0, &w1, &w2, &w3);
            rows_times(R, x + b * BLOCK, K, w0, w1, w2, w3, acc);
        }
        for (int r = 0; r < R; r++) y[(size_t)r * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}
#endif
static inline __attribute__((always_inline)) void decode_row(const int kind, const void *row, int K, float *out) {
    const char *c = row;
    __m256 w0, w1, w2, w3;
    for (int b = 0; b < K / BLOCK; b++, out += BLOCK) {
        row_block(kind, c + (size_t)b * BLOCK * row_bytes(kind), &w0, &w1, &w2, &w3);
        STORE4(out, w0, w1, w2, w3);
    }
}
static void decode_bf16(const void *row, int K, float *out) { decode_row(W_BF16, row, K, out); }
static void decode_f16(const void *row, int K, float *out) { decode_row(W_F16, row, K, out); }
static void decode_f32(const void *row, int K, float *out) { decode_row(W_F32, row, K, out); }

// ---- the loops ----
typedef struct {
    int kernel, kind, M, K, N, ldy;  // ldy: y's row stride (N, or more where y holds several products side by side)
    const void *x;  // fp32 rows, or their int8 blocks (K_INT8)
    const void *w;
    float *y, *decoded;
} linear_job;

#ifdef __AVX512F__
#define EACH_R_WIDE(CALL) case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8);
#else
#define EACH_R_WIDE(CALL) default: CALL(6);
#endif
#define EACH_R(R, CALL) switch (R) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
                                     case 4: CALL(4); break; case 5: CALL(5); break; \
                         EACH_R_WIDE(CALL) }

// A tile of a kind's step kernel (fp32 activations) or int8 kernel: rows m0..m0 + R - 1 by columns n0..n1 - 1
typedef void tile_fn(const linear_job *j, int m0, int R, int n0, int n1);
#define FP32_TILE(name, CALL) \
    static void name(const linear_job *j, int m0, int R, int n0, int n1) { \
        const int K = j->K, N = j->ldy;  /* N: the stride the cols functions write at */ \
        const float *xf = (const float *)j->x + (size_t)m0 * K; \
        float *yr = j->y + (size_t)m0 * N; \
        EACH_R(R, CALL) \
    }
#define Q4F(r) q4_cols(r, xf, K, j->w, yr, N, n0, n1)
#define Q8F(r) q8_cols(r, xf, K, j->w, yr, N, n0, n1)
#define Q6F(r) q6_cols(r, xf, K, j->w, yr, N, n0, n1)
#define Q5F(r) q5_cols(r, xf, K, j->w, yr, N, n0, n1)
#define BF(r) rows_cols(r, W_BF16, xf, K, j->w, yr, N, n0, n1)
#define HF(r) rows_cols(r, W_F16, xf, K, j->w, yr, N, n0, n1)
#define SF(r) rows_cols(r, W_F32, xf, K, j->w, yr, N, n0, n1)
FP32_TILE(tile_q41, Q4F)
FP32_TILE(tile_q80, Q8F)
FP32_TILE(tile_q6, Q6F)
FP32_TILE(tile_q5, Q5F)
FP32_TILE(tile_bf16, BF)
FP32_TILE(tile_f16, HF)
FP32_TILE(tile_f32, SF)
static void tile_q80_int8(const linear_job *j, int m0, int R, int n0, int n1) {
    const int nb = j->K / BLOCK, N = j->ldy;
    const blkq *xq = (const blkq *)j->x + (size_t)m0 * nb;
    float *yr = j->y + (size_t)m0 * N;
    #define Q8I(r) q8q_cols(r, xq, nb, j->w, yr, N, n0, n1)
    EACH_R(R, Q8I)
}
static void tile_q41p_int8(const linear_job *j, int m0, int R, int n0, int n1) {
    const int np = kind_elements(W_Q41P, j->K), N = j->ldy;
    const blkqp *xp = (const blkqp *)j->x + (size_t)m0 * np;
    float *yr = j->y + (size_t)m0 * N;
    #define Q4P(r) q4p_cols(r, xp, np, j->w, yr, N, n0, n1)
    EACH_R(R, Q4P)
}

// Each weight kind's kernels, by id: the tiles of its step and int8 kernels, how the int8 kernel rounds the
// activations (blkq a block, or blkqp a pair), and its decoder (a prompt's kernel multiplies decoded columns).
// specdec_kinds.h's table says which kernels a kind has: linear_kind_ok takes a kernel where both have it, and
// tests/native/test_kinds.py runs every one the table lists.
typedef void round_fn(const float *x, int M, int K, void *rounded);
typedef void decode_fn(const void *column, int K, float *out);
static const struct { tile_fn *step, *int8; round_fn *round; decode_fn *decode; } KIND_OPS[SPECDEC_W_COUNT] = {
    [W_Q41] = {tile_q41, NULL, NULL, decode_q41},
    [W_Q80] = {tile_q80, tile_q80_int8, quantize_rows, decode_q80},
    [W_Q41P] = {NULL, tile_q41p_int8, quantize_pairs, NULL},
    [W_BF16] = {tile_bf16, NULL, NULL, decode_bf16},
    [W_F16] = {tile_f16, NULL, NULL, decode_f16},
    [W_F32] = {tile_f32, NULL, NULL, decode_f32},
    [W_Q6] = {tile_q6, NULL, NULL, decode_q6},
    [W_Q5] = {tile_q5, NULL, NULL, decode_q5},
};

// a task's columns, COLUMNS at a time, each over every row MAXR rows at a time: the columns' weights come from
// memory once, then from cache
static void step_task(void *ctx, int first, int last, int worker) {
    const linear_job *j = ctx;
    tile_fn *const tile = j->kernel == K_INT8 ? KIND_OPS[j->kind].int8 : KIND_OPS[j->kind].step;
    (void)worker;
    for (int n0 = first * COLUMNS; n0 < last * COLUMNS && n0 < j->N; n0 += COLUMNS) {
        const int n1 = n0 + COLUMNS < j->N ? n0 + COLUMNS : j->N;
        for (int m0 = 0; m0 < j->M; m0 += MAXR) tile(j, m0, j->M - m0 < MAXR ? j->M - m0 : MAXR, n0, n1);
    }
}

// a prompt's rows: the task's columns decoded to fp32 once (into its worker's buffer), then tiles of PR x PC
static void prompt_chunk(const linear_job *j, int task, int worker) {
    const int K = j->K, N = j->ldy, n0 = task * PREFILL_COLUMNS;
    const int n1 = n0 + PREFILL_COLUMNS < j->N ? n0 + PREFILL_COLUMNS : j->N;
    const size_t column = kind_column_bytes(j->kind, K);
    float *buf = j->decoded + (size_t)worker * linear_decoded_floats(K);
    for (int n = n0; n < n1; n++)
        KIND_OPS[j->kind].decode((const char *)j->w + (size_t)n * column, K, buf + (size_t)(n - n0) * K);
    for (int r0 = 0; r0 < j->M; r0 += PR) {
        const int R = j->M - r0 < PR ? j->M - r0 : PR;
        for (int n = n0; n < n1; n += PC) {
            const int C = n1 - n < PC ? n1 - n : PC;
            const float *xr = (const float *)j->x + (size_t)r0 * K, *wc = buf + (size_t)(n - n0) * K;
            float *yr = j->y + (size_t)r0 * N + n;
            #define TILE(r, c) prefill_tile(r, c, xr, K, wc, yr, N)
            EACH_RC(R, C, TILE)
        }
    }
}
static void prompt_task(void *ctx, int first, int last, int worker) {
    for (int task = first; task < last; task++) prompt_chunk(ctx, task, worker);
}

size_t linear_decoded_floats(int K) {  // a prompt's decoded columns, or int8 activations' (linear_q8a.c)
    const size_t prompt = ALIGNED(sizeof(float) * PREFILL_COLUMNS * (size_t)K), q8a = q8a_columns_bytes(K);
    const size_t most = prompt > q8a ? prompt : q8a, bf16a = bf16a_worker_bytes(K);
    return (most > bf16a ? most : bf16a) / sizeof(float);
}
size_t linear_rounded_bytes(int M, int K) {  // the draft's rounded activations, int8 activations' blocks or bf16's
    const size_t draft = ALIGNED(sizeof(blkq) * (size_t)M * (size_t)(K / BLOCK + 1)), q8a = q8a_rounded_bytes(M, K);
    const size_t most = draft > q8a ? draft : q8a, bf16a = bf16a_rounded_bytes(M, K);
    return most > bf16a ? most : bf16a;
}
void linear_decode(int kind, const void *column, int K, float *out) { KIND_OPS[kind].decode(column, K, out); }
int linear_kind_ok(int kernel, int kind) {
    if (!kind_known(kind) || kernel < K_STEP || kernel > K_BF16A) return 0;
    const int has = kernel == K_STEP ? KIND_OPS[kind].step != NULL : kernel == K_PROMPT ? KIND_OPS[kind].decode != NULL
                  : kernel == K_INT8 ? KIND_OPS[kind].int8 && KIND_OPS[kind].round
                  : kernel == K_BF16A ? kind == W_BF16 && bf16a_ok() : q8a_kind_ok(kind);
    return has && (KINDS[kind].kernels >> kernel & 1) && (KINDS[kind].isas & THIS_ISA);
}

void linear(int threads, int kernel, int kind, const float *x, int M, int K, const void *w, float *y, int N, int ldy,
            float *decoded, void *rounded) {
    if (kernel == K_Q8A || kernel == K_Q8A_REF) {  // int8 activations: linear_q8a.c
        linear_q8a(threads, kernel == K_Q8A_REF, kind, x, M, K, w, y, N, ldy, decoded, rounded);
        return;
    }
    if (kernel == K_BF16A) {  // bf16 activations: linear_bf16a.c
        linear_bf16a(threads, x, M, K, w, y, N, ldy, decoded, rounded);
        return;
    }
    linear_job j = {kernel, kind, M, K, N, ldy, x, w, y, decoded};
    if (kernel == K_INT8) {
        KIND_OPS[kind].round(x, M, K, rounded);
        j.x = rounded;
    }
    if (kernel == K_PROMPT) pool_run(threads, prompt_task, &j, (N + PREFILL_COLUMNS - 1) / PREFILL_COLUMNS);
    else pool_run(threads, step_task, &j, (N + COLUMNS - 1) / COLUMNS);
}

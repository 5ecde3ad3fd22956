// specdec's native CPU kernels (specdec.native): Q4_1 / Q8_0 weights times fp32 activations, AVX2 + FMA, OpenMP over
// output columns, M rows at once (every weight decoded once per 6 rows). Compiled on first use by specdec.native.build.
// Blocks of 32 along K, per output column n:
//   q41: {float d; float m; uint8 qs[16]} (qs[j]: low nibble = q[j], high nibble = q[j + 16]); w = d*q + m
//   q8 : {float d; int8 qs[32]}; w = d*q
// fp32 activations (the target): each block's weights are decoded to fp32 once per tile of rows, then
//   y[r, n] = sum_b (d*q + m) . x[r, block b]
// A prompt's rows (a forward of several tokens with last_only) take their own kernel, prefill_gemm below: the same
// products, tiled for many rows and summed in another order; verify passes and steps keep this one.
// The draft (quant = 1 in specdec_forward) rounds the activations before every weight, each row's blocks of 32 in two
// int8 parts,
//   blkq: {float d, s; int8 qs[32], lo[32]}, x ~ d * (128 * qs + lo): qs = round(x / step), step = max|x| / 127,
//   lo = the remainder in 1/128ths of a step (|lo| <= 64), d = step / 128, s = the exact block sum,
// and multiplies integers (maddubs: 128 * (q . qs) + q . lo): about 15 bits where one int8 part (onnxruntime's
// MatMulNBits at accuracy level 4) has 8, for one more maddubs and madd per block, and one scale per 32 values. A
// Q4_1 weight d*q + m adds d times that product and m times the exact sum. The second part took the draft's top-1
// agreement with the target on the default model (benchmarks/draft_agreement.py, all 50 prompts, 6663 positions)
// from 0.9586 (one int8 part per 16 values, q/k/v's inputs kept fp32) to 0.9877, next to the trimmed head's ceiling
// of 0.9883, and its step from 5.58 to 4.99 ms at cache length 64 (q/k/v now take the int8 path too;
// benchmarks/kernels_ab.py: one process, both kernels loaded, 24 interleaved calls; issue11/native/draft.md).
// The draft reads its Q4_1 weights from its own copy, two blocks at a time (blk4p: fp16 scales and minimums, a
// GGUF's own, and the two blocks' codes in one byte's nibbles): 40 bytes per 64 weights where the target's blk4 take
// 48, one load and two masks for 64 codes, one F16C conversion and one multiply for both blocks' scales. That took
// its step from 4.51 to 3.77 ms at cache length 64 (kernels_ab.py, 2026-12-03; issue11/native/draft.md).
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <math.h>
typedef struct { float d, m; uint8_t qs[16]; } blk4;
typedef struct { float d; int8_t qs[32]; } blk8;
typedef struct { float d, s; int8_t qs[32], lo[32]; } blkq;
// The draft's Q4_1 weights, two blocks of a column at a time: fp16 d0, d1, m0, m1 (a GGUF's own precision), then
// qs[j] = q0[j] | q1[j] << 4: 40 bytes per 64 weights where two blk4 take 48. Its activations likewise in pairs:
// sc = {d0, d1, s0, s1}, then each block's two parts. An odd count of blocks ends in a pair whose second half is 0.
typedef struct { uint16_t h[4]; uint8_t qs[32]; } blk4p;
typedef struct { float sc[4]; int8_t qs[2][32], lo[2][32]; } blkqp;
#define MAXR 6  /* rows per read of the weights */
#define COLUMNS 16  /* output columns per OpenMP task */
#ifndef PREFETCH
#define PREFETCH 2048  /* bytes ahead: against 512, draft step 4-6 %, target 1-3 % shorter; verify, prefill level */
#endif
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s)); s = _mm_add_ss(s, _mm_movehdup_ps(s)); return _mm_cvtss_f32(s);
}
#define S8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define FETCH(p) _mm_prefetch((const char *)(p) + PREFETCH, _MM_HINT_T0)

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
// zero-extended to 8 lanes straight from memory, then its low and high nibbles: 6 integer operations per block where
// splitting the bytes first took 10, the same values; the target's step 14 % shorter at cache length 64
// (benchmarks/kernels_ab.py, 2026-12-03; issue11/native/prompt.md)
#define Z8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define Q4_DECODE(blk, mask, w0, w1, w2, w3) \
    const __m256i lo8_ = Z8((blk).qs), hi8_ = Z8((blk).qs + 8); \
    const __m256 d_ = _mm256_broadcast_ss(&(blk).d), m_ = _mm256_broadcast_ss(&(blk).m); \
    const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(lo8_, mask)), d_, m_); \
    const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(hi8_, mask)), d_, m_); \
    const __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo8_, 4)), d_, m_); \
    const __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi8_, 4)), d_, m_)
static inline __attribute__((always_inline)) void q4_cols(const int R, const float *x, int K, const blk4 *w, float *y,
                                                          int N, int n0, int n1) {
    const int nb = K / 32; const __m256i mask = _mm256_set1_epi32(0x0F);
    for (int n = n0; n < n1; n++) {
        const blk4 *c = w + (size_t)n * nb;
        __m256 acc[MAXR][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            FETCH(c + b);
            Q4_DECODE(c[b], mask, w0, w1, w2, w3);
            rows_times(R, x + b * 32, K, w0, w1, w2, w3, acc);
        }
        for (int r = 0; r < R; r++) y[(size_t)r * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}
static inline __attribute__((always_inline)) void q8_cols(const int R, const float *x, int K, const blk8 *w, float *y,
                                                          int N, int n0, int n1) {
    const int nb = K / 32;
    for (int n = n0; n < n1; n++) {
        const blk8 *c = w + (size_t)n * nb;
        __m256 acc[MAXR][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            FETCH(c + b);
            const __m256 d = _mm256_broadcast_ss(&c[b].d);
            rows_times(R, x + b * 32, K, _mm256_mul_ps(S8(c[b].qs), d), _mm256_mul_ps(S8(c[b].qs + 8), d),
                       _mm256_mul_ps(S8(c[b].qs + 16), d), _mm256_mul_ps(S8(c[b].qs + 24), d), acc);
        }
        for (int r = 0; r < R; r++) y[(size_t)r * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}
// ---- a prompt's rows (the target's prefill) ----
// A forward of several tokens that scores only its last row feeds a prompt (the runtime's feed_chunks). Its rows are
// never compared with a one-token step, so they take a kernel of their own; a forward of one token keeps the step
// kernel. Any chunking into pieces of two or more tokens gives the same results, and plain and speculative decoding
// feed a prompt in the same pieces. A task decodes its columns' weights to fp32 once for all rows (the values q4_cols
// and q8_cols use), then tiles of PR rows x PC columns, one accumulator per output over K in 8-wide chunks, share
// each load: 7 loads per 12 FMAs where the step kernel has one per FMA. Its sums run in another order than the step
// kernel's; verify passes and steps keep that one, so they stay bitwise equal row by row. A 64-token chunk of the
// default model took 0.67-0.73x the step kernel's time (benchmarks/kernels_ab.py --tokens 64;
// issue11/native/prompt.md).
#define PR 4  /* rows per tile: 4 x 3 accumulators, 3 weights and 1 activation fill the 16 registers */
#define PC 3  /* columns per tile */
#define PREFILL_COLUMNS 24  /* columns per task: their fp32 weights stay in L2 while the rows' tiles pass over them */
static inline void decode4(const blk4 *c, int nb, float *out) {
    const __m256i mask = _mm256_set1_epi32(0x0F);
    for (int b = 0; b < nb; b++, out += 32) {
        FETCH(c + b);
        Q4_DECODE(c[b], mask, w0, w1, w2, w3);
        _mm256_store_ps(out, w0); _mm256_store_ps(out + 8, w1); _mm256_store_ps(out + 16, w2);
        _mm256_store_ps(out + 24, w3);
    }
}
// (also a tied embedding's row, at any alignment)
static inline void decode8(const blk8 *c, int nb, float *out) {
    for (int b = 0; b < nb; b++, out += 32) {
        FETCH(c + b);
        const __m256 d = _mm256_broadcast_ss(&c[b].d);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(S8(c[b].qs + 8 * j), d));
    }
}
// R rows of x (stride K) times C decoded columns at w (stride K) -> y[r * N + c]
static inline __attribute__((always_inline)) void prefill_tile(const int R, const int C, const float *x, int K,
                                                               const float *w, float *y, int N) {
    __m256 acc[PR][PC];
    for (int r = 0; r < R; r++) for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        __m256 wv[PC];
        for (int c = 0; c < C; c++) wv[c] = _mm256_load_ps(w + (size_t)c * K + k);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + (size_t)r * K + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++) for (int c = 0; c < C; c++) y[(size_t)r * N + c] = hsum(acc[r][c]);
}
#define EACH_RC(R, C, CALL) switch ((R) * 4 + (C)) { \
    case 5: CALL(1, 1); break; case 6: CALL(1, 2); break; case 7: CALL(1, 3); break; \
    case 9: CALL(2, 1); break; case 10: CALL(2, 2); break; case 11: CALL(2, 3); break; \
    case 13: CALL(3, 1); break; case 14: CALL(3, 2); break; case 15: CALL(3, 3); break; \
    case 17: CALL(4, 1); break; case 18: CALL(4, 2); break; default: CALL(4, 3); }
// x [M, K] fp32 -> y [M, N] through Q4_1 (four) or Q8_0 blocks; -1 where memory ran out
static int prefill_gemm(int four, const float *x, int M, int K, const void *w, float *y, int N) {
    const int nb = K / 32; int failed = 0;
    #pragma omp parallel
    {
        float *buf = aligned_alloc(64, sizeof(float) * PREFILL_COLUMNS * K);  // K is a multiple of 32
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(guided)
        for (int n0 = 0; n0 < N; n0 += PREFILL_COLUMNS) {
            if (!buf) continue;
            const int n1 = n0 + PREFILL_COLUMNS < N ? n0 + PREFILL_COLUMNS : N;
            for (int n = n0; n < n1; n++) {
                if (four) decode4((const blk4 *)w + (size_t)n * nb, nb, buf + (size_t)(n - n0) * K);
                else decode8((const blk8 *)w + (size_t)n * nb, nb, buf + (size_t)(n - n0) * K);
            }
            for (int r0 = 0; r0 < M; r0 += PR) {
                const int R = M - r0 < PR ? M - r0 : PR;
                for (int n = n0; n < n1; n += PC) {
                    const int C = n1 - n < PC ? n1 - n : PC;
                    const float *xr = x + (size_t)r0 * K, *wc = buf + (size_t)(n - n0) * K;
                    float *yr = y + (size_t)r0 * N + n;
                    #define TILE(r, c) prefill_tile(r, c, xr, K, wc, yr, N)
                    EACH_RC(R, C, TILE)
                }
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
// ---- int8 activations (the draft) ----
// x [M, K] -> a [M, K / 32]: per block of 32, x ~ d * (128 * qs + lo): qs = round(x / step) (|qs| <= 127, step =
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
static void quantize_rows(const float *x, int M, int K, blkq *a) {
    for (int i = 0; i < M * (K / 32); i++) quantize_block(x + (size_t)i * 32, &a[i].d, &a[i].s, a[i].qs, a[i].lo);
}
// ... in pairs of blocks (blkqp), [M, (K / 32 + 1) / 2]
static void quantize_pairs(const float *x, int M, int K, blkqp *a) {
    const int nb = K / 32, np = (nb + 1) / 2;
    for (int r = 0; r < M; r++)
        for (int b = 0; b < nb; b++) {
            blkqp *p = a + (size_t)r * np + b / 2; const int h = b % 2;
            quantize_block(x + (size_t)r * K + (size_t)b * 32, &p->sc[h], &p->sc[2 + h], p->qs[h], p->lo[h]);
        }
    if (nb % 2)
        for (int r = 0; r < M; r++) {
            blkqp *p = a + (size_t)r * np + np - 1;
            p->sc[1] = p->sc[3] = 0.f; memset(p->qs[1], 0, 32); memset(p->lo[1], 0, 32);
        }
}
// The integer products of a block: 128 * (u . qs) + u . lo for unsigned u (maddubs' pairs stay within int16: u <= 128,
// |qs| <= 127), 8 int32 lanes of 4 products each
static inline __attribute__((always_inline)) __m256i products(__m256i u, __m256i qs, __m256i lo) {
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, qs), _mm256_set1_epi16(128)),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(u, lo), _mm256_set1_epi16(1)));
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

void specdec_set_threads(int threads) { omp_set_num_threads(threads); }

enum { Q4_F32, Q8_F32, Q8_I8, Q4P_I8 };  // weights x activations
#define EACH_R(R, CALL) switch (R) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
                                     case 4: CALL(4); break; case 5: CALL(5); break; default: CALL(6); }
// x [M, K] (fp32 rows, or int8 blocks [M, K / 32]) -> y [M, N]; tiles of MAXR rows; the columns go out in guided
// chunks (large first, then smaller as threads come free: a shared VM's cores do not run at one speed; medians 5-13 %
// lower than two static halves in an interleaved A/B on the default model)
static void gemm(int kind, const void *x, int M, int K, const void *w, float *y, int N) {
    const int nb = K / 32;
    for (int m0 = 0; m0 < M; m0 += MAXR) {
        const int R = M - m0 < MAXR ? M - m0 : MAXR;
        const float *xf = (const float *)x + (size_t)m0 * K; const blkq *xq = (const blkq *)x + (size_t)m0 * nb;
        const blkqp *xp = (const blkqp *)x + (size_t)m0 * ((nb + 1) / 2);
        float *yr = y + (size_t)m0 * N;
        #pragma omp parallel for schedule(guided)
        for (int n0 = 0; n0 < N; n0 += COLUMNS) {
            const int n1 = n0 + COLUMNS < N ? n0 + COLUMNS : N;
            #define Q4F(r) q4_cols(r, xf, K, w, yr, N, n0, n1)
            #define Q8F(r) q8_cols(r, xf, K, w, yr, N, n0, n1)
            #define Q8I(r) q8q_cols(r, xq, nb, w, yr, N, n0, n1)
            #define Q4P(r) q4p_cols(r, xp, (nb + 1) / 2, w, yr, N, n0, n1)
            switch (kind) {
            case Q4_F32: EACH_R(R, Q4F); break;
            case Q8_F32: EACH_R(R, Q8F); break;
            case Q4P_I8: EACH_R(R, Q4P); break;
            default: EACH_R(R, Q8I);
            }
        }
    }
}
// the products alone (benchmarks time them, tests check them): x [M, K] fp32 -> y [M, N]
void q41_gemm(const float *x, int M, int K, const blk4 *w, float *y, int N) { gemm(Q4_F32, x, M, K, w, y, N); }
void q8_gemm(const float *x, int M, int K, const blk8 *w, float *y, int N) { gemm(Q8_F32, x, M, K, w, y, N); }
// ... through the prompt's kernel (prefill_gemm); -1 where memory ran out
int prefill_products(const float *x, int M, int K, const void *w, int four, float *y, int N) {
    return prefill_gemm(four, x, M, K, w, y, N);
}
// ... with x rounded to int8 first (four = 1: paired Q4_1 blocks, blk4p, else Q8_0); -1 where memory ran out
int int8_gemm(const float *x, int M, int K, const void *w, int four, float *y, int N) {
    void *a = malloc(sizeof(blkq) * M * (K / 32 + 1));
    if (!a) return -1;
    if (four) { quantize_pairs(x, M, K, a); gemm(Q4P_I8, a, M, K, w, y, N); }
    else { quantize_rows(x, M, K, a); gemm(Q8_I8, a, M, K, w, y, N); }
    free(a);
    return 0;
}

// e^x, |relative error| < 3e-7 (Cephes' expf: 2^n times a polynomial on [-ln2/2, ln2/2]); x clamped to [-87, 88]
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// ---- attention ----
// Causal GQA over static KV, flash-style: a task takes one KV head, the query rows that read it (up to QROWS: the
// positions of a tile times the heads sharing that KV head) and a range of keys. It walks its keys in blocks of KEYS,
// each block read once for all its rows (not once per query head), keeping a running max, sum and output per row.
// Where KV heads times tiles leave threads idle (decoding), the keys are also split among tasks, and the parts merged
// by their maxima (log-sum-exp).
#define KEYS 64
#define QROWS 16

// scores[j] = scale * q . k[j] for j < n (keys [n, D])
static void dots(const float *qv, const float *k, int n, int D, float scale, float *scores) {
    int j = 0;
    if (D % 8 == 0) {
        for (; j + 4 <= n; j += 4) {  // four keys at a time, one horizontal reduction for all four
            const float *k0 = k + (size_t)j * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int i = 0; i < D; i += 8) {
                const __m256 x = _mm256_loadu_ps(qv + i);
                a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + i), a0);
                a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + D + i), a1);
                a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 2 * D + i), a2);
                a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 3 * D + i), a3);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m128 four = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(scores + j, _mm_mul_ps(four, _mm_set1_ps(scale)));
        }
    }
    for (; j < n; j++) {
        float s = 0.f;
        for (int i = 0; i < D; i++) s += qv[i] * k[(size_t)j * D + i];
        scores[j] = s * scale;
    }
}
// o[D] = o * alpha + sum_j p[j] v[j] (values [n, D])
static void mix(float *o, float alpha, const float *p, const float *v, int n, int D) {
    int i0 = 0;
    for (; i0 + 32 <= D; i0 += 32) {  // 32 outputs at a time in registers
        const __m256 a = _mm256_set1_ps(alpha);
        __m256 acc0 = _mm256_mul_ps(a, _mm256_loadu_ps(o + i0)), acc1 = _mm256_mul_ps(a, _mm256_loadu_ps(o + i0 + 8)),
               acc2 = _mm256_mul_ps(a, _mm256_loadu_ps(o + i0 + 16)), acc3 = _mm256_mul_ps(a, _mm256_loadu_ps(o + i0 + 24));
        for (int j = 0; j < n; j++) {
            const __m256 pj = _mm256_broadcast_ss(p + j); const float *vj = v + (size_t)j * D + i0;
            acc0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj), acc0);
            acc1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8), acc1);
            acc2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 16), acc2);
            acc3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 24), acc3);
        }
        _mm256_storeu_ps(o + i0, acc0); _mm256_storeu_ps(o + i0 + 8, acc1);
        _mm256_storeu_ps(o + i0 + 16, acc2); _mm256_storeu_ps(o + i0 + 24, acc3);
    }
    for (; i0 < D; i0++) {
        float acc = o[i0] * alpha;
        for (int j = 0; j < n; j++) acc += p[j] * v[(size_t)j * D + i0];
        o[i0] = acc;
    }
}
// One task: rows query vectors qv[r] (row r at position pos + r / group) over keys [j0, j1) of one KV head.
// state [rows][D + 2]: the unnormalized output, then the running max and sum
static void attend_keys(const float *const *qv, int rows, int group, int pos, const float *k, const float *v, int j0,
                        int j1, int D, float scale, float *state) {
    float scores[KEYS];
    for (int r = 0; r < rows; r++) {
        float *st = state + (size_t)r * (D + 2);
        memset(st, 0, sizeof(float) * D); st[D] = -INFINITY; st[D + 1] = 0.f;
    }
    for (int jb = j0; jb < j1; jb += KEYS) {
        for (int r = 0; r < rows; r++) {
            const int seen = pos + r / group + 1, stop = jb + KEYS < j1 ? jb + KEYS : j1;  // causal: keys < seen
            const int n = (stop < seen ? stop : seen) - jb;
            if (n <= 0) continue;
            float *st = state + (size_t)r * (D + 2);
            dots(qv[r], k + (size_t)jb * D, n, D, scale, scores);
            float top = st[D];
            for (int j = 0; j < n; j++) top = scores[j] > top ? scores[j] : top;
            const float alpha = expf(st[D] - top);  // 0 on the first block (max -inf)
            const __m256 shift = _mm256_set1_ps(top);
            __m256 sum = _mm256_setzero_ps();
            int j = 0;
            for (; j + 8 <= n; j += 8) {
                const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift));
                _mm256_storeu_ps(scores + j, e);
                sum = _mm256_add_ps(sum, e);
            }
            float total = hsum(sum);
            for (; j < n; j++) { scores[j] = expf(scores[j] - top); total += scores[j]; }
            mix(st, alpha, scores, v + (size_t)jb * D, n, D);
            st[D] = top; st[D + 1] = st[D + 1] * alpha + total;
        }
    }
}
// One layer and slot. q [T, Hq, D] (rotated) at positions pos..pos+T-1; keys, values [Hkv, S, D], already holding
// positions 0..pos+T-1; query head h reads KV head h / (Hq / Hkv); out [T, Hq, D]. -1 where memory ran out.
static int attention(const float *q, int T, int Hq, int Hkv, int D, const float *keys, const float *values, int S,
                     int pos, float scale, float *out) {
    const int group = Hq / Hkv, per = group < QROWS ? QROWS / group : 1, tiles = (T + per - 1) / per;
    const int rows = per * group, threads = omp_get_max_threads();
    int splits = 1;  // key ranges per (KV head, tile)
    while (Hkv * tiles * splits < 2 * threads && (pos + T) / (2 * splits) >= KEYS) splits *= 2;
    const int tasks = Hkv * tiles * splits;
    float *state = malloc(sizeof(float) * tasks * rows * (D + 2));
    if (!state) return -1;
    #pragma omp parallel for schedule(dynamic)
    for (int task = 0; task < tasks; task++) {
        const int g = task / (tiles * splits), tile = task / splits % tiles, part = task % splits;
        const int t0 = tile * per, count = (T - t0 < per ? T - t0 : per) * group;
        const int seen = pos + t0 + count / group;  // keys the tile's last row sees
        const int chunk = (seen + splits - 1) / splits, j0 = part * chunk, j1 = j0 + chunk < seen ? j0 + chunk : seen;
        const float *qv[count];
        for (int r = 0; r < count; r++) qv[r] = q + ((size_t)(t0 + r / group) * Hq + g * group + r % group) * D;
        attend_keys(qv, count, group, pos + t0, keys + (size_t)g * S * D, values + (size_t)g * S * D, j0, j1, D, scale,
                    state + (size_t)task * rows * (D + 2));
    }
    for (int g = 0; g < Hkv; g++)  // merge each row's parts and normalize
        for (int tile = 0; tile < tiles; tile++) {
            const int t0 = tile * per, count = (T - t0 < per ? T - t0 : per) * group;
            const float *parts = state + (size_t)(g * tiles + tile) * splits * rows * (D + 2);
            for (int r = 0; r < count; r++) {
                float top = -INFINITY, total = 0.f;
                for (int s = 0; s < splits; s++) {
                    const float m = parts[((size_t)s * rows + r) * (D + 2) + D];
                    top = m > top ? m : top;
                }
                float *o = out + ((size_t)(t0 + r / group) * Hq + g * group + r % group) * D;
                memset(o, 0, sizeof(float) * D);
                for (int s = 0; s < splits; s++) {
                    const float *st = parts + ((size_t)s * rows + r) * (D + 2);
                    if (st[D + 1] == 0.f) continue;  // a part with no keys this row sees
                    const float w = expf(st[D] - top);
                    total += w * st[D + 1];
                    for (int i = 0; i < D; i++) o[i] += w * st[i];
                }
                for (int i = 0; i < D; i++) o[i] /= total;
            }
        }
    free(state);
    return 0;
}
// the attention alone (tests check it against numpy); 0, or -1 where memory ran out
int specdec_attention(const float *q, int T, int Hq, int Hkv, int D, const float *keys, const float *values, int S,
                      int pos, float scale, float *out) {
    return attention(q, T, Hq, Hkv, D, keys, values, S, pos, scale, out);
}

// ---- the forward pass ----
// A LLaMA-layout model (specdec.native.weights): per layer RMSNorm, packed q/k/v, rotate-half rotary, causal GQA
// over static KV, o, RMSNorm, packed gate/up, SiLU(gate) * up, down; a final RMSNorm and the head's V rows.
typedef struct {
    int L, H, Hq, Hkv, D, I, V;
    float eps, scale;
    const float *embedding;  // [vocab, H]; NULL where embedding_rows holds it
    const float *const *in_norm, *const *post_norm;  // [L] of [H]
    const blk4 *const *qkv, *const *o, *const *gate_up, *const *down;  // [L] of [N, K / 32] blocks
    const blk4p *const *qkv_p, *const *o_p, *const *gate_up_p, *const *down_p;  // the same paired, [N, (K/32+1)/2]:
                                                                                  // the draft's (quant), else NULL
    const float *final_norm;
    const blk8 *head;  // [V, H / 32]
    const float *cos, *sin;  // [positions, D / 2]
    const blk8 *embedding_rows;  // [vocab, H / 32]: row t of the embedding is d * q of these (tied weights)
} model_t;

static void rmsnorm(const float *x, const float *gamma, float eps, int T, int H, float *out) {
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * H; float *ot = out + (size_t)t * H, s = 0.f;
        for (int i = 0; i < H; i++) s += xt[i] * xt[i];
        const float r = 1.f / sqrtf(s / H + eps);
        for (int i = 0; i < H; i++) ot[i] = xt[i] * r * gamma[i];
    }
}
static void rotate(const float *x, const float *cs, const float *sn, int D, float *out) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        out[i] = x1 * cs[i] - x2 * sn[i];
        out[i + half] = x2 * cs[i] + x1 * sn[i];
    }
}
// x [M, K] -> y [M, N] through Q4_1 (four; paired where quant) or Q8_0 blocks, with fp32 or int8 (scratch a)
// activations
// (prompt: a prompt's rows, fp32 activations: prefill_gemm; -1 where its scratch could not be had)
static int linear(const float *x, int M, int K, const void *w, int four, float *y, int N, int quant, int prompt,
                  void *a) {
    if (!quant && prompt) {
        return prefill_gemm(four, x, M, K, w, y, N);
    } else if (!quant) {
        gemm(four ? Q4_F32 : Q8_F32, x, M, K, w, y, N);
    } else if (four) {
        quantize_pairs(x, M, K, a);
        gemm(Q4P_I8, a, M, K, w, y, N);
    } else {
        quantize_rows(x, M, K, a);
        gemm(Q8_I8, a, M, K, w, y, N);
    }
    return 0;
}
// tokens [T] at positions pos.. -> logits [T or 1, V]; K/V land at [pos, pos + T) of keys, values [L][Hkv, S, D]
// (layer l's at keys + l * layer_stride). 0 on success, -1 where memory ran out.
int specdec_forward(const model_t *m, const int64_t *tokens, int T, int pos, float *keys, float *values,
                    long layer_stride, int S, int last_only, int quant, float *logits) {
    const int H = m->H, D = m->D, Hq = m->Hq, Hkv = m->Hkv, I = m->I, QKV = (Hq + 2 * Hkv) * D, half = D / 2;
    const int prompt = last_only && T > 1;  // a prompt's rows: the prompt kernel (prefill_gemm)
    int wide = H;  // the widest activation row
    if (QKV > wide) wide = QKV;
    if (Hq * D > wide) wide = Hq * D;
    if (I > wide) wide = I;
    float *x = malloc(sizeof(float) * T * H), *xn = malloc(sizeof(float) * T * H),
          *tmp = malloc(sizeof(float) * T * wide), *q = malloc(sizeof(float) * T * Hq * D),
          *att = malloc(sizeof(float) * T * Hq * D), *gu = malloc(sizeof(float) * T * 2 * I),
          *act = malloc(sizeof(float) * T * I);
    void *a = malloc(sizeof(blkq) * T * (wide / 32 + 1));  // a blkqp is two blkq's size
    int status = 0;
    if (!x || !xn || !tmp || !q || !att || !gu || !act || !a) { status = -1; goto done; }
    for (int t = 0; t < T; t++) {
        if (m->embedding) {
            memcpy(x + (size_t)t * H, m->embedding + (size_t)tokens[t] * H, sizeof(float) * H);
            continue;
        }
        decode8(m->embedding_rows + (size_t)tokens[t] * (H / 32), H / 32, x + (size_t)t * H);  // d * q, as q8_rows
    }
    #define WEIGHT(name) (quant ? (const void *)m->name##_p[l] : (const void *)m->name[l])
    for (int l = 0; l < m->L; l++) {
        float *k = keys + (size_t)l * layer_stride, *v = values + (size_t)l * layer_stride;
        rmsnorm(x, m->in_norm[l], m->eps, T, H, xn);
        if (linear(xn, T, H, WEIGHT(qkv), 1, tmp, QKV, quant, prompt, a)) { status = -1; goto done; }
        for (int t = 0; t < T; t++) {
            const int p = pos + t; const float *row = tmp + (size_t)t * QKV;
            const float *cs = m->cos + (size_t)p * half, *sn = m->sin + (size_t)p * half;
            for (int h = 0; h < Hq; h++) rotate(row + h * D, cs, sn, D, q + ((size_t)t * Hq + h) * D);
            for (int h = 0; h < Hkv; h++) {
                rotate(row + (Hq + h) * D, cs, sn, D, k + ((size_t)h * S + p) * D);
                memcpy(v + ((size_t)h * S + p) * D, row + (Hq + Hkv + h) * D, sizeof(float) * D);
            }
        }
        if (attention(q, T, Hq, Hkv, D, k, v, S, pos, m->scale, att)) { status = -1; goto done; }
        if (linear(att, T, Hq * D, WEIGHT(o), 1, tmp, H, quant, prompt, a)) { status = -1; goto done; }
        for (int i = 0; i < T * H; i++) x[i] += tmp[i];
        rmsnorm(x, m->post_norm[l], m->eps, T, H, xn);
        if (linear(xn, T, H, WEIGHT(gate_up), 1, gu, 2 * I, quant, prompt, a)) { status = -1; goto done; }
        for (int t = 0; t < T; t++) {
            const float *g = gu + (size_t)t * 2 * I, *u = g + I; float *y = act + (size_t)t * I;
            int i = 0;
            for (; i + 8 <= I; i += 8) {  // SiLU(gate) * up
                const __m256 gi = _mm256_loadu_ps(g + i), ex = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gi));
                _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(gi, _mm256_add_ps(_mm256_set1_ps(1.f), ex)),
                                                      _mm256_loadu_ps(u + i)));
            }
            for (; i < I; i++) y[i] = g[i] / (1.f + expf(-g[i])) * u[i];
        }
        if (linear(act, T, I, WEIGHT(down), 1, tmp, H, quant, prompt, a)) { status = -1; goto done; }
        for (int i = 0; i < T * H; i++) x[i] += tmp[i];
    }
    const int rows = last_only ? 1 : T;
    rmsnorm(x + (size_t)(T - rows) * H, m->final_norm, m->eps, rows, H, xn);
    linear(xn, rows, H, m->head, 0, logits, m->V, quant, 0, a);  // one row under last_only: the step kernel too
done:
    free(x); free(xn); free(tmp); free(q); free(att); free(gu); free(act); free(a);
    return status;
}

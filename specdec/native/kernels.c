// specdec's native CPU kernels (specdec.native): Q4_1 / Q8_0 weights times fp32 activations, AVX2 + FMA, OpenMP over
// output columns, M rows at once (every weight decoded once per 6 rows). Compiled on first use by specdec.native.build.
// Blocks of 32 along K, per output column n:
//   q41: {float d; float m; uint8 qs[16]} (qs[j]: low nibble = q[j], high nibble = q[j + 16]); w = d*q + m
//   q8 : {float d; int8 qs[32]}; w = d*q
// y[r, n] = sum_b d * (q . x[r, block b]) + m * blocksum(x[r], b)
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>
#include <math.h>
typedef struct { float d, m; uint8_t qs[16]; } blk4;
typedef struct { float d; int8_t qs[32]; } blk8;
#define MAXR 6
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s)); s = _mm_add_ss(s, _mm_movehdup_ps(s)); return _mm_cvtss_f32(s);
}
#define U8(v) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
#define S8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))

// one block's 32 decoded weights (w0..w3, as floats) times x[0..32), as 8 partial sums
static inline __m256 dot32(__m256 w0, __m256 w1, __m256 w2, __m256 w3, const float *x) {
    __m256 a = _mm256_mul_ps(w0, _mm256_loadu_ps(x)), e = _mm256_mul_ps(w1, _mm256_loadu_ps(x + 8));
    a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), a);
    e = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), e);
    return _mm256_add_ps(a, e);
}

// R rows (1..MAXR) starting at x (row stride K), columns n0..n1
static inline __attribute__((always_inline)) void q4_cols(const int R, const float *x, const float *bs, int K,
                                                          const blk4 *w, float *y, int N, int n0, int n1) {
    const int nb = K / 32; const __m128i mask = _mm_set1_epi8(0x0F);
    for (int n = n0; n < n1; n++) {
        const blk4 *c = w + (size_t)n * nb;
        __m256 acc[MAXR]; float mins[MAXR];
        for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); mins[r] = 0.f; }
        for (int b = 0; b < nb; b++) {
            __m128i v = _mm_loadu_si128((const __m128i *)c[b].qs);
            __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
            __m256 w0 = U8(lo), w1 = U8(_mm_srli_si128(lo, 8)), w2 = U8(hi), w3 = U8(_mm_srli_si128(hi, 8));
            __m256 dd = _mm256_broadcast_ss(&c[b].d);
            for (int r = 0; r < R; r++) {
                acc[r] = _mm256_fmadd_ps(dd, dot32(w0, w1, w2, w3, x + (size_t)r * K + b * 32), acc[r]);
                mins[r] += c[b].m * bs[r * nb + b];
            }
        }
        for (int r = 0; r < R; r++) y[(size_t)r * N + n] = hsum(acc[r]) + mins[r];
    }
}
static inline __attribute__((always_inline)) void q8_cols(const int R, const float *x, int K, const blk8 *w,
                                                          float *y, int N, int n0, int n1) {
    const int nb = K / 32;
    for (int n = n0; n < n1; n++) {
        const blk8 *c = w + (size_t)n * nb;
        __m256 acc[MAXR];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m256 w0 = S8(c[b].qs), w1 = S8(c[b].qs + 8), w2 = S8(c[b].qs + 16), w3 = S8(c[b].qs + 24);
            __m256 dd = _mm256_broadcast_ss(&c[b].d);
            for (int r = 0; r < R; r++) {
                acc[r] = _mm256_fmadd_ps(dd, dot32(w0, w1, w2, w3, x + (size_t)r * K + b * 32), acc[r]);
            }
        }
        for (int r = 0; r < R; r++) y[(size_t)r * N + n] = hsum(acc[r]);
    }
}
void specdec_set_threads(int threads) { omp_set_num_threads(threads); }

// x [M, K] -> y [M, N]
void q41_gemm(const float *x, int M, int K, const blk4 *w, float *y, int N) {
    const int nb = K / 32;
    float bs[MAXR * nb];  // the block sums of the tile's rows
    for (int m0 = 0; m0 < M; m0 += MAXR) {
        int R = M - m0 < MAXR ? M - m0 : MAXR;
        for (int r = 0; r < R; r++)
            for (int b = 0; b < nb; b++) {
                const float *xb = x + (size_t)(m0 + r) * K + b * 32;
                float s = 0;
                for (int j = 0; j < 32; j++) s += xb[j];
                bs[r * nb + b] = s;
            }
        #pragma omp parallel
        {
            int t = omp_get_thread_num(), T = omp_get_num_threads(), chunk = (N + T - 1) / T;
            int n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
            const float *xr = x + (size_t)m0 * K; float *yr = y + (size_t)m0 * N;
            switch (R) {  // a constant R per call: the row loops unroll and the accumulators stay in registers
            case 1: q4_cols(1, xr, bs, K, w, yr, N, n0, n1); break;
            case 2: q4_cols(2, xr, bs, K, w, yr, N, n0, n1); break;
            case 3: q4_cols(3, xr, bs, K, w, yr, N, n0, n1); break;
            case 4: q4_cols(4, xr, bs, K, w, yr, N, n0, n1); break;
            case 5: q4_cols(5, xr, bs, K, w, yr, N, n0, n1); break;
            default: q4_cols(6, xr, bs, K, w, yr, N, n0, n1);
            }
        }
    }
}
void q8_gemm(const float *x, int M, int K, const blk8 *w, float *y, int N) {
    for (int m0 = 0; m0 < M; m0 += MAXR) {
        int R = M - m0 < MAXR ? M - m0 : MAXR;
        #pragma omp parallel
        {
            int t = omp_get_thread_num(), T = omp_get_num_threads(), chunk = (N + T - 1) / T;
            int n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
            const float *xr = x + (size_t)m0 * K; float *yr = y + (size_t)m0 * N;
            switch (R) {
            case 1: q8_cols(1, xr, K, w, yr, N, n0, n1); break;
            case 2: q8_cols(2, xr, K, w, yr, N, n0, n1); break;
            case 3: q8_cols(3, xr, K, w, yr, N, n0, n1); break;
            case 4: q8_cols(4, xr, K, w, yr, N, n0, n1); break;
            case 5: q8_cols(5, xr, K, w, yr, N, n0, n1); break;
            default: q8_cols(6, xr, K, w, yr, N, n0, n1);
            }
        }
    }
}

// Causal attention of one layer and slot. q [T, Hq, D] (rotated) at positions pos..pos+T-1; keys, values
// [Hkv, S, D], already holding positions 0..pos+T-1; query head h reads KV head h / (Hq / Hkv); out [T, Hq, D].
void attention(const float *q, int T, int Hq, int Hkv, int D, const float *keys, const float *values, int S, int pos,
               float scale, float *out) {
    const int group = Hq / Hkv;
    #pragma omp parallel for schedule(static)
    for (int task = 0; task < T * Hq; task++) {
        const int t = task / Hq, h = task % Hq, end = pos + t + 1;
        const float *qv = q + (size_t)task * D, *k = keys + (size_t)(h / group) * S * D;
        const float *v = values + (size_t)(h / group) * S * D;
        float *o = out + (size_t)task * D;
        float scores[end], top = -INFINITY, total = 0.f;
        for (int j = 0; j < end; j++) {
            float s = 0.f;
            #pragma omp simd reduction(+ : s)
            for (int i = 0; i < D; i++) s += qv[i] * k[(size_t)j * D + i];
            scores[j] = s * scale;
            top = scores[j] > top ? scores[j] : top;
        }
        for (int j = 0; j < end; j++) { scores[j] = expf(scores[j] - top); total += scores[j]; }
        for (int i = 0; i < D; i++) o[i] = 0.f;
        for (int j = 0; j < end; j++) {
            const float p = scores[j] / total;
            for (int i = 0; i < D; i++) o[i] += p * v[(size_t)j * D + i];
        }
    }
}

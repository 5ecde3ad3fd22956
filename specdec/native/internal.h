// What the kernels' source files share (not exported).
#ifndef SPECDEC_INTERNAL_H
#define SPECDEC_INTERNAL_H

#include <immintrin.h>
#include <stddef.h>

#include "specdec_native.h"

#define ALIGNED(bytes) (((bytes) + 63) & ~(size_t)63)  // scratch regions start on cache lines

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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


// ---- linear.c: x [M, K] -> y [M, N] (rows ldy apart) through blocks [N, K / 32] ----
enum {  // specdec_native.h's weight kinds, by shorter names: blk4, blk8, blk4p, rows [N, K], blk6, blk5
    W_Q4 = SPECDEC_W_Q41, W_Q8 = SPECDEC_W_Q80, W_Q4P = SPECDEC_W_Q41P, W_BF16 = SPECDEC_W_BF16, W_F16 = SPECDEC_W_F16,
    W_F32 = SPECDEC_W_F32, W_Q6 = SPECDEC_W_Q6, W_Q5 = SPECDEC_W_Q5
};
enum { K_STEP = 0, K_PROMPT = 1, K_INT8 = 2, K_Q8A = 3, K_Q8A_REF = 4 };  // the kernels: specdec_native.h's
                                                                         // specdec_matmul
// scratch of one linear: K_PROMPT decodes columns into `decoded` (linear_decoded_floats per thread), K_INT8 rounds
// the activations into `rounded` (linear_rounded_bytes)
void linear(int threads, int kernel, int kind, const float *x, int M, int K, const void *w, float *y, int N, int ldy,
            float *decoded, void *rounded);
size_t linear_decoded_floats(int K);
size_t linear_rounded_bytes(int M, int K);
int linear_blocks_per_column(int K, int kind);
void decode8_row(const blk8 *c, int nb, float *out);  // a Q8_0 row's values, d * q (a tied embedding's row)
void decode_blocks(int kind, const void *row, int nb, float *out);  // nb blocks of kind W_Q4, W_Q5, W_Q8 or W_Q6
int linear_kind_ok(int kernel, int kind);  // whether specdec_matmul's kernel runs weights of this kind
void decode_row(int kind, const void *row, int K, float *out);  // a bf16 / f16 / f32 row's K values (any alignment)
int row_kind(int model_kind);  // the linear kind of a model_t kind's rows (W_BF16, W_F16, W_F32), or -1

// ---- linear_q8a.c: int8 activations (K_Q8A, and its plain C reference K_Q8A_REF) times blk4, blk8 or blk6 ----
// A row's block of 32 activations rounded to int8: x ~ d * qs; s the block's exact sum (Q4_1's minimum term);
// off[h] = -128 * the sum of qs[16 h..16 h + 15] (weights stored + 128 for vpdpbusd)
typedef struct { float d, s; int32_t off[2]; int8_t qs[32]; } blkx;
_Static_assert(sizeof(blkx) == 48, "blkx is 48 bytes");
// x [M, K] -> y [M, N] (rows ldy apart): `columns` holds q8a_columns_bytes(K) per worker, `rounded`
// q8a_rounded_bytes(M, K)
void linear_q8a(int threads, int reference, int kind, const float *x, int M, int K, const void *w, float *y, int N,
                int ldy, void *columns, void *rounded);
size_t q8a_columns_bytes(int K);
size_t q8a_rounded_bytes(int M, int K);
int q8a_kind_ok(int kind);  // whether int8 activations multiply weights of this kind (else they stay fp32)

// ---- attention.c: causal GQA of B rows over their own KV ----
typedef struct {
    int B, T, Hq, Hkv, D, S;
    int window;                   // keys a query sees, its own included, or 0: every earlier key
    float scale;
    const int32_t *pos;           // [B]
    const float *q;               // [B, T, Hq, D], rotated
    const float *const *keys;     // [B] of [Hkv, S, D], holding positions 0..pos[b] + T - 1
    const float *const *values;
    float *out;                   // [B, T, Hq, D]
} attention_t;
size_t attention_scratch_bytes(int B, int T, int Hq, int Hkv, int D, int S);
void attention(int threads, const attention_t *a, void *scratch);

#endif

// What the kernels' source files share (not exported).
#ifndef SPECDEC_INTERNAL_H
#define SPECDEC_INTERNAL_H

#include <immintrin.h>
#include <stddef.h>

#include "specdec_native.h"

#define BLOCK SPECDEC_BLOCK  // weights per block along K
#define ALIGNED(bytes) (((bytes) + 63) & ~(size_t)63)  // scratch regions start on cache lines
#define MAX_DIM (1 << 20)   // any model dimension above this is refused (and keeps every product within size_t)
#define MAX_ROWS (1 << 16)  // rows (B * T) one call may take
static inline int out_of(long value, long low, long high) { return value < low || value > high; }
// whether a decoder layer's dimensions are out of range: hidden H, query and KV heads, head size D, MLP width I (a
// target's model_t and a draft head's head_t alike; checked in this order, so no product below overflows)
static inline int layer_dims_bad(int H, int Hq, int Hkv, int D, int I) {
    return out_of(H, BLOCK, MAX_DIM) || H % BLOCK || out_of(Hkv, 1, 4096) || out_of(Hq, Hkv, 4096) || Hq % Hkv ||
           out_of(D, 2, 4096) || D % 2 || (Hq * D) % BLOCK || out_of((long)Hq * D, BLOCK, MAX_DIM) ||
           out_of((long)(Hq + 2 * Hkv) * D, 1, MAX_DIM) || out_of(I, BLOCK, MAX_DIM) || I % BLOCK;
}
// a forward's rows: SPECDEC_E_SHAPE for B rows of T tokens or S positions out of range, SPECDEC_E_THREADS for threads
static inline int rows_bad(int B, int T, int S, int threads) {
    if (out_of(B, 1, MAX_ROWS) || out_of(T, 1, MAX_ROWS) || (long)B * T > MAX_ROWS || out_of(S, 1, 1L << 24))
        return SPECDEC_E_SHAPE;
    return out_of(threads, 1, SPECDEC_MAX_THREADS) ? SPECDEC_E_THREADS : SPECDEC_OK;
}

// A 5-bit block's codes (blk5: 160 bits, slot i holding q[SPECDEC_Q5_ORDER[i]]). Q5_BIT(k): the first bit of
// q[k] for k in 0..15 from the block's start, and of q[16 + k] from its byte 5 (q[16 + k] lies 40 bits after q[k])
#define Q5_BIT(k) (5 * (((k) >> 1) + ((k) & 1) + (((k) >> 1) & 1) * 15))
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


// ---- the weight kinds (specdec_kinds.h's table): W_<NAME> for SPECDEC_W_<NAME>, and each kind's traits ----
enum {
#define SHORT_NAME(NAME, ...) W_##NAME = SPECDEC_W_##NAME,
    SPECDEC_WEIGHT_KINDS(SHORT_NAME)
#undef SHORT_NAME
};
enum {
    K_STEP = SPECDEC_KERNEL_STEP, K_PROMPT = SPECDEC_KERNEL_PROMPT, K_INT8 = SPECDEC_KERNEL_INT8,
    K_Q8A = SPECDEC_KERNEL_Q8A, K_Q8A_REF = SPECDEC_KERNEL_Q8A_REF, K_BF16A = SPECDEC_KERNEL_BF16A
};
typedef struct {
    size_t bytes;      // of an element
    int per;           // weights an element holds along K
    int kernels, isas; // SPECDEC_STEP / _PROMPT / _INT8 / _Q8A / _Q8A_REF bits, SPECDEC_ISA_* bits
} kind_traits;
static const kind_traits KINDS[SPECDEC_W_COUNT] = {  // by id: a repeated one is an error (-Woverride-init)
#define TRAITS(NAME, ID, ELEMENT, BYTES, PER, KERNELS, ISAS, DECODE) [ID] = {sizeof(ELEMENT), PER, KERNELS, ISAS},
    SPECDEC_WEIGHT_KINDS(TRAITS)
#undef TRAITS
};
typedef struct { int linear, head; } model_traits;  // model_t.kind's weight kinds (SPECDEC_W_EACH: per layer)
static const model_traits MODELS[SPECDEC_MODEL_COUNT] = {
#define TRAITS(NAME, ID, LINEAR, HEAD) [ID] = {LINEAR, HEAD},
    SPECDEC_MODEL_KINDS(TRAITS)
#undef TRAITS
};
#if defined(__AVX512VBMI__)
#define THIS_ISA SPECDEC_ISA_AVX512_VBMI  // the build this is (build.py: isa())
#elif defined(__AVX512F__)
#define THIS_ISA SPECDEC_ISA_AVX512
#elif defined(__AVXVNNI__)
#define THIS_ISA SPECDEC_ISA_AVX2_VNNI
#else
#define THIS_ISA SPECDEC_ISA_AVX2
#endif
static inline int kind_known(int kind) { return kind >= 0 && kind < SPECDEC_W_COUNT; }
static inline int rows_kind(int kind) { return kind_known(kind) && KINDS[kind].per == 1; }  // rows [N, K]
// elements of a column of K weights, and their bytes
static inline int kind_elements(int kind, int K) { return (K + KINDS[kind].per - 1) / KINDS[kind].per; }
static inline size_t kind_column_bytes(int kind, int K) { return KINDS[kind].bytes * (size_t)kind_elements(kind, K); }

// ---- linear.c: x [M, K] -> y [M, N] (rows ldy apart) through weights [N, kind_elements(kind, K)] ----
// scratch of one linear: K_PROMPT decodes columns into `decoded` (linear_decoded_floats per thread), K_INT8 rounds
// the activations into `rounded` (linear_rounded_bytes)
void linear(int threads, int kernel, int kind, const float *x, int M, int K, const void *w, float *y, int N, int ldy,
            float *decoded, void *rounded);
size_t linear_decoded_floats(int K);
size_t linear_rounded_bytes(int M, int K);
int linear_kind_ok(int kernel, int kind);  // whether specdec_matmul's kernel runs weights of this kind in this build
void linear_decode(int kind, const void *column, int K, float *out);  // a column's K weights as fp32, out at any
                                                                      // alignment (a kind with the prompt kernel)

// ---- linear_q8a.c: int8 activations (K_Q8A, and its plain C reference K_Q8A_REF) times blk4, blk8 or blk6 ----
// A row's block of 32 activations rounded to int8, its largest kept apart: x[i] ~ d * qs[i] for i != j, and x[j] = e
// (j the first of the largest |x|, 0 in a block of zeros; qs[j] = 0); s = fma(d, the sum of qs, e) (Q4_1's minimum
// term); off[h] = -128 * the sum of qs[16 h..16 h + 15] (weights stored + 128 for vpdpbusd); ok = j / 4 and ocode a 1
// in byte j % 4 of a dword: the one-hot activations that pick code j out of the codes 4 ok..4 ok + 3
typedef struct { float d, s, e; int32_t off[2], ocode; uint8_t oj, ok, pad[6]; int8_t qs[32]; } blkx;
_Static_assert(sizeof(blkx) == 64, "blkx is 64 bytes");
// x [M, K] -> y [M, N] (rows ldy apart): `columns` holds q8a_columns_bytes(K) per worker, `rounded`
// q8a_rounded_bytes(M, K)
void linear_q8a(int threads, int reference, int kind, const float *x, int M, int K, const void *w, float *y, int N,
                int ldy, void *columns, void *rounded);
size_t q8a_columns_bytes(int K);
size_t q8a_rounded_bytes(int M, int K);
int q8a_kind_ok(int kind);  // whether linear_q8a has code for weights of this kind (the table says which take it)

// ---- linear_bf16a.c: bf16 activations (K_BF16A) times bf16 rows, on AMX-BF16 tiles ----
// x [M, K] -> y [M, N] (rows ldy apart) through bf16 rows [N, K]: `buffers` holds bf16a_worker_bytes(K) per worker,
// `rounded` bf16a_rounded_bytes(M, K)
void linear_bf16a(int threads, const float *x, int M, int K, const void *w, float *y, int N, int ldy, void *buffers,
                  void *rounded);
size_t bf16a_worker_bytes(int K);
size_t bf16a_rounded_bytes(int M, int K);
int bf16a_ok(void);  // whether this build has the kernel and the CPU runs it (AVX-512 with AVX512-BF16)

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

// ---- forward.c's work on one row, shared with head.c ----
void row_rmsnorm(const float *x, const float *gamma, float eps, int H, float *out);  // sums in one order for any H
void row_rotate(const float *x, const float *cs, const float *sn, int D, float *out);  // rotate-half rotary of a head
void row_silu_times(const float *g, const float *u, int I, float *y);                // SiLU(gate) * up
int logits_sound(const float *logits, int rows, int V);  // no NaN in any row of [rows, V], and each one's max finite

#endif

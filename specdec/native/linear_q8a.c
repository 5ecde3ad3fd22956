// The int8 activations mode (specdec_forward's SPECDEC_ACT_INT8; specdec_matmul's kernels 3 and 4): each row's
// activations rounded per block of 32 to int8 with an fp32 scale (a Q8 block, as llama.cpp's, but with the block's
// largest value kept apart in fp32), then multiplied with blocked weights (blk4: Q4_1, blk5: the K-quants' 5-bit
// fallback, as Q4_1 with 5-bit codes, blk8: Q8_0, blk6: Q6_K's) by integer dot products: VNNI's vpdpbusd (the AVX-512
// builds; AVX-VNNI's in the avx2-vnni build), else vpmaddubsw + vpmaddwd (avx2).
//
// Summation order, which makes a row's result independent of the call: a block's integer dot product is exact
// whatever instructions compute it, and the floats of one output form one chain over its blocks, block 0 first:
//     acc = fma(dw * dx, dot, acc)       blk6: acc = fma(d0 * dx, dot of elements 0-15, acc), then
//                                              acc = fma(d1 * dx, dot of elements 16-31, acc)
//     then acc = fma(e, dw * code j, acc)   (the largest, x[j] = e, times its weight: dw its half's scale for blk6)
//     then for Q4_1's minimum acc = fma(m, s, acc)   (s = fma(dx, the sum of the codes, e))
// The weight dw * code j is the same float whether a one-hot product picks code j (a few rows) or it was decoded with
// every other element's for a prompt's many rows (WIDE).
// A vector holds one output per lane (16 columns of one row, or 8 in the AVX2 builds), never parts of one output. So a
// decode step, a verify pass, a prompt chunk and a batch of rows (one kernel serves them all), every thread count and
// every build give an output the same bits, those of the scalar reference (kernel 4), which the tests compare with.
//
// A task is 16 columns. Each block of theirs is decoded as 8 vectors of codes (vector k holds each column's codes
// 4k..4k+3 in that column's lane: what vpdpbusd sums into one lane) and the 16 columns' scales: in registers, for the
// few rows of a step or a verify pass (AVX-512), else once into the worker's buffer, which tiles of rows then read.
// The next task's weights are fetched into L2 meanwhile: the 16 columns are read across, not along, their blocks.
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "pool.h"

#define COLS 16          // columns per task (one 16-lane vector of outputs, two of 8 with AVX2)
#define TINY 1e-30f      // a block whose largest |x| is below this rounds to zeros (127 / max |x| stays finite)
#if defined(__AVX512F__)
#define ROWS 8           // rows per pass over a block's codes (held in 8 of the 32 registers)
#else
#define ROWS 4           // ... (16 registers, 8 columns at a time)
#endif
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define VNNI 1           // vpdpbusd: unsigned codes times signed activations; signed weights are stored + 128
#else
#define VNNI 0           // vpmaddubsw: signed weights keep their sign, moved onto the activations (vpsignb)
#endif

// The decoded blocks of a task's columns: codes q[k] (lane c: column c's codes 4k..4k+3, bytes 4c..4c+3), then per
// column the scale (a) and the minimum (b: Q4_1) or the second scale (b: blk6)
typedef struct { _Alignas(64) uint8_t q[8][64]; float a[COLS], b[COLS]; } cols16;
_Static_assert(sizeof(cols16) == 640, "cols16 is 640 bytes");
// ... and for a prompt's many rows (WIDE), after the task's cols16, its blocks' weights as floats, scale times code
// (w[i]: the 16 columns' weights at element i), which a row's largest value meets in one multiply-add
typedef struct { _Alignas(64) float w[32][COLS]; } apart16;
_Static_assert(sizeof(apart16) == 2048, "apart16 is 2048 bytes");
#define WIDE 32  // rows from which a task's weights are decoded into apart16 too (fewer: a one-hot product of codes)

size_t q8a_columns_bytes(int K) { return ALIGNED((sizeof(cols16) + sizeof(apart16)) * (size_t)(K / BLOCK)); }
size_t q8a_rounded_bytes(int M, int K) { return ALIGNED(sizeof(blkx) * (size_t)M * (size_t)(K / BLOCK)); }
int q8a_kind_ok(int kind) { return kind == W_Q41 || kind == W_Q80 || kind == W_Q6 || kind == W_Q5; }
// codes 0..15 or 0..31 and a minimum (Q4_1, blk5): vpdpbusd takes the codes as they are, and acc gains m * s
#define UNSIGNED(kind) ((kind) == W_Q41 || (kind) == W_Q5)

// ---- the activations: x [M, K] -> blkx [M, K / BLOCK] ----
// Each block's largest |x| (the first, x[j]) is kept apart, exact: e = x[j], met by its weight as a float, so that
// one large value no longer leaves the other 31 few levels. The others are rounded on their own largest:
// d = max over i != j of |x[i]| / 127, qs[i] = x[i] * (127 / that) to nearest (even), so |qs| <= 127, and qs[j] = 0.
// (On the default bundle this took the top-1 agreement with fp32 from 97.7 % to 99.2 %: docs/backends.md.)
// s = fma(d, the sum of the qs, e): the block as rounded, so that Q4_1's minimum meets the values its codes meet.
// (The exact sum of the unrounded block left m times the sum of the rounding errors in every output, which made the
// mean KL from fp32 five times larger.) A block holding inf or NaN gets d = s = e = NaN: its outputs are NaN, which
// the logits check reports, never a finite guess. A block below TINY, or its rest, rounds to zeros.
// x[j] = big kept apart (first set to 0 at j = 0: a block of zeros, or one holding inf or NaN, keeps that j)
static void one_apart(float big, int j, blkx *out) {
    out->e = big, out->oj = (uint8_t)j, out->ok = (uint8_t)(j / 4), out->ocode = 1 << (8 * (j % 4));
}
#if defined(__AVX512F__)
// The rest of the block is its values but x[j]: rmax, their largest |x|, is the second of the block's two largest
// (equal to amax where amax is there twice); one tree over the lanes gives both
static inline __attribute__((always_inline)) float two_largest(__m512 a, __m512 b, float *first) {
    __m512 hi = _mm512_max_ps(a, b), lo = _mm512_min_ps(a, b);  // each lane's two, then a tree over the lanes
    const __m512i swap[4] = {_mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7),
                             _mm512_setr_epi32(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11),
                             _mm512_setr_epi32(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13),
                             _mm512_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)};
    for (int k = 0; k < 4; k++) {
        const __m512 h = _mm512_permutexvar_ps(swap[k], hi), l = _mm512_permutexvar_ps(swap[k], lo);
        lo = _mm512_max_ps(_mm512_min_ps(hi, h), _mm512_max_ps(lo, l));
        hi = _mm512_max_ps(hi, h);
    }
    *first = _mm512_cvtss_f32(hi);
    return _mm512_cvtss_f32(lo);
}
// whether a block's 32 values (two registers of |x|) hold inf or NaN
static inline __attribute__((always_inline)) int unsound(const __m512 size[2]) {
    const __m512 most = _mm512_set1_ps(FLT_MAX);
    return _mm512_cmp_ps_mask(size[0], most, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(size[1], most, _CMP_NLE_UQ);
}
// a sound block (v: its 32 values in two registers, size their |x|, amax and rmax as two_largest gives them) -> out,
// all in masks and reductions: no store and reload of the block
static inline __attribute__((always_inline)) void round_sound(const float *x, __m512 v[2], const __m512 size[2],
                                                              float amax, float rmax, blkx *out) {
    memset(out, 0, sizeof(*out));
    one_apart(0.f, 0, out);
    if (amax < TINY) return;
    const __m512 top = _mm512_set1_ps(amax);
    const unsigned at = (unsigned)_mm512_cmp_ps_mask(size[0], top, _CMP_EQ_OQ)
                        | (unsigned)_mm512_cmp_ps_mask(size[1], top, _CMP_EQ_OQ) << 16;  // lanes holding it
    const int j = __builtin_ctz(at);
    one_apart(x[j], j, out);
    int sum = 0;
    if (rmax >= TINY) {
        out->d = rmax / 127.f;
        const __m512 inv = _mm512_set1_ps(127.f / rmax);
        v[j / 16] = _mm512_mask_mov_ps(v[j / 16], (__mmask16)(1u << (j % 16)), _mm512_setzero_ps());  // x[j] out
        for (int h = 0; h < 2; h++) {
            const __m512i code = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], inv));  // to nearest, even: |code| <= 127
            _mm_storeu_si128((__m128i *)(out->qs + 16 * h), _mm512_cvtsepi32_epi8(code));
            const int half = _mm512_reduce_add_epi32(code);
            out->off[h] = -128 * half, sum += half;
        }
    }
    out->s = fmaf(out->d, (float)sum, out->e);
}
// one block (a tail's, or one of a group holding inf or NaN, which gets d = s = e = NaN)
static void round_one(const float *x, blkx *out) {
    __m512 v[2] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)};
    const __m512 size[2] = {_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])};
    if (unsound(size)) {
        memset(out, 0, sizeof(*out));
        one_apart(0.f, 0, out);
        out->d = out->s = out->e = NAN;
        return;
    }
    float amax;
    const float rmax = two_largest(size[0], size[1], &amax);
    round_sound(x, v, size, amax, rmax, out);
}
// G blocks at a time, each step of the G written together so that their chains of reductions overlap
#define G 4
static void round_blocks(const float *x, blkx *out, size_t n) {
    size_t i = 0;
    for (; i + G <= n; i += G) {
        __m512 v[G][2], size[G][2];
        float amax[G], rmax[G];
        int bad = 0;
        for (int g = 0; g < G; g++) {
            for (int h = 0; h < 2; h++) {
                v[g][h] = _mm512_loadu_ps(x + 32 * (i + g) + 16 * h);
                size[g][h] = _mm512_abs_ps(v[g][h]);
            }
            bad |= unsound(size[g]);
        }
        if (bad) {
            for (int g = 0; g < G; g++) round_one(x + 32 * (i + g), out + i + g);
            continue;
        }
        for (int g = 0; g < G; g++) rmax[g] = two_largest(size[g][0], size[g][1], &amax[g]);
        for (int g = 0; g < G; g++) round_sound(x + 32 * (i + g), v[g], size[g], amax[g], rmax[g], out + i + g);
    }
    for (; i < n; i++) round_one(x + 32 * i, out + i);
}
#undef G
#else
static float largest(const __m256 v[4]) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 top = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[k]));
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
static void round_block(const float *x, blkx *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f), most = _mm256_set1_ps(FLT_MAX);
    float rest[32];
    memcpy(rest, x, sizeof(rest));
    __m256 v[4] = {_mm256_loadu_ps(rest), _mm256_loadu_ps(rest + 8), _mm256_loadu_ps(rest + 16),
                   _mm256_loadu_ps(rest + 24)};
    memset(out, 0, sizeof(*out));
    one_apart(0.f, 0, out);
    int bad = 0;
    for (int k = 0; k < 4; k++) bad |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, v[k]), most,
                                                                        _CMP_NLE_UQ));  // inf or NaN
    if (bad) {
        out->d = out->s = out->e = NAN;
        return;
    }
    const float amax = largest(v);
    if (amax < TINY) return;
    unsigned at = 0;  // the lanes holding the largest |x|
    for (int k = 0; k < 4; k++)
        at |= (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, v[k]), _mm256_set1_ps(amax),
                                                         _CMP_EQ_OQ)) << (8 * k);
    const int j = __builtin_ctz(at);
    one_apart(rest[j], j, out);
    rest[j] = 0.f;
    for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(rest + 8 * k);
    const float rmax = largest(v);
    int sum = 0;
    if (rmax >= TINY) {
        out->d = rmax / 127.f;
        const __m256 inv = _mm256_set1_ps(127.f / rmax);
        __m256i code[4];
        for (int k = 0; k < 4; k++) code[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));  // to nearest, even
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(code[0], code[1]),
                                                  _mm256_packs_epi32(code[2], code[3]));  // lanes interleaved
        _mm256_storeu_si256((__m256i *)out->qs,
                            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        for (int h = 0; h < 2; h++) {
            const __m256i s = _mm256_add_epi32(code[2 * h], code[2 * h + 1]);
            __m128i u = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
            out->off[h] = -128 * _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1)));
        }
        sum = -(out->off[0] + out->off[1]) / 128;
    }
    out->s = fmaf(out->d, (float)sum, out->e);
}

static void round_blocks(const float *x, blkx *out, size_t n) {
    for (size_t i = 0; i < n; i++) round_block(x + 32 * i, out + i);
}
#endif

// ... in plain C: the reference
static void round_block_reference(const float *x, blkx *out) {
    float amax = 0.f;
    int bad = 0, j = 0;
    for (int i = 0; i < 32; i++) {
        const float a = fabsf(x[i]);
        bad |= !(a <= FLT_MAX);
        if (a > amax) amax = a, j = i;  // the first of the largest
    }
    memset(out, 0, sizeof(*out));
    one_apart(0.f, 0, out);
    if (bad) {
        out->d = out->s = out->e = NAN;
        return;
    }
    if (amax < TINY) return;
    one_apart(x[j], j, out);
    float rmax = 0.f;
    for (int i = 0; i < 32; i++)
        if (i != j) rmax = fmaxf(rmax, fabsf(x[i]));
    int sum = 0;
    if (rmax >= TINY) {
        out->d = rmax / 127.f;
        const float inv = 127.f / rmax;
        for (int i = 0; i < 32; i++) {
            out->qs[i] = (int8_t)(i == j ? 0 : (int)nearbyintf(x[i] * inv));
            out->off[i / 16] -= 128 * out->qs[i];
            sum += out->qs[i];
        }
    }
    out->s = fmaf(out->d, (float)sum, out->e);
}

typedef struct {
    int reference, kind, M, K, N, ldy;
    const float *x;
    blkx *a;  // [M, K / BLOCK]
    const void *w;
    float *y;
    char *columns;  // q8a_columns_bytes(K) per worker
} q8a_job;

static void round_task(void *ctx, int first, int last, int worker) {
    const q8a_job *j = ctx;
    const int nb = j->K / BLOCK;
    (void)worker;
    if (!j->reference) {
        round_blocks(j->x + (size_t)first * nb * 32, j->a + (size_t)first * nb, (size_t)(last - first) * nb);
        return;
    }
    for (size_t i = (size_t)first * nb; i < (size_t)last * nb; i++) round_block_reference(j->x + i * 32, j->a + i);
}

// ---- the reference: one output at a time, in plain C ----
static size_t block_bytes(int kind) {
    return kind == W_Q41 ? sizeof(blk4) : kind == W_Q80 ? sizeof(blk8) : kind == W_Q5 ? sizeof(blk5) : sizeof(blk6);
}
// where its scale starts (the minimum or the second scale follows it)
static size_t scale_at(int kind) { return kind == W_Q5 ? offsetof(blk5, d) : 0; }
// blk5's code i, from its 5-bit slot (specdec_kinds.h: slot s holds q[SPECDEC_Q5_ORDER[s]], bits 5 s..5 s + 4)
static int q5_code(const blk5 *c, int i) {
    static const int order[32] = SPECDEC_Q5_ORDER;
    int slot = 0;
    while (order[slot] != i) slot++;
    const int bit = 5 * slot, byte = bit >> 3, shift = bit & 7;
    const int pair = c->codes[byte] | (shift > 3 ? c->codes[byte + 1] << 8 : 0);  // never past the codes
    return (pair >> shift) & 31;
}
// one weight's code at element i of a block: what the kernels' vector k = i / 4, byte i % 4, holds for a column
static int code_at(int kind, const char *block, int i) {
    if (kind == W_Q41) {
        const blk4 *c = (const blk4 *)block;
        return i < 16 ? c->qs[i] & 15 : c->qs[i - 16] >> 4;
    }
    if (kind == W_Q5) return q5_code((const blk5 *)block, i);
    return kind == W_Q80 ? ((const blk8 *)block)->qs[i] : ((const blk6 *)block)->qs[i];
}

static float output_reference(int kind, const char *column, const blkx *x, int nb) {
    float acc = 0.f;
    for (int b = 0; b < nb; b++, x++) {
        const char *block = column + (size_t)b * block_bytes(kind);
        const float code = (float)code_at(kind, block, x->oj);  // the weight the largest meets: its code...
        if (UNSIGNED(kind)) {  // Q4_1, blk5: d then m at scale_at, codes 0..15 or 0..31
            float dm[2];
            memcpy(dm, block + scale_at(kind), sizeof(dm));
            int dot = 0;
            for (int i = 0; i < 32; i++) dot += code_at(kind, block, i) * x->qs[i];
            acc = fmaf(dm[0] * x->d, (float)dot, acc);
            acc = fmaf(x->e, dm[0] * code, acc);  // ... times its scale (the minimum is in s)
            acc = fmaf(dm[1], x->s, acc);
        } else if (kind == W_Q80) {
            const blk8 *c = (const blk8 *)block;
            int dot = 0;
            for (int i = 0; i < 32; i++) dot += c->qs[i] * x->qs[i];
            acc = fmaf(c->d * x->d, (float)dot, acc);
            acc = fmaf(x->e, c->d * code, acc);
        } else {
            const blk6 *c = (const blk6 *)block;
            int dot[2] = {0, 0};
            for (int i = 0; i < 32; i++) dot[i / 16] += c->qs[i] * x->qs[i];
            acc = fmaf(c->d[0] * x->d, (float)dot[0], acc);
            acc = fmaf(c->d[1] * x->d, (float)dot[1], acc);
            acc = fmaf(x->e, c->d[x->oj / 16] * code, acc);
        }
    }
    return acc;
}


// ---- decoding a task's columns into cols16 ----
// where a block's codes start (its scale starts it; the minimum or the second scale follows)
static size_t codes_at(int kind) {
    return kind == W_Q41 ? offsetof(blk4, qs) : kind == W_Q80 ? offsetof(blk8, qs)
           : kind == W_Q5 ? offsetof(blk5, codes) : offsetof(blk6, qs);
}
#define LOAD16(p) _mm_loadu_si128((const __m128i *)(p))

// blk5 (both builds): a code's two bytes as a 16-bit word, for a byte shuffle to gather
#define Q5_WORD(k) ((unsigned)(Q5_BIT(k) >> 3) | (unsigned)((Q5_BIT(k) >> 3) + 1) << 8)

#if defined(__AVX512F__)
// 16 columns' 16 bytes at `at` (column c's block at col[c]) -> t[i], lane c holding column c's bytes 4i..4i+3:
// register j takes columns j, 4 + j, 8 + j, 12 + j in its 128-bit lanes, then a 4 x 4 transpose of dwords within
// the lanes puts column 4 L + p in dword p of lane L
static inline __attribute__((always_inline)) void gathered(const char *const col[COLS], size_t at, __m512i z[4]) {
    for (int j = 0; j < 4; j++)
        z[j] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(LOAD16(col[j] + at)),
               LOAD16(col[4 + j] + at), 1), LOAD16(col[8 + j] + at), 2), LOAD16(col[12 + j] + at), 3);
}
static inline __attribute__((always_inline)) void dwords_transposed(const __m512i z[4], __m512i t[4]) {
    const __m512i a = _mm512_unpacklo_epi32(z[0], z[1]), b = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i c = _mm512_unpacklo_epi32(z[2], z[3]), d = _mm512_unpackhi_epi32(z[2], z[3]);
    t[0] = _mm512_unpacklo_epi64(a, c), t[1] = _mm512_unpackhi_epi64(a, c);
    t[2] = _mm512_unpacklo_epi64(b, d), t[3] = _mm512_unpackhi_epi64(b, d);
}
static inline __attribute__((always_inline)) void transposed(const char *const col[COLS], size_t at, __m512i t[4]) {
    __m512i z[4];
    gathered(col, at, z);
    dwords_transposed(z, t);
}
// blk5: each 128-bit lane of z, the 16 bytes loaded at a block's codes (or at their byte 5), -> its codes 0..15 (or
// 16..31) in their order, one a byte. Each code lies within one 8-byte half of the load (specdec_kinds.h): with
// VBMI one multishift puts the codes of each half at its bytes (codes 0, 1, 4, 5, 8, 9, 12, 13 of the first, the
// others of the second), then a byte shuffle orders them; without, two shuffles of each code's two bytes, shifts and
// a pack. Then the dword transpose, as for any codes.
#define Q5_WORDS(k) (int)(Q5_WORD(k) | Q5_WORD((k) + 1) << 16)
#define Q5_SHIFT2(k) (int)((unsigned)(Q5_BIT(k) & 7) | (unsigned)(Q5_BIT((k) + 1) & 7) << 16)
#define Q5_LANES(F, k) _mm512_setr_epi32(F(k), F(k + 2), F(k + 4), F(k + 6), F(k), F(k + 2), F(k + 4), F(k + 6), \
                                         F(k), F(k + 2), F(k + 4), F(k + 6), F(k), F(k + 2), F(k + 4), F(k + 6))
static inline __attribute__((always_inline)) __m512i q5_lanes(__m512i z) {
#if defined(__AVX512VBMI__)
    const __m512i at = _mm512_set1_epi64((long long)(
        (unsigned long long)Q5_BIT(0) | (unsigned long long)Q5_BIT(1) << 8 | (unsigned long long)Q5_BIT(4) << 16 |
        (unsigned long long)Q5_BIT(5) << 24 | (unsigned long long)Q5_BIT(8) << 32 |
        (unsigned long long)Q5_BIT(9) << 40 |
        (unsigned long long)Q5_BIT(12) << 48 | (unsigned long long)Q5_BIT(13) << 56));
    const __m512i second = _mm512_set1_epi64((long long)(  // the second half's, less its 64 bits
        (unsigned long long)(Q5_BIT(2) - 64) | (unsigned long long)(Q5_BIT(3) - 64) << 8 |
        (unsigned long long)(Q5_BIT(6) - 64) << 16 | (unsigned long long)(Q5_BIT(7) - 64) << 24 |
        (unsigned long long)(Q5_BIT(10) - 64) << 32 | (unsigned long long)(Q5_BIT(11) - 64) << 40 |
        (unsigned long long)(Q5_BIT(14) - 64) << 48 | (unsigned long long)(Q5_BIT(15) - 64) << 56));
    const __m512i shifts = _mm512_mask_blend_epi64(0xAA, at, second);
    const __m512i codes = _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, z), _mm512_set1_epi8(31));
    const __m128i order = _mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    return _mm512_shuffle_epi8(codes, _mm512_broadcast_i32x4(order));
#else
    const __m512i mask = _mm512_set1_epi16(31);
    const __m512i first = _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_epi8(z, Q5_LANES(Q5_WORDS, 0)),
                                                             Q5_LANES(Q5_SHIFT2, 0)), mask);
    const __m512i second = _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_epi8(z, Q5_LANES(Q5_WORDS, 8)),
                                                              Q5_LANES(Q5_SHIFT2, 8)), mask);
    return _mm512_packus_epi16(first, second);  // per lane: codes 0-7, then 8-15
#endif
}
static inline __attribute__((always_inline)) void q5_transposed(const char *const col[COLS], size_t at, __m512i t[4]) {
    __m512i z[4];
    gathered(col, at, z);
    for (int j = 0; j < 4; j++) z[j] = q5_lanes(z[j]);
    dwords_transposed(z, t);
}
// block b of the 16 columns in registers: codes w[k] (Q4_1's nibbles apart: the low ones are codes 0-15, the high
// ones 16-31; signed codes + 128, as vpdpbusd takes the weights unsigned and the activations' off[] takes the 128s
// back out), scales da and minimums or second scales db by gathers (one of 8 bytes a column where both lie together)
static inline __attribute__((always_inline)) void decode_regs(const int kind, const char *const col[COLS],
                                                              const char *first, __m512i at, size_t b, __m512i w[8],
                                                              __m512 *da, __m512 *db) {
    const size_t bytes = block_bytes(kind);
    const size_t codes = b * bytes + codes_at(kind);
    __m512i t[4];
    if (kind == W_Q5) {  // unsigned: not flipped
        q5_transposed(col, codes, w);
        q5_transposed(col, codes + 5, w + 4);
    } else if (kind == W_Q41) {
        const __m512i low = _mm512_set1_epi8(0x0F);
        transposed(col, codes, t);
        for (int i = 0; i < 4; i++) w[i] = _mm512_and_si512(t[i], low);
        for (int i = 0; i < 4; i++) w[4 + i] = _mm512_and_si512(_mm512_srli_epi16(t[i], 4), low);
    } else {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        transposed(col, codes, t);
        for (int i = 0; i < 4; i++) w[i] = _mm512_xor_si512(t[i], flip);
        transposed(col, codes + 16, t);
        for (int i = 0; i < 4; i++) w[4 + i] = _mm512_xor_si512(t[i], flip);
    }
    if (kind == W_Q80) {
        *da = _mm512_i32gather_ps(at, first + b * bytes, 1);
        *db = _mm512_setzero_ps();
        return;
    }
    const char *scales = first + b * bytes + scale_at(kind);
    const __m512i lo = _mm512_i32gather_epi64(_mm512_castsi512_si256(at), scales, 1);  // (d, m) or d[2]
    const __m512i hi = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(at, 1), scales, 1);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *da = _mm512_castsi512_ps(_mm512_permutex2var_epi32(lo, even, hi));
    *db = _mm512_castsi512_ps(_mm512_permutex2var_epi32(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi));
}
// the weight a row's largest value at element i meets, scale times code, for each of the 16 columns: one[i] (codes
// w as decode_regs gives them: vector i / 4, byte i % 4; signed ones + 128)
static inline __attribute__((always_inline)) __m512 weight_at(const int kind, __m512i w, int byte, __m512 scale) {
    const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(w, _mm512_set1_epi32(8 * byte)), _mm512_set1_epi32(0xFF));
    const __m512i offset = _mm512_set1_epi32(UNSIGNED(kind) ? 0 : 128);
    return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_sub_epi32(code, offset)));
}
static inline __attribute__((always_inline)) void decode_block(const int kind, const int wide,
                                                               const char *const col[COLS], const char *first,
                                                               __m512i at, size_t b, cols16 *out, apart16 *one) {
    __m512i w[8];
    __m512 da, db;
    decode_regs(kind, col, first, at, b, w, &da, &db);
    for (int k = 0; k < 8; k++) _mm512_store_si512(out->q[k], w[k]);
    _mm512_store_ps(out->a, da), _mm512_store_ps(out->b, db);
    if (wide)
        for (int i = 0; i < 32; i++) _mm512_store_ps(one->w[i], weight_at(kind, w[i / 4], i % 4,
                                                                             kind == W_Q6 && i >= 16 ? db : da));
}
#else
static size_t second_at(int kind) {
    return kind == W_Q41 ? offsetof(blk4, m) : kind == W_Q5 ? offsetof(blk5, m) : offsetof(blk6, d) + sizeof(float);
}
// 8 columns' 16 bytes at `at` -> t[i], lane c holding column c's bytes 4i..4i+3 (as above, with two 128-bit lanes)
static inline __attribute__((always_inline)) void dwords_transposed(const __m256i z[4], __m256i t[4]) {
    const __m256i a = _mm256_unpacklo_epi32(z[0], z[1]), b = _mm256_unpackhi_epi32(z[0], z[1]);
    const __m256i c = _mm256_unpacklo_epi32(z[2], z[3]), d = _mm256_unpackhi_epi32(z[2], z[3]);
    t[0] = _mm256_unpacklo_epi64(a, c), t[1] = _mm256_unpackhi_epi64(a, c);
    t[2] = _mm256_unpacklo_epi64(b, d), t[3] = _mm256_unpackhi_epi64(b, d);
}
static inline __attribute__((always_inline)) void transposed(const char *const col[8], size_t at, __m256i t[4]) {
    __m256i z[4];
    for (int j = 0; j < 4; j++)
        z[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(LOAD16(col[j] + at)), LOAD16(col[4 + j] + at), 1);
    dwords_transposed(z, t);
}
// blk5: each 128-bit lane of z, the 16 bytes loaded at a block's codes (or at their byte 5), -> its codes 0..15 (or
// 16..31) in their order, one a byte: each code's two bytes gathered into a word, shifted by a multiply (AVX2 has no
// variable shift of words: w * 2^(11 - s), then 11 bits down, leaves bits s..s + 4 of w), packed to bytes
#define Q5_MUL(k) (short)(1 << (11 - (Q5_BIT(k) & 7)))
#define Q5_EIGHT(F, k) F(k), F(k + 1), F(k + 2), F(k + 3), F(k + 4), F(k + 5), F(k + 6), F(k + 7)
static inline __attribute__((always_inline)) __m256i q5_words(__m256i z, int k) {
    const __m256i pick = _mm256_setr_epi16(Q5_EIGHT((short)Q5_WORD, k), Q5_EIGHT((short)Q5_WORD, k));
    const __m256i by = _mm256_setr_epi16(Q5_EIGHT(Q5_MUL, k), Q5_EIGHT(Q5_MUL, k));
    return _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(z, pick), by), 11);
}
static inline __attribute__((always_inline)) void q5_transposed(const char *const col[8], size_t at, __m256i t[4]) {
    __m256i z[4];
    for (int j = 0; j < 4; j++) {
        const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(LOAD16(col[j] + at)),
                                                    LOAD16(col[4 + j] + at), 1);
        z[j] = _mm256_packus_epi16(q5_words(raw, 0), q5_words(raw, 8));  // per lane: codes 0-7, then 8-15
    }
    dwords_transposed(z, t);
}
// block b of the 16 columns, 8 at a time (half h: columns 8 h..8 h + 7, bytes 32 h.. of each vector); signed codes
// + 128 for vpdpbusd, or as they are for vpmaddubsw (which takes their sign onto the activations)
// the weights of element i for 8 columns (half h), scale times code, as above (codes: vector i / 4, byte i % 4;
// signed ones + 128 for vpdpbusd, else as they are)
static inline __attribute__((always_inline)) __m256 weight_at(const int kind, __m256i w, int byte, __m256 scale) {
    __m256i code;
    if (UNSIGNED(kind) || VNNI) {
        code = _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_set1_epi32(8 * byte)), _mm256_set1_epi32(0xFF));
        code = _mm256_sub_epi32(code, _mm256_set1_epi32(UNSIGNED(kind) ? 0 : 128));
    } else {
        code = _mm256_srai_epi32(_mm256_sllv_epi32(w, _mm256_set1_epi32(24 - 8 * byte)), 24);
    }
    return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(code));
}
static inline __attribute__((always_inline)) void decode_block(const int kind, const int wide,
                                                               const char *const col[COLS], const char *first,
                                                               __m256i at[2], size_t b, cols16 *out,
                                                               apart16 *one) {
    const size_t bytes = block_bytes(kind);
    const size_t codes = b * bytes + codes_at(kind);
    const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(VNNI ? (char)0x80 : 0);
    for (int h = 0; h < 2; h++) {
        __m256i t[4];
        if (kind == W_Q5) {  // unsigned: as they are
            for (int half = 0; half < 2; half++) {
                q5_transposed(col + 8 * h, codes + 5 * (size_t)half, t);
                for (int i = 0; i < 4; i++) _mm256_store_si256((__m256i *)(out->q[4 * half + i] + 32 * h), t[i]);
            }
        } else if (kind == W_Q41) {
            transposed(col + 8 * h, codes, t);
            for (int i = 0; i < 4; i++) {
                _mm256_store_si256((__m256i *)(out->q[i] + 32 * h), _mm256_and_si256(t[i], low));
                _mm256_store_si256((__m256i *)(out->q[4 + i] + 32 * h),
                                   _mm256_and_si256(_mm256_srli_epi16(t[i], 4), low));
            }
        } else {
            for (int half = 0; half < 2; half++) {
                transposed(col + 8 * h, codes + 16 * (size_t)half, t);
                for (int i = 0; i < 4; i++)
                    _mm256_store_si256((__m256i *)(out->q[4 * half + i] + 32 * h), _mm256_xor_si256(t[i], flip));
            }
        }
        _mm256_storeu_ps(out->a + 8 * h, _mm256_i32gather_ps((const float *)(first + b * bytes + scale_at(kind)), at[h],
                                                             1));
        if (kind != W_Q80)
            _mm256_storeu_ps(out->b + 8 * h, _mm256_i32gather_ps((const float *)(first + b * bytes + second_at(kind)),
                                                                 at[h], 1));
        if (wide) {
            const __m256 da = _mm256_loadu_ps(out->a + 8 * h), db = kind == W_Q6 ? _mm256_loadu_ps(out->b + 8 * h) : da;
            for (int i = 0; i < 32; i++)
                _mm256_storeu_ps(one->w[i] + 8 * h, weight_at(kind, _mm256_load_si256((const __m256i *)(out->q[i / 4]
                                                                                                       + 32 * h)),
                                                                i % 4, i >= 16 ? db : da));
        }
    }
}
#endif

// ---- the products ----
static inline int32_t codes4(const blkx *x, int k) {  // activations 4k..4k+3, one lane's worth
    int32_t v;
    memcpy(&v, x->qs + 4 * k, sizeof(v));
    return v;
}
// a task's columns: where they lie, and where the next task's lie (fetched into L2 a block's share at a time)
typedef struct {
    const char *col[COLS];  // column c's blocks (a lane past N reads the last column again: its outputs are not stored)
    const char *first, *next;
    int32_t at[COLS];       // col[c] - first
    size_t share;           // the bytes of one block of COLS columns
} task_cols;
static inline __attribute__((always_inline)) void fetch_next(const task_cols *t, int b) {
    for (size_t o = 0; o < t->share; o += 64) _mm_prefetch(t->next + (size_t)b * t->share + o, _MM_HINT_T1);
}

#if defined(__AVX512F__)
// R rows (blocks a, nb a row) times the task's 16 columns -> y (rows ldy apart), the first `keep` lanes: each block's
// codes decoded in registers (fused: a step's or a verify pass's few rows), or read where decode_block put them (c)
static inline __attribute__((always_inline)) void rows_times(const int R, const int kind, const int fused,
                                                             const int wide, const task_cols *t, const cols16 *c,
                                                             const apart16 *o, int nb, const blkx *a, float *y,
                                                             int ldy, __mmask16 keep) {
    __m512 acc[ROWS];
    const __m512i lanes = _mm512_loadu_si512(t->at);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    _Alignas(64) uint8_t held[8][64];  // fused: the block's codes, for each row's largest to take its four from
    for (int b = 0; b < nb; b++, c++, o++) {
        __m512i w[8];
        __m512 da, db;
        const uint8_t(*codes)[64] = fused ? held : c->q;
        if (fused) {
            fetch_next(t, b);
            decode_regs(kind, t->col, t->first, lanes, (size_t)b, w, &da, &db);
            for (int k = 0; k < 8; k++) _mm512_store_si512(held[k], w[k]);
        } else {
            for (int k = 0; k < 8; k++) w[k] = _mm512_load_si512(c->q[k]);
            da = _mm512_load_ps(c->a), db = _mm512_load_ps(c->b);
        }
        for (int r = 0; r < R; r++) {
            const blkx *x = a + (size_t)r * nb + b;
            __m512i lo = _mm512_set1_epi32(UNSIGNED(kind) ? 0 : x->off[0]);  // the two halves: two chains
            __m512i hi = _mm512_set1_epi32(UNSIGNED(kind) ? 0 : x->off[1]);
            for (int k = 0; k < 4; k++) {
                lo = _mm512_dpbusd_epi32(lo, w[k], _mm512_set1_epi32(codes4(x, k)));
                hi = _mm512_dpbusd_epi32(hi, w[4 + k], _mm512_set1_epi32(codes4(x, 4 + k)));
            }
            __m512 one;  // the weights the row's largest value meets: decoded (wide), else picked by a one-hot product
            if (wide) {
                one = _mm512_load_ps(o->w[x->oj]);
            } else {
                const __m512i code = _mm512_dpbusd_epi32(_mm512_set1_epi32(UNSIGNED(kind) ? 0 : -128),
                                                         _mm512_load_si512(codes[x->ok]), _mm512_set1_epi32(x->ocode));
                one = _mm512_mul_ps(kind == W_Q6 && x->ok >= 4 ? db : da, _mm512_cvtepi32_ps(code));
            }
            const __m512 dx = _mm512_set1_ps(x->d);
            if (kind == W_Q6) {
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(da, dx), _mm512_cvtepi32_ps(lo), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(db, dx), _mm512_cvtepi32_ps(hi), acc[r]);
            } else {
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(da, dx), _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), acc[r]);
            }
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x->e), one, acc[r]);
            if (UNSIGNED(kind)) acc[r] = _mm512_fmadd_ps(db, _mm512_set1_ps(x->s), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (size_t)r * ldy, keep, acc[r]);
}
#else
// the integer dot of 4 vectors of codes w and the activations' codes 4 k0..4 k0 + 15, plus `start`
static inline __attribute__((always_inline)) __m256i dot4(const int kind, const __m256i *w, const blkx *x, int k0,
                                                          int32_t start) {
#if VNNI
    __m256i s = _mm256_set1_epi32(UNSIGNED(kind) ? 0 : start);
    for (int k = 0; k < 4; k++) s = _mm256_dpbusd_avx_epi32(s, w[k], _mm256_set1_epi32(codes4(x, k0 + k)));
    return s;
#else
    const __m256i ones = _mm256_set1_epi16(1);
    (void)start;
    if (UNSIGNED(kind)) {  // 4 pairs of codes <= 31 times |x| <= 127 stay within int16 (8 * 31 * 127 = 31496)
        __m256i s = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(codes4(x, k0)));
        for (int k = 1; k < 4; k++)
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[k], _mm256_set1_epi32(codes4(x, k0 + k))));
        return _mm256_madd_epi16(s, ones);
    }
    __m256i s = _mm256_setzero_si256();  // |w| times x with w's sign: a pair stays within int16 (|w| <= 128)
    for (int k = 0; k < 4; k++) {
        const __m256i v = _mm256_set1_epi32(codes4(x, k0 + k));
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w[k]), _mm256_sign_epi8(v, w[k]));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(pairs, ones));
    }
    return s;
#endif
}
// the integer dot of the codes w and a row's one-hot activations of its largest (ocode: a 1 in one byte of each dword):
// its code (signed codes stored + 128 for vpdpbusd: the 128 taken back out)
static inline __attribute__((always_inline)) __m256i dot1(const int kind, const __m256i w, const blkx *x) {
#if VNNI
    return _mm256_dpbusd_avx_epi32(_mm256_set1_epi32(UNSIGNED(kind) ? 0 : -128), w, _mm256_set1_epi32(x->ocode));
#else
    const __m256i ones = _mm256_set1_epi16(1), v = _mm256_set1_epi32(x->ocode);
    if (UNSIGNED(kind)) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, v), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(v, w)), ones);
#endif
}
// R rows times 8 of the task's columns (half h) -> y, the first `keep` of them
static inline __attribute__((always_inline)) void rows_times(const int R, const int kind, const int wide,
                                                             const cols16 *c, const apart16 *o, int nb, const blkx *a,
                                                             float *y, int ldy, int h, int keep) {
    __m256 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, c++, o++) {
        __m256i w[8];
        for (int k = 0; k < 8; k++) w[k] = _mm256_load_si256((const __m256i *)(c->q[k] + 32 * h));
        const __m256 da = _mm256_loadu_ps(c->a + 8 * h), db = _mm256_loadu_ps(c->b + 8 * h);
        for (int r = 0; r < R; r++) {
            const blkx *x = a + (size_t)r * nb + b;
            const __m256i lo = dot4(kind, w, x, 0, x->off[0]), hi = dot4(kind, w + 4, x, 4, x->off[1]);
            const __m256 one = wide ? _mm256_load_ps(o->w[x->oj] + 8 * h)  // as the AVX-512 kernel's
                                    : _mm256_mul_ps(kind == W_Q6 && x->ok >= 4 ? db : da, _mm256_cvtepi32_ps(dot1(
                                          kind, _mm256_load_si256((const __m256i *)(c->q[x->ok] + 32 * h)), x)));
            const __m256 dx = _mm256_set1_ps(x->d);
            if (kind == W_Q6) {
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(da, dx), _mm256_cvtepi32_ps(lo), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(db, dx), _mm256_cvtepi32_ps(hi), acc[r]);
            } else {
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(da, dx), _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), acc[r]);
            }
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x->e), one, acc[r]);
            if (UNSIGNED(kind)) acc[r] = _mm256_fmadd_ps(db, _mm256_set1_ps(x->s), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float out[8];
        _mm256_storeu_ps(out, acc[r]);
        memcpy(y + (size_t)r * ldy, out, sizeof(float) * (size_t)keep);
    }
}
#endif

#define EACH_ROWS(R, CALL) switch (R) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
                                        ROWS_WIDE(CALL) }
#if ROWS == 8
#define ROWS_WIDE(CALL) case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; \
                        case 7: CALL(7); break; default: CALL(8);
#else
#define ROWS_WIDE(CALL) default: CALL(4);
#endif

// one task: columns n0..n0 + 15 (or to N) times every row: a few rows with each block decoded in registers, more
// with every block decoded once into the worker's buffer first
static inline __attribute__((always_inline)) void columns_task(const int kind, const q8a_job *j, int n0,
                                                               cols16 *buf, apart16 *apart) {
    const int nb = j->K / BLOCK, keep = j->N - n0 < COLS ? j->N - n0 : COLS;
    const size_t column = block_bytes(kind) * (size_t)nb;
    task_cols t;
    t.first = (const char *)j->w + (size_t)n0 * column, t.next = t.first + COLS * column;
    t.share = COLS * block_bytes(kind);
    for (int c = 0; c < COLS; c++) {
        t.at[c] = (int32_t)((c < keep ? c : keep - 1) * column);
        t.col[c] = t.first + t.at[c];
    }
#if defined(__AVX512F__)
    const int fused = j->M <= ROWS;
#else
    const int fused = 0;  // 16 registers: the codes come from the buffer
#endif
    const int wide = !fused && j->M >= WIDE;
    if (!fused) {
#if defined(__AVX512F__)
        const __m512i lanes = _mm512_loadu_si512(t.at);
#else
        __m256i lanes[2] = {_mm256_loadu_si256((const __m256i *)t.at), _mm256_loadu_si256((const __m256i *)(t.at + 8))};
#endif
        for (int b = 0; b < nb; b++) {
            fetch_next(&t, b);
            decode_block(kind, wide, t.col, t.first, lanes, (size_t)b, buf + b, apart + b);
        }
    }
    for (int m0 = 0; m0 < j->M; m0 += ROWS) {
        const int R = j->M - m0 < ROWS ? j->M - m0 : ROWS;
        const blkx *a = j->a + (size_t)m0 * nb;
        float *y = j->y + (size_t)m0 * j->ldy + n0;
#if defined(__AVX512F__)
        #define TIMES(r) if (fused) rows_times(r, kind, 1, 0, &t, buf, apart, nb, a, y, j->ldy, \
                                              (__mmask16)((1u << keep) - 1)); \
                         else rows_times(r, kind, 0, wide, &t, buf, apart, nb, a, y, j->ldy, \
                                         (__mmask16)((1u << keep) - 1))
        EACH_ROWS(R, TIMES)
        #undef TIMES
#else
        #define TIMES(r) rows_times(r, kind, wide, buf, apart, nb, a, y, j->ldy, 0, keep < 8 ? keep : 8); \
                         if (keep > 8) rows_times(r, kind, wide, buf, apart, nb, a, y + 8, j->ldy, 1, keep - 8)
        EACH_ROWS(R, TIMES)
        #undef TIMES
#endif
    }
}

static void q8a_task(void *ctx, int first, int last, int worker) {
    const q8a_job *j = ctx;
    cols16 *buf = (cols16 *)(j->columns + (size_t)worker * q8a_columns_bytes(j->K));
    apart16 *apart = (apart16 *)(buf + j->K / BLOCK);
    for (int task = first; task < last; task++) {
        if (j->kind == W_Q41) columns_task(W_Q41, j, task * COLS, buf, apart);
        else if (j->kind == W_Q80) columns_task(W_Q80, j, task * COLS, buf, apart);
        else if (j->kind == W_Q5) columns_task(W_Q5, j, task * COLS, buf, apart);
        else columns_task(W_Q6, j, task * COLS, buf, apart);
    }
}

static void reference_task(void *ctx, int first, int last, int worker) {
    const q8a_job *j = ctx;
    const int nb = j->K / BLOCK;
    const size_t column = block_bytes(j->kind) * (size_t)nb;
    (void)worker;
    for (int n = first * COLS; n < last * COLS && n < j->N; n++)
        for (int r = 0; r < j->M; r++)
            j->y[(size_t)r * j->ldy + n] = output_reference(j->kind, (const char *)j->w + (size_t)n * column,
                                                            j->a + (size_t)r * nb, nb);
}

void linear_q8a(int threads, int reference, int kind, const float *x, int M, int K, const void *w, float *y, int N,
                int ldy, void *columns, void *rounded) {
    q8a_job j = {reference, kind, M, K, N, ldy, x, rounded, w, y, columns};
    if (M >= 8) pool_run(threads, round_task, &j, M);  // a prompt's rows: rounding them is worth sharing
    else round_task(&j, 0, M, 0);
    pool_run(threads, reference ? reference_task : q8a_task, &j, (N + COLS - 1) / COLS);
}

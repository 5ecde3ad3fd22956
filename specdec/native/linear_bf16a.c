// The bf16 activations mode (specdec_forward's SPECDEC_ACT_BF16; specdec_matmul's kernel 5): each row's activations
// rounded to bf16 (to nearest, ties to even: VCVTNE2PS2BF16), then multiplied with rows of bf16 weights on AMX-BF16
// tiles (TDPBF16PS: 16 weight columns by 32 inputs times 32 inputs by 16 tokens), accumulated in fp32 over the whole
// row, no weight widened to fp32 first. The AVX-512 builds compile it for AMX alone, and it runs where the CPU has
// AMX-BF16 and AVX512-BF16 and Linux lets the process use the tiles (bf16a_ok); any other build or CPU refuses it.
//
// Why a row's result does not depend on the call: each output is one tile element, summed by the same instruction
// sequence over its row (a tile's tokens padded with zeros to 16, its columns to 32), whatever the other elements of
// its tile hold. So a decode step, a verify pass, a prompt chunk and a batch of rows, and every thread count, give an
// output the same bits. The tiles' order of summation within a step is not documented (it matched no sequential
// order emulated in numpy), so tests/native/test_bf16_activations.py checks that invariance and the error bound of
// fp32 accumulation, not the bits of an emulation. VDPBF16PS, tried first, lost to the fp32 kernels at many rows
// (docs/backends.md).
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "pool.h"

#define GROUP 16  // a tile's rows: 16 weight columns (A), or 16 pairs of K (B); B's and C's columns: 16 tokens

// a worker's buffer: a partial group's weight columns padded with zero columns, then a C tile stored (fp32)
size_t bf16a_worker_bytes(int K) {
    return ALIGNED(sizeof(uint16_t) * GROUP * (size_t)K) + sizeof(float) * GROUP * GROUP;
}
// the rounded activations, as B tiles: per group of 16 tokens (zeros past M) and step of 32 along K, one 1 KB tile
size_t bf16a_rounded_bytes(int M, int K) {
    return ALIGNED(sizeof(uint16_t) * (size_t)((M + GROUP - 1) / GROUP) * GROUP * (size_t)K);
}

#if defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// AMX-BF16 and AVX512-BF16 in CPUID leaf 7, and the kernel's leave to use the tiles (asked once per process)
static int bf16a_check(void) {
    unsigned a = 7, b = 0, c = 0, d = 0;
    __asm__ volatile("cpuid" : "+a"(a), "=b"(b), "+c"(c), "=d"(d));
    unsigned a1 = 7, b1 = 0, c1 = 1, d1 = 0;
    __asm__ volatile("cpuid" : "+a"(a1), "=b"(b1), "+c"(c1), "=d"(d1));
    const int amx = (d >> 22 & 1) && (d >> 24 & 1), avx512bf16 = a1 >> 5 & 1;
    return amx && avx512bf16 && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
int bf16a_ok(void) {
    static _Atomic int known = -1;
    if (known < 0) known = bf16a_check();
    return known;
}

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;
// tiles 0-3: C (16 weight columns by 16 tokens, fp32), C[2 a + b] of A a and B b; 4, 5: A (16 weight columns by 32
// of K, bf16); 6, 7: B (16 pairs of K by 16 tokens, a pair of bf16 each)
AMX static void configure(void) {
    tile_config cfg = {.palette = 1};
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = GROUP;
    _tile_loadconfig(&cfg);
}

// x [M, K] -> B tiles: tile (g, s) row k holds, for tokens m = 0..15 of group g, the pair x[16 g + m][32 s + 2 k],
// [32 s + 2 k + 1] as bf16 (nearest, ties to even); tokens past M are zeros
AMX static void round_rows(const float *x, int M, int K, uint32_t *out) {
    const int steps = K / 32, groups = (M + GROUP - 1) / GROUP;
    memset(out + (size_t)(M / GROUP) * steps * 256, 0, sizeof(uint32_t) * (size_t)(groups - M / GROUP) * steps * 256);
    const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(GROUP));
    for (int m = 0; m < M; m++) {
        uint32_t *row = out + (size_t)(m / GROUP) * steps * 256 + m % GROUP;
        for (int s = 0; s < steps; s++) {
            const float *xs = x + (size_t)m * K + 32 * s;
            const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xs + 16), _mm512_loadu_ps(xs));
            _mm512_i32scatter_epi32(row + (size_t)s * 256, lanes, pairs, 4);
        }
    }
}

typedef struct {
    int M, K, N, ldy;
    const uint32_t *x;  // B tiles
    const uint16_t *w;
    float *y;
    char *buffers;  // bf16a_worker_bytes(K) per worker
} bf16a_job;

// a C tile as stored (c[16 n + m]: weight column n0 + n, token m0 + m) into y, transposed: its valid tokens and columns
// only (a 16 x 16 transpose in registers: pairs, then quads, then 128-bit lanes twice)
static void put(const float *c, int m0, int M, int n0, int N, float *y, int ldy) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(c + 16 * i);
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88), t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88), r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    const __mmask16 valid = N - n0 >= GROUP ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    for (int m = 0; m < GROUP && m0 + m < M; m++) _mm512_mask_storeu_ps(y + (size_t)(m0 + m) * ldy + n0, valid, r[m]);
}

// weight columns 32 t..32 t + 31 of task t, by every group of 16 tokens: two A tiles and two B tiles a step along K
AMX static void bf16a_task(void *ctx, int first, int last, int worker) {
    const bf16a_job *j = ctx;
    const int K = j->K, steps = K / 32, groups = (j->M + GROUP - 1) / GROUP;
    char *buffer = j->buffers + (size_t)worker * bf16a_worker_bytes(K);
    uint16_t *padded = (uint16_t *)buffer;
    float *stored = (float *)(buffer + ALIGNED(sizeof(uint16_t) * GROUP * (size_t)K));
    const size_t stride = sizeof(uint16_t) * (size_t)K;
    configure();
    for (int t = first; t < last; t++) {
        const int n0 = 2 * GROUP * t;
        const uint16_t *a0 = j->w + (size_t)n0 * K, *a1 = a0 + (size_t)GROUP * K;
        const int two = n0 + GROUP < j->N;  // a second group of columns
        if (n0 + GROUP > j->N || (two && n0 + 2 * GROUP > j->N)) {  // a partial group: its columns, then zeros
            const int at = two ? n0 + GROUP : n0, have = j->N - at;
            memcpy(padded, j->w + (size_t)at * K, stride * have);
            memset(padded + (size_t)have * K, 0, stride * (GROUP - have));
            if (two) a1 = padded; else a0 = padded;
        }
        // the next task's weights (32 columns, contiguous) into L2 while this one runs, spread over its first steps:
        // the tiles read 64 bytes of each of 16 columns a step, which memory's prefetchers follow poorly
        const char *next = (const char *)(j->w + (size_t)(n0 + 2 * GROUP) * K);
        const size_t ahead = n0 + 4 * GROUP <= j->N ? 2 * GROUP * stride : 0, each = (ahead / steps + 63) & ~(size_t)63;
        for (int g = 0; g < groups; g += 2) {
            const int both = g + 1 < groups;
            const uint32_t *b0 = j->x + (size_t)g * steps * 256, *b1 = b0 + (size_t)steps * 256;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int s = 0; s < steps; s++) {
                if (g == 0)
                    for (size_t at = s * each; at < (s + 1) * each && at < ahead; at += 64)
                        _mm_prefetch(next + at, _MM_HINT_T1);
                _tile_loadd(4, a0 + 32 * s, stride);
                _tile_loadd(6, b0 + 256 * s, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (both) { _tile_loadd(7, b1 + 256 * s, 64); _tile_dpbf16ps(1, 4, 7); }
                if (two) {
                    _tile_loadd(5, a1 + 32 * s, stride);
                    _tile_dpbf16ps(2, 5, 6);
                    if (both) _tile_dpbf16ps(3, 5, 7);
                }
            }
            const int m0 = GROUP * g;
            _tile_stored(0, stored, 64); put(stored, m0, j->M, n0, j->N, j->y, j->ldy);
            if (both) { _tile_stored(1, stored, 64); put(stored, m0 + GROUP, j->M, n0, j->N, j->y, j->ldy); }
            if (two) {
                _tile_stored(2, stored, 64); put(stored, m0, j->M, n0 + GROUP, j->N, j->y, j->ldy);
                if (both) {
                    _tile_stored(3, stored, 64);
                    put(stored, m0 + GROUP, j->M, n0 + GROUP, j->N, j->y, j->ldy);
                }
            }
        }
    }
    _tile_release();
}

void linear_bf16a(int threads, const float *x, int M, int K, const void *w, float *y, int N, int ldy, void *buffers,
                  void *rounded) {
    round_rows(x, M, K, rounded);
    const bf16a_job j = {M, K, N, ldy, rounded, w, y, buffers};
    pool_run(threads, bf16a_task, (void *)&j, (N + 2 * GROUP - 1) / (2 * GROUP));
}
#else
int bf16a_ok(void) { return 0; }
void linear_bf16a(int threads, const float *x, int M, int K, const void *w, float *y, int N, int ldy, void *buffers,
                  void *rounded) {  // never called: linear_kind_ok refuses the kernel in this build
    (void)threads, (void)x, (void)M, (void)K, (void)w, (void)y, (void)N, (void)ldy, (void)buffers, (void)rounded;
}
#endif

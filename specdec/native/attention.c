// Causal GQA over static KV, flash-style, for B rows (each at its own position, over its own KV); with a window, a
// query sees only the `window` keys up to its own (a chunk below them contributes nothing and is skipped).
//
// Keys are taken in chunks of CHUNK at fixed positions (keys [c * CHUNK, (c + 1) * CHUNK)). A task takes one row, one
// KV head, the query vectors that read it (up to QROWS: positions of a tile times the heads sharing that KV head) and
// one chunk; it walks the chunk's keys in blocks of KEYS, each block read once for all its query vectors, keeping a
// running max, sum and output per vector. The chunks' parts are then merged in chunk order by their maxima.
// Everything a query vector's result goes through depends only on its position: not on how many tokens or rows
// the call has, which tile it falls in, or the thread count. So a verify pass gives each position the bits that
// one-token steps give it, and batched rows the bits they have alone.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "pool.h"

#define KEYS 64    /* keys per block: scores on the stack */
#define CHUNK 128  /* keys per task (a multiple of KEYS) */
#define QROWS 16   /* query vectors per task, at most */

// scores[j] = scale * q . k[j] for j < n (keys [n, D]), by one sum that every build computes alike (and whatever
// keys share a call with k[j]): 16 lane sums, lane l the fma chain over d = l, l + 16, ... (d < D), from +0; then
// t[l] = lane l + lane l + 8, and ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)) (the order of AVX2's hadd tree).
// AVX2 keeps each key's 16 lanes in two registers and takes 4 keys a step; AVX-512 one register, 8 keys a step.
// Keys past n in the last step are zeros (masked loads), their scores not stored.
static inline __m256 lanes_mask(int from, int D) {  // lanes of the 8 from d = from that lie below D
    const int left = D - from;
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
static inline __m256 load8(const float *p, int from, int D) {  // p[from..from + 7], zeros at d >= D
    return from + 8 <= D ? _mm256_loadu_ps(p + from) : _mm256_maskload_ps(p + from, _mm256_castps_si256(lanes_mask(from, D)));
}
#if defined(__AVX512F__)
// CHUNKS: D's chunks of 16 where a constant (its query in registers), else 0 (read from qv)
static inline __attribute__((always_inline)) void dots_of(const int CHUNKS, const float *qv, const float *k, int n,
                                                          int D, float scale, float *scores) {
    const int chunks = CHUNKS ? CHUNKS : (D + 15) / 16;
    const __mmask16 last = (__mmask16)(D % 16 ? (1u << (D % 16)) - 1 : 0xFFFF);
    __m512 q[8];
    for (int c = 0; c < CHUNKS; c++) q[c] = _mm512_maskz_loadu_ps(c + 1 < chunks ? 0xFFFF : last, qv + 16 * c);
    for (int j = 0; j < n; j += 8) {
        __m512 acc[8];
        for (int g = 0; g < 8; g++) {
            acc[g] = _mm512_setzero_ps();
            if (j + g >= n) continue;  // a zero key
            const float *kg = k + (size_t)(j + g) * D;
            for (int c = 0; c < chunks; c++) {
                const __mmask16 in = c + 1 < chunks ? 0xFFFF : last;
                acc[g] = _mm512_fmadd_ps(CHUNKS ? q[c] : _mm512_maskz_loadu_ps(in, qv + 16 * c),
                                         _mm512_maskz_loadu_ps(in, kg + 16 * c), acc[g]);
            }
        }
        __m512 t[4];  // t[g]: [lanes 0-7 + lanes 8-15 of key g | of key g + 4]
        for (int g = 0; g < 4; g++)
            t[g] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[g], acc[g + 4], 0x44),
                                 _mm512_shuffle_f32x4(acc[g], acc[g + 4], 0xEE));
        const __m512 h01 = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], 0x88), _mm512_shuffle_ps(t[0], t[1], 0xDD));
        const __m512 h23 = _mm512_add_ps(_mm512_shuffle_ps(t[2], t[3], 0x88), _mm512_shuffle_ps(t[2], t[3], 0xDD));
        const __m512 h = _mm512_add_ps(_mm512_shuffle_ps(h01, h23, 0x88), _mm512_shuffle_ps(h01, h23, 0xDD));
        const __m512 eight = _mm512_add_ps(_mm512_shuffle_f32x4(h, h, 0x08), _mm512_shuffle_f32x4(h, h, 0x0D));
        const __m256 out = _mm256_mul_ps(_mm512_castps512_ps256(eight), _mm256_set1_ps(scale));
        if (j + 8 <= n) _mm256_storeu_ps(scores + j, out);
        else _mm256_maskstore_ps(scores + j, _mm256_castps_si256(lanes_mask(j, n)), out);
    }
}
static void dots(const float *qv, const float *k, int n, int D, float scale, float *scores) {
    switch ((D + 15) / 16) {
    case 1: dots_of(1, qv, k, n, D, scale, scores); break;
    case 2: dots_of(2, qv, k, n, D, scale, scores); break;
    case 4: dots_of(4, qv, k, n, D, scale, scores); break;
    case 8: dots_of(8, qv, k, n, D, scale, scores); break;
    default: dots_of(0, qv, k, n, D, scale, scores);
    }
}
#else
static void dots(const float *qv, const float *k, int n, int D, float scale, float *scores) {
    for (int j = 0; j < n; j += 4) {
        __m256 t[4];
        for (int g = 0; g < 4; g++) {
            __m256 lo = _mm256_setzero_ps(), hi = lo;
            if (j + g < n) {
                const float *kg = k + (size_t)(j + g) * D;
                for (int d = 0; d < D; d += 16) {
                    lo = _mm256_fmadd_ps(load8(qv, d, D), load8(kg, d, D), lo);
                    if (d + 8 < D) hi = _mm256_fmadd_ps(load8(qv, d + 8, D), load8(kg, d + 8, D), hi);
                }
            }
            t[g] = _mm256_add_ps(lo, hi);
        }
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
        const __m128 four = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)),
                                       _mm_set1_ps(scale));
        if (j + 4 <= n) _mm_storeu_ps(scores + j, four);
        else _mm_maskstore_ps(scores + j, _mm256_castsi256_si128(_mm256_castps_si256(lanes_mask(j, n))), four);
    }
}
#endif
// o[D] = o * alpha + sum_j p[j] v[j] (values [n, D]): each output's chain, alpha * o then an fma per key in order,
// whatever register holds it
static void mix(float *o, float alpha, const float *p, const float *v, int n, int D) {
    int i0 = 0;
#if defined(__AVX512F__)
    for (; i0 + 64 <= D; i0 += 64) {  // 64 outputs at a time in registers
        const __m512 a = _mm512_set1_ps(alpha);
        __m512 acc[4];
        for (int c = 0; c < 4; c++) acc[c] = _mm512_mul_ps(a, _mm512_loadu_ps(o + i0 + 16 * c));
        for (int j = 0; j < n; j++) {
            const __m512 pj = _mm512_set1_ps(p[j]);
            const float *vj = v + (size_t)j * D + i0;
            for (int c = 0; c < 4; c++) acc[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 16 * c), acc[c]);
        }
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + i0 + 16 * c, acc[c]);
    }
#endif
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
        for (int j = 0; j < n; j++) acc = fmaf(p[j], v[(size_t)j * D + i0], acc);
        o[i0] = acc;
    }
}
// One task's query vectors: q of vector r is at q + ((t0 + r / group) * Hq + g * group + r % group) * D; vector r
// sits at position pos + r / group and sees keys below pos + r / group + 1.
typedef struct {
    const float *q;
    int t0, g, group, Hq, D, pos, window;
} queries;

static inline const float *query(const queries *s, int r) {
    return s->q + ((size_t)(s->t0 + r / s->group) * s->Hq + s->g * s->group + r % s->group) * s->D;
}

// the largest of from and x[0..n), NaN passed over (a NaN score leaves NaN in the sum, which the logits check
// reports); exact, so the order of the comparisons does not matter
static float largest(const float *x, int n, float from) {
    __m256 top = _mm256_set1_ps(from);
    int j = 0;
    for (; j + 8 <= n; j += 8) top = _mm256_max_ps(_mm256_loadu_ps(x + j), top);  // (NaN in x: top kept)
    __m128 t = _mm_max_ps(_mm256_extractf128_ps(top, 1), _mm256_castps256_ps128(top));
    t = _mm_max_ps(_mm_movehl_ps(t, t), t);
    float m = _mm_cvtss_f32(_mm_max_ss(_mm_movehdup_ps(t), t));
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

// `rows` query vectors over keys [j0, j1) of one KV head -> state [rows][D + 2]: the unnormalized output, then the
// running max and sum (sum 0: no key seen)
static void attend_keys(const queries *s, int rows, const float *k, const float *v, int j0, int j1, float scale,
                        float *state) {
    const int D = s->D;
    float scores[KEYS];
    for (int r = 0; r < rows; r++) {
        float *st = state + (size_t)r * (D + 2);
        memset(st, 0, sizeof(float) * D);
        st[D] = -INFINITY;
        st[D + 1] = 0.f;
    }
    for (int jb = j0; jb < j1; jb += KEYS) {
        for (int r = 0; r < rows; r++) {
            const int seen = s->pos + r / s->group + 1, stop = jb + KEYS < j1 ? jb + KEYS : j1;  // causal
            const int low = s->window ? seen - s->window : 0, from = jb > low ? jb : low;  // the window's first key
            const int n = (stop < seen ? stop : seen) - from;
            if (n <= 0) continue;
            float *st = state + (size_t)r * (D + 2);
            dots(query(s, r), k + (size_t)from * D, n, D, scale, scores);
            const float top = largest(scores, n, st[D]);
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
            for (; j < n; j++) {
                scores[j] = expf(scores[j] - top);
                total += scores[j];
            }
            mix(st, alpha, scores, v + (size_t)from * D, n, D);
            st[D] = top;
            st[D + 1] = st[D + 1] * alpha + total;
        }
    }
}

// ---- tasks: per row b, KV head g, tile of positions, chunk of keys ----
typedef struct {
    const attention_t *a;
    int per, rows, tiles;  // positions per tile, query vectors per task, tiles per row
    const int *first;      // [B + 1]: each row's first task
    float *state;          // [tasks][rows][D + 2]
} job_t;

static inline int chunks_of(const attention_t *a, int b) { return (a->pos[b] + a->T + CHUNK - 1) / CHUNK; }

static void attention_one(void *ctx, int task, int worker) {
    const job_t *j = ctx;
    const attention_t *a = j->a;
    int b = 0;
    while (j->first[b + 1] <= task) b++;
    const int chunks = chunks_of(a, b), local = task - j->first[b];
    const int g = local / (j->tiles * chunks), tile = local / chunks % j->tiles, chunk = local % chunks;
    const int group = a->Hq / a->Hkv, t0 = tile * j->per;
    const int count = (a->T - t0 < j->per ? a->T - t0 : j->per) * group;
    const int seen = a->pos[b] + t0 + count / group;  // keys the tile's last position sees
    const int j0 = chunk * CHUNK, j1 = j0 + CHUNK < seen ? j0 + CHUNK : seen;
    const queries s = {a->q + (size_t)b * a->T * a->Hq * a->D, t0, g, group, a->Hq, a->D, a->pos[b] + t0, a->window};
    const size_t head = (size_t)g * a->S * a->D;
    (void)worker;
    attend_keys(&s, count, a->keys[b] + head, a->values[b] + head, j0, j1 > j0 ? j1 : j0, a->scale,
                j->state + (size_t)task * j->rows * (a->D + 2));
}

static void attention_task(void *ctx, int first, int last, int worker) {
    for (int task = first; task < last; task++) attention_one(ctx, task, worker);
}

// each query vector's chunks merged in chunk order, normalized, into out
static void merge(const job_t *j, int b) {
    const attention_t *a = j->a;
    const int D = a->D, group = a->Hq / a->Hkv, chunks = chunks_of(a, b);
    for (int g = 0; g < a->Hkv; g++)
        for (int tile = 0; tile < j->tiles; tile++) {
            const int t0 = tile * j->per, count = (a->T - t0 < j->per ? a->T - t0 : j->per) * group;
            const float *parts = j->state + ((size_t)j->first[b] + (size_t)(g * j->tiles + tile) * chunks) * j->rows * (D + 2);
            for (int r = 0; r < count; r++) {
                float top = -INFINITY, total = 0.f;
                for (int c = 0; c < chunks; c++) {
                    const float m = parts[((size_t)c * j->rows + r) * (D + 2) + D];
                    top = m > top ? m : top;
                }
                float *o = a->out + (((size_t)b * a->T + t0 + r / group) * a->Hq + g * group + r % group) * D;
                memset(o, 0, sizeof(float) * D);
                for (int c = 0; c < chunks; c++) {
                    const float *st = parts + ((size_t)c * j->rows + r) * (D + 2);
                    if (st[D + 1] == 0.f) continue;  // a chunk with no key this vector sees
                    const float w = expf(st[D] - top);
                    total += w * st[D + 1];
                    for (int i = 0; i < D; i++) o[i] += w * st[i];
                }
                for (int i = 0; i < D; i++) o[i] /= total;
            }
        }
}

static void shape(int T, int Hq, int Hkv, int *per, int *rows, int *tiles) {
    const int group = Hq / Hkv;
    *per = group < QROWS ? QROWS / group : 1;
    *rows = *per * group;
    *tiles = (T + *per - 1) / *per;
}

size_t attention_scratch_bytes(int B, int T, int Hq, int Hkv, int D, int S) {
    int per, rows, tiles;
    shape(T, Hq, Hkv, &per, &rows, &tiles);
    const size_t tasks = (size_t)B * Hkv * tiles * ((S + CHUNK - 1) / CHUNK);  // pos + T <= S
    return ALIGNED(sizeof(int) * (size_t)(B + 1)) + ALIGNED(sizeof(float) * tasks * rows * (D + 2));
}

void attention(int threads, const attention_t *a, void *scratch) {
    job_t j = {.a = a};
    shape(a->T, a->Hq, a->Hkv, &j.per, &j.rows, &j.tiles);
    int *first = scratch;
    first[0] = 0;
    for (int b = 0; b < a->B; b++) first[b + 1] = first[b] + a->Hkv * j.tiles * chunks_of(a, b);
    j.first = first;
    j.state = (float *)((char *)scratch + ALIGNED(sizeof(int) * (size_t)(a->B + 1)));
    pool_run(threads, attention_task, &j, first[a->B]);
    for (int b = 0; b < a->B; b++) merge(&j, b);
}

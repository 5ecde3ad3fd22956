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
// One task's query vectors: q of vector r is at q + ((t0 + r / group) * Hq + g * group + r % group) * D; vector r
// sits at position pos + r / group and sees keys below pos + r / group + 1.
typedef struct {
    const float *q;
    int t0, g, group, Hq, D, pos, window;
} queries;

static inline const float *query(const queries *s, int r) {
    return s->q + ((size_t)(s->t0 + r / s->group) * s->Hq + s->g * s->group + r % s->group) * s->D;
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

// The native engine's exported functions (specdec_native.h): the forward pass of B rows, and the products and the
// attention alone for tests and benchmarks. Every export checks its arguments and returns a status code before it
// touches memory; scratch comes from the caller (sized by the *_scratch_bytes exports), so a forward allocates
// nothing.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "pool.h"


int specdec_abi_version(void) { return SPECDEC_ABI_VERSION; }

long specdec_layout_size(int which) {
    const long sizes[] = {sizeof(blkq), sizeof(blkqp), sizeof(model_t), sizeof(features_t), sizeof(head_t)};
    return which >= 0 && which < (int)(sizeof(sizes) / sizeof(sizes[0])) ? sizes[which] : -1;
}

int specdec_weight_kind(int kind, int32_t traits[5]) {
    if (!traits) return SPECDEC_E_NULL;
    if (!kind_known(kind)) return SPECDEC_E_SHAPE;
    const int32_t row[5] = {(int32_t)KINDS[kind].bytes, KINDS[kind].per, KINDS[kind].kernels, KINDS[kind].isas,
                            THIS_ISA};
    memcpy(traits, row, sizeof(row));
    return SPECDEC_OK;
}

enum { L_QKV = 0, L_O = 1, L_GATE_UP = 2, L_DOWN = 3, L_V = 4 };  // a layer's linears, in model_t.kinds' order

// a kind the fp32 kernels run in this build, both a step's and a prompt's (a target's linears)
static int fp32_kind(int kind) { return linear_kind_ok(K_STEP, kind) && linear_kind_ok(K_PROMPT, kind); }
// a kind a SPECDEC_MIXED layer or head may hold: a GGUF grid's, one block of BLOCK weights an element
static int block_kind(int kind) { return fp32_kind(kind) && KINDS[kind].per == BLOCK; }
static int gguf_blocks(int model_kind) { return !rows_kind(MODELS[model_kind].linear); }  // else rows of a checkpoint's
// whether a model_t.kind's kernels are all in this build: its linears' fp32 ones, its head's step, a draft's int8 ones
static int model_kernels(const model_t *m, int quant) {
    const model_traits t = MODELS[m->kind];
    if (quant) return linear_kind_ok(K_INT8, W_Q41P) && linear_kind_ok(K_INT8, W_Q80);
    if (t.linear == SPECDEC_W_EACH) return block_kind(m->head_kind);  // and each layer's (check_layers)
    return fp32_kind(t.linear) && linear_kind_ok(K_STEP, t.head);
}

static int check_layers(const model_t *m, int quant) {
    if (!m->in_norm || !m->post_norm || !m->final_norm || !m->head) return SPECDEC_E_NULL;
    if (!m->cos != !m->sin || !m->cos == !m->position_table) return SPECDEC_E_NULL;  // rotary tables or learned ones
    if (!m->embedding && !m->embedding_rows) return SPECDEC_E_NULL;
    if (!m->q_norm != !m->k_norm) return SPECDEC_E_NULL;  // both or neither
    if (!m->in_norm_bias != !m->post_norm_bias || !m->in_norm_bias != !m->final_norm_bias) return SPECDEC_E_NULL;
    const void *const *tables[4] = {(const void *const *)m->qkv, (const void *const *)m->o,
                                    (const void *const *)m->gate_up, (const void *const *)m->down};
    if (quant) {
        tables[0] = (const void *const *)m->qkv_p, tables[1] = (const void *const *)m->o_p;
        tables[2] = (const void *const *)m->gate_up_p, tables[3] = (const void *const *)m->down_p;
    }
    for (int t = 0; t < 4; t++)
        if (!tables[t]) return SPECDEC_E_NULL;
    if (MODELS[m->kind].linear == SPECDEC_W_EACH && !quant) {
        if (!m->kinds) return SPECDEC_E_NULL;
        for (int l = 0; l < m->L; l++)
            for (int t = 0; t < 5; t++) {
                const int kind = m->kinds[5 * l + t];
                if (t == L_V && !(m->qkv_v && m->qkv_v[l])) continue;  // no v rows of their own in this layer
                if (!block_kind(kind)) return SPECDEC_E_SHAPE;
            }
    }
    const float *const *biases[6] = {m->qkv_bias, m->o_bias, m->gate_up_bias, m->down_bias, m->in_norm_bias,
                                     m->post_norm_bias};
    for (int l = 0; l < m->L; l++) {
        if (!m->in_norm[l] || !m->post_norm[l]) return SPECDEC_E_NULL;
        for (int t = 0; t < 6; t++)
            if (biases[t] && !biases[t][l]) return SPECDEC_E_NULL;
        if (m->q_norm && (!m->q_norm[l] || !m->k_norm[l])) return SPECDEC_E_NULL;
        for (int t = 0; t < 4; t++)
            if (!tables[t][l]) return SPECDEC_E_NULL;
    }
    return SPECDEC_OK;
}

static int check_model(const model_t *m, int quant) {
    if (!m) return SPECDEC_E_NULL;
    if (out_of(m->L, 1, 4096) || layer_dims_bad(m->H, m->Hq, m->Hkv, m->D, m->I) || out_of(m->V, 1, 1L << 24) ||
        out_of(m->vocab, 1, 1L << 24) || out_of(m->positions, 1, 1L << 24) ||
        out_of(m->kind, 0, SPECDEC_MODEL_COUNT - 1) || !model_kernels(m, quant) ||
        (!gguf_blocks(m->kind) && !m->embedding) ||
        out_of(m->mlp, SPECDEC_MLP_SILU_GATED, SPECDEC_MLP_GELU) ||
        !(m->eps >= 0.f) || !isfinite(m->scale) || m->window < 0)
        return SPECDEC_E_SHAPE;
    return check_layers(m, quant);
}

// ---- scratch ----
typedef struct { size_t x, xn, tmp, q, att, gu, act, rounded, decoded, attn, ptrs, end; } layout_t;

static int widest_input(const model_t *m) {
    int k = m->H;
    if (m->Hq * m->D > k) k = m->Hq * m->D;
    return m->I > k ? m->I : k;
}

static layout_t layout_of(const model_t *m, int B, int T, int S, int threads) {
    const size_t M = (size_t)B * T, f = sizeof(float), qkv = (size_t)(m->Hq + 2 * m->Hkv) * m->D;
    size_t wide = (size_t)m->H, at = 0;
    if (qkv > wide) wide = qkv;
    if ((size_t)m->Hq * m->D > wide) wide = (size_t)m->Hq * m->D;
    if ((size_t)m->I > wide) wide = (size_t)m->I;
    const size_t sizes[] = {
        f * M * m->H, f * M * m->H, f * M * wide, f * M * m->Hq * m->D, f * M * m->Hq * m->D, f * M * 2 * m->I,
        f * M * m->I, linear_rounded_bytes((int)M, widest_input(m)),
        f * (size_t)threads * linear_decoded_floats(widest_input(m)),
        attention_scratch_bytes(B, T, m->Hq, m->Hkv, m->D, S), 2 * sizeof(float *) * (size_t)B};
    size_t offsets[sizeof(sizes) / sizeof(sizes[0]) + 1];
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        offsets[i] = at;
        at += ALIGNED(sizes[i]);
    }
    const layout_t l = {offsets[0], offsets[1], offsets[2], offsets[3], offsets[4], offsets[5], offsets[6],
                        offsets[7], offsets[8], offsets[9], offsets[10], at + 64};  // + 64: the caller's buffer may start anywhere
    return l;
}

static int check_call(const model_t *m, int B, int T, int S, int threads) {
    const int status = rows_bad(B, T, S, threads);
    if (status) return status;
    return check_model(m, 0) == SPECDEC_E_SHAPE ? SPECDEC_E_SHAPE : SPECDEC_OK;
}

long specdec_scratch_bytes(const model_t *m, int B, int T, int S, int threads) {
    if (!m || check_call(m, B, T, S, threads)) return -1;
    return (long)layout_of(m, B, T, S, threads).end;
}

// ---- the forward pass ----
// 1 / sqrt(mean + eps) of a norm's mean square, or NaN where the sum of squares overflowed: 1 / sqrt(inf) is 0,
// which would turn the row to zeros and the logits to one silent token; NaN reaches the logits' check instead
static float norm_scale(float sum, int H, float eps) { return isinf(sum) ? NAN : 1.f / sqrtf(sum / H + eps); }

// The sum of x[i] (square 0), or of (x[i] - mean)^2 (square 1), in one order that depends on H alone (so every row,
// call and build sums alike): four chains of 8 lanes, the i-th 8 values into chain i % 4 while 32 remain, then
// chain 0; (c0 + c1) + (c2 + c3) summed across lanes as hsum does; then the last H % 8, one at a time.
static float row_sum(const float *x, float mean, int square, int H) {
    const __m256 mu = _mm256_set1_ps(mean);
    __m256 c[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int i = 0;
    for (; i + 32 <= H; i += 32)
        for (int k = 0; k < 4; k++) {
            const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i + 8 * k), mu);
            c[k] = square ? _mm256_fmadd_ps(d, d, c[k]) : _mm256_add_ps(c[k], d);
        }
    for (; i + 8 <= H; i += 8) {
        const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), mu);
        c[0] = square ? _mm256_fmadd_ps(d, d, c[0]) : _mm256_add_ps(c[0], d);
    }
    float s = hsum(_mm256_add_ps(_mm256_add_ps(c[0], c[1]), _mm256_add_ps(c[2], c[3])));
    for (; i < H; i++) s = square ? fmaf(x[i] - mean, x[i] - mean, s) : s + (x[i] - mean);
    return s;
}

void row_rmsnorm(const float *x, const float *gamma, float eps, int H, float *out) {
    const float r = norm_scale(row_sum(x, 0.f, 1, H), H, eps);
    for (int i = 0; i < H; i++) out[i] = x[i] * r * gamma[i];
}

static void layernorm(const float *x, const float *gamma, const float *beta, float eps, int H, float *out) {
    const float mean = row_sum(x, 0.f, 0, H) / H;
    const float r = norm_scale(row_sum(x, mean, 1, H), H, eps);
    for (int i = 0; i < H; i++) out[i] = (x[i] - mean) * r * gamma[i] + beta[i];
}

// the model's norm of one row: LayerNorm where it has a bias (beta), else RMSNorm
static void norm(const model_t *m, const float *x, const float *gamma, const float *beta, float *out) {
    if (beta) layernorm(x, gamma, beta, m->eps, m->H, out);
    else row_rmsnorm(x, gamma, m->eps, m->H, out);
}

static void add_bias(float *y, int M, int N, const float *bias) {  // y [M, N] += bias [N], where there is one
    if (!bias) return;
    for (int r = 0; r < M; r++)
        for (int i = 0; i < N; i++) y[(size_t)r * N + i] += bias[i];
}

void row_rotate(const float *x, const float *cs, const float *sn, int D, float *out) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        out[i] = x1 * cs[i] - x2 * sn[i];
        out[i + half] = x2 * cs[i] + x1 * sn[i];
    }
}

void row_silu_times(const float *g, const float *u, int I, float *y) {  // SiLU(gate) * up
    int i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 gi = _mm256_loadu_ps(g + i), ex = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gi));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(gi, _mm256_add_ps(_mm256_set1_ps(1.f), ex)),
                                              _mm256_loadu_ps(u + i)));
    }
    for (; i < I; i++) y[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

// GELU(u) = u / 2 * (1 + tanh(sqrt(2 / pi) * (u + 0.044715 u^3))) (tanh: onnxruntime's FastGelu), or
// u / 2 * (1 + erf(u / sqrt(2))); tanh(z) = 1 - 2 / (e^(2z) + 1)
static void gelu(int mlp, const float *u, int I, float *y) {
    int i = 0;
    if (mlp == SPECDEC_MLP_GELU_TANH)
        for (; i + 8 <= I; i += 8) {
            const __m256 x = _mm256_loadu_ps(u + i), one = _mm256_set1_ps(1.f);
            const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                           _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x),
                                                           _mm256_mul_ps(x, x), x));
            const __m256 e = exp256(_mm256_add_ps(z, z));
            const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, t)));
        }
    for (; i < I; i++)
        y[i] = mlp == SPECDEC_MLP_GELU_TANH
                   ? 0.5f * u[i] * (1.f + tanhf(0.7978845608028654f * (u[i] + 0.044715f * u[i] * u[i] * u[i])))
                   : 0.5f * u[i] * (1.f + erff(u[i] * 0.70710678118654752f));
}

typedef struct {
    const model_t *m;
    char *base;  // the scratch, aligned
    layout_t at;
    int B, T, S, threads, kernel, quant;
    int fp32;  // the kernel of weights int8 activations do not take (SPECDEC_ACT_INT8): a prompt's or the step's
    const int32_t *pos;
    float *const *keys, *const *values;
    long stride;
} pass_t;

#define BUF(p, field) ((float *)((p)->base + (p)->at.field))
#define WEIGHT(p, name, l) ((p)->quant ? (const void *)(p)->m->name##_p[l] : (const void *)(p)->m->name[l])

static int weights_kind(const pass_t *p, int l, int which) {  // of layer l's linear `which`
    const int kind = MODELS[p->m->kind].linear;
    if (p->quant) return W_Q41P;
    return kind == SPECDEC_W_EACH ? p->m->kinds[5 * l + which] : kind;
}

// The kernel of a product with weights of `kind`: SPECDEC_ACT_INT8 rounds the activations of every product whose
// weights the int8 kernel takes (linear_kind_ok(K_Q8A, ...): blk4, blk8, blk5, blk6), the four linears and the head
// alike; any other kind (rows) keeps the pass's fp32 kernel, `fp32` (a prompt's, or the step's for the head).
static int kernel_for(const pass_t *p, int kind, int fp32) {
    if (p->kernel == K_Q8A) return linear_kind_ok(K_Q8A, kind) ? K_Q8A : fp32;
    if (p->kernel == K_BF16A) return linear_kind_ok(K_BF16A, kind) ? K_BF16A : fp32;
    return p->kernel;
}

static void dense(const pass_t *p, int l, int which, const float *x, int K, const void *w, float *y, int N) {
    const int v_rows = p->m->Hkv * p->m->D, kind = weights_kind(p, l, which);
    if (which == L_QKV && !p->quant && MODELS[p->m->kind].linear == SPECDEC_W_EACH && p->m->qkv_v && p->m->qkv_v[l]) {
        // q/k rows and v rows in blocks of their own kinds: two products into one [rows, N] buffer
        const int v_kind = p->m->kinds[5 * l + L_V];
        linear(p->threads, kernel_for(p, kind, p->fp32), kind, x, p->B * p->T, K, w, y, N - v_rows, N,
               BUF(p, decoded), p->base + p->at.rounded);
        linear(p->threads, kernel_for(p, v_kind, p->fp32), v_kind, x, p->B * p->T, K, p->m->qkv_v[l], y + N - v_rows,
               v_rows, N, BUF(p, decoded), p->base + p->at.rounded);
        return;
    }
    linear(p->threads, kernel_for(p, kind, p->fp32), kind, x, p->B * p->T, K, w, y, N, N, BUF(p, decoded),
           p->base + p->at.rounded);
}

// row r's q/k/v (q/k heads normalized in place where the model has q/k norms) rotated: q into the q buffer, k and v
// into its KV of layer l at its position
static void place_row(const pass_t *p, int l, float *qkv, size_t row) {
    const model_t *m = p->m;
    const int D = m->D, Hq = m->Hq, Hkv = m->Hkv, QKV = (Hq + 2 * Hkv) * D, half = D / 2;
    const int b = (int)(row / (size_t)p->T), t = (int)(row % (size_t)p->T);
    float *k = p->keys[b] + (size_t)l * p->stride, *v = p->values[b] + (size_t)l * p->stride;
    const int at = p->pos[b] + t;
    float *in = qkv + row * QKV;
    if (!m->cos) {  // learned positions: nothing to rotate
        for (int h = 0; h < Hq; h++) memcpy(BUF(p, q) + (row * Hq + h) * D, in + h * D, sizeof(float) * D);
        for (int h = 0; h < Hkv; h++) {
            memcpy(k + ((size_t)h * p->S + at) * D, in + (Hq + h) * D, sizeof(float) * D);
            memcpy(v + ((size_t)h * p->S + at) * D, in + (Hq + Hkv + h) * D, sizeof(float) * D);
        }
        return;
    }
    const float *cs = m->cos + (size_t)at * half, *sn = m->sin + (size_t)at * half;
    if (m->q_norm)  // each head of q and k normalized in place, before rotary (Qwen3)
        for (int h = 0; h < Hq + Hkv; h++)
            row_rmsnorm(in + h * D, h < Hq ? m->q_norm[l] : m->k_norm[l], m->eps, D, in + h * D);
    for (int h = 0; h < Hq; h++) row_rotate(in + h * D, cs, sn, D, BUF(p, q) + (row * Hq + h) * D);
    for (int h = 0; h < Hkv; h++) {
        row_rotate(in + (Hq + h) * D, cs, sn, D, k + ((size_t)h * p->S + at) * D);
        memcpy(v + ((size_t)h * p->S + at) * D, in + (Hq + Hkv + h) * D, sizeof(float) * D);
    }
}

// ---- a layer's work on each row apart (norms, rotary, residuals, the MLP's nonlinearity): a prompt's many rows
// shared by the threads, a step's few done by the caller. Each row's arithmetic is the same either way. ----
#define SHARED_ROWS 16
enum { ROW_IN_NORM, ROW_QKV, ROW_POST_NORM, ROW_MLP, ROW_OUT };
typedef struct {
    const pass_t *p;
    int l, op;
    float *qkv;  // ROW_QKV's q/k/v
} row_job;

static void row_task(void *ctx, int first, int last, int worker) {
    const row_job *j = ctx;
    const pass_t *p = j->p;
    const model_t *m = p->m;
    const int l = j->l, H = m->H, I = m->I, up = m->mlp == SPECDEC_MLP_SILU_GATED ? 2 * I : I;
    float *x = BUF(p, x), *xn = BUF(p, xn), *tmp = BUF(p, tmp), *gu = BUF(p, gu), *act = BUF(p, act);
    (void)worker;
    for (size_t r = (size_t)first; r < (size_t)last; r++) {
        float *xr = x + r * H;
        switch (j->op) {
        case ROW_IN_NORM:
            norm(m, xr, m->in_norm[l], m->in_norm_bias ? m->in_norm_bias[l] : NULL, xn + r * H);
            break;
        case ROW_QKV:
            place_row(p, l, j->qkv, r);
            break;
        case ROW_POST_NORM:  // the attention's output added, then the second norm
            for (int i = 0; i < H; i++) xr[i] += tmp[r * H + i];
            norm(m, xr, m->post_norm[l], m->post_norm_bias ? m->post_norm_bias[l] : NULL, xn + r * H);
            break;
        case ROW_MLP:
            if (m->mlp == SPECDEC_MLP_SILU_GATED) row_silu_times(gu + r * up, gu + r * up + I, I, act + r * I);
            else gelu(m->mlp, gu + r * up, I, act + r * I);
            break;
        default:  // ROW_OUT: the MLP's output added
            for (int i = 0; i < H; i++) xr[i] += tmp[r * H + i];
        }
    }
}

static void each_row(const pass_t *p, int l, int op, float *qkv) {
    row_job j = {p, l, op, qkv};
    const int M = p->B * p->T;
    if (M >= SHARED_ROWS && p->threads > 1) pool_run(p->threads, row_task, &j, M);
    else row_task(&j, 0, M, 0);
}

static void layer(const pass_t *p, int l) {
    const model_t *m = p->m;
    const int H = m->H, I = m->I, M = p->B * p->T, QD = m->Hq * m->D;
    float *tmp = BUF(p, tmp), *gu = BUF(p, gu);
    each_row(p, l, ROW_IN_NORM, NULL);
    const int QKV = (m->Hq + 2 * m->Hkv) * m->D;
    dense(p, l, L_QKV, BUF(p, xn), H, WEIGHT(p, qkv, l), tmp, QKV);
    add_bias(tmp, M, QKV, m->qkv_bias ? m->qkv_bias[l] : NULL);
    each_row(p, l, ROW_QKV, tmp);
    const float **rows = (const float **)(p->base + p->at.ptrs);  // each row's keys, then values, of layer l
    for (int b = 0; b < p->B; b++) {
        rows[b] = p->keys[b] + (size_t)l * p->stride;
        rows[p->B + b] = p->values[b] + (size_t)l * p->stride;
    }
    const attention_t a = {p->B, p->T, m->Hq, m->Hkv, m->D, p->S, m->window, m->scale, p->pos, BUF(p, q), rows,
                           rows + p->B, BUF(p, att)};
    attention(p->threads, &a, p->base + p->at.attn);
    dense(p, l, L_O, BUF(p, att), QD, WEIGHT(p, o, l), tmp, H);
    add_bias(tmp, M, H, m->o_bias ? m->o_bias[l] : NULL);
    each_row(p, l, ROW_POST_NORM, NULL);
    const int up = m->mlp == SPECDEC_MLP_SILU_GATED ? 2 * I : I;  // gate and up rows, or up rows alone
    dense(p, l, L_GATE_UP, BUF(p, xn), H, WEIGHT(p, gate_up, l), gu, up);
    add_bias(gu, M, up, m->gate_up_bias ? m->gate_up_bias[l] : NULL);
    each_row(p, l, ROW_MLP, NULL);
    dense(p, l, L_DOWN, BUF(p, act), I, WEIGHT(p, down, l), tmp, H);
    add_bias(tmp, M, H, m->down_bias ? m->down_bias[l] : NULL);
    each_row(p, l, ROW_OUT, NULL);
}

static int head_kind(const model_t *m) {  // a target's (a draft's is blk8 rows: W_Q80)
    return MODELS[m->kind].head == SPECDEC_W_EACH ? m->head_kind : MODELS[m->kind].head;
}

// the embedding's rows of every token into x
static void embed(const pass_t *p, const int64_t *tokens) {
    const model_t *m = p->m;
    const int H = m->H;
    for (size_t r = 0; r < (size_t)p->B * p->T; r++) {
        float *x = BUF(p, x) + r * H;
        const int rows = MODELS[m->kind].linear, head = head_kind(m);  // rows: a checkpoint's own precision
        if (!gguf_blocks(m->kind))
            linear_decode(rows, (const char *)m->embedding + (size_t)tokens[r] * kind_column_bytes(rows, H), H, x);
        else if (m->embedding) memcpy(x, (const float *)m->embedding + (size_t)tokens[r] * H, sizeof(float) * H);
        else  // the head's row of the token
            linear_decode(head, (const char *)m->embedding_rows + (size_t)tokens[r] * kind_column_bytes(head, H), H, x);
        if (m->position_table) {  // learned positions: the row of the token's position
            const float *at = m->position_table + (size_t)(p->pos[r / p->T] + (int)(r % p->T)) * H;
            for (int i = 0; i < H; i++) x[i] += at[i];
        }
    }
}

// the final norm of the rows the head scores (each row's last with last_only), then the head's V columns
static void score(const pass_t *p, int last_only, float *logits) {
    const model_t *m = p->m;
    const int H = m->H, rows = last_only ? p->B : p->B * p->T;
    for (int r = 0; r < rows; r++) {
        const size_t from = last_only ? (size_t)r * p->T + p->T - 1 : (size_t)r;
        norm(m, BUF(p, x) + from * H, m->final_norm, m->final_norm_bias, BUF(p, xn) + (size_t)r * H);
    }
    const int kind = p->quant ? W_Q80 : head_kind(m);  // a draft's: blk8
    const int kernel = p->quant ? K_INT8 : kernel_for(p, kind, K_STEP);
    linear(p->threads, kernel, kind, BUF(p, xn), rows, H, m->head, logits, m->V, m->V, BUF(p, decoded),
           p->base + p->at.rounded);
}

// Whether every row of logits [rows, V] is sound: no NaN in it, and its largest logit finite (+inf, or a row all -inf,
// leaves no distribution to take a token from; a -inf logit alone is a token of probability 0). Every logit is read:
// one head row of a damaged block can make one logit NaN or inf and leave the rest finite, so the argmax alone would
// not do. Four chains keep the max's latency off the loop: a read of values the head has just written, a small part
// of a step.
int logits_sound(const float *logits, int rows, int V) {
    for (int r = 0; r < rows; r++) {
        const float *x = logits + (size_t)r * V;
        __m256 top[4], nan = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) top[k] = _mm256_set1_ps(-INFINITY);
        int i = 0;
        for (; i + 32 <= V; i += 32)  // four vectors of 8
            for (int k = 0; k < 4; k++) {
                const __m256 v = _mm256_loadu_ps(x + i + 8 * k);
                top[k] = _mm256_max_ps(top[k], v);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            }
        float most[8], m = -INFINITY;
        _mm256_storeu_ps(most, _mm256_max_ps(_mm256_max_ps(top[0], top[1]), _mm256_max_ps(top[2], top[3])));
        int bad = _mm256_movemask_ps(nan);
        for (int k = 0; k < 8; k++) m = most[k] > m ? most[k] : m;
        for (; i < V; i++) {
            bad |= x[i] != x[i];
            m = x[i] > m ? x[i] : m;
        }
        if (bad || !isfinite(m)) return 0;
    }
    return 1;
}

static int check_rows(const model_t *m, const int64_t *tokens, int B, int T, const int32_t *pos,
                      float *const *keys, float *const *values, long stride, int S) {
    if (stride < (long)m->Hkv * S * m->D) return SPECDEC_E_SHAPE;  // layers of one row must not overlap
    for (int b = 0; b < B; b++) {
        if (!keys[b] || !values[b]) return SPECDEC_E_NULL;
        if (pos[b] < 0 || pos[b] > S - T || pos[b] > m->positions - T) return SPECDEC_E_POSITION;
    }
    for (size_t i = 0; i < (size_t)B * T; i++)
        if (tokens[i] < 0 || tokens[i] >= m->vocab) return SPECDEC_E_TOKEN;
    return SPECDEC_OK;
}

static int check_features(const model_t *m, const features_t *f) {
    if (!f) return SPECDEC_OK;
    if (!f->layers || !f->out) return SPECDEC_E_NULL;
    if (out_of(f->n, 1, SPECDEC_MAX_FEATURES)) return SPECDEC_E_SHAPE;
    for (int i = 0; i < f->n; i++)
        if (out_of(f->layers[i], 0, m->L - 1)) return SPECDEC_E_SHAPE;
    return SPECDEC_OK;
}

// every fed row's hidden state after layer l into each of the features that name l
static void keep_features(const pass_t *p, const features_t *f, int l) {
    const size_t H = (size_t)p->m->H, rows = (size_t)p->B * p->T;
    for (int i = 0; f && i < f->n; i++) {
        if (f->layers[i] != l) continue;
        for (size_t r = 0; r < rows; r++)
            memcpy(f->out + (r * f->n + i) * H, BUF(p, x) + r * H, sizeof(float) * H);
    }
}

int specdec_forward(const model_t *m, void *scratch, size_t scratch_bytes, const int64_t *tokens, int B, int T,
                    const int32_t *pos, float *const *keys, float *const *values, long layer_stride, int S,
                    int last_only, int quant, int threads, float *logits, const features_t *features) {
    if (out_of(quant, SPECDEC_ACT_F32, SPECDEC_ACT_BF16) || (quant == SPECDEC_ACT_BF16 && !bf16a_ok()))
        return SPECDEC_E_SHAPE;
    int status = check_model(m, quant == SPECDEC_ACT_DRAFT);
    if (status) return status;
    if (!scratch || !tokens || !pos || !keys || !values || !logits) return SPECDEC_E_NULL;
    if ((status = check_call(m, B, T, S, threads))) return status;
    if ((status = check_features(m, features))) return status;
    if ((status = check_rows(m, tokens, B, T, pos, keys, values, layer_stride, S))) return status;
    const layout_t at = layout_of(m, B, T, S, threads);
    if (scratch_bytes < at.end) return SPECDEC_E_SCRATCH;
    const int fp32 = last_only && T > 1 ? K_PROMPT : K_STEP;  // a prompt's rows: its own kernel
    const int kernel = quant == SPECDEC_ACT_DRAFT ? K_INT8 : quant == SPECDEC_ACT_INT8 ? K_Q8A
                     : quant == SPECDEC_ACT_BF16 ? K_BF16A : fp32;
    const pass_t p = {m, (char *)ALIGNED((uintptr_t)scratch), at, B, T, S, threads, kernel,
                      quant == SPECDEC_ACT_DRAFT, fp32, pos, keys, values, layer_stride};
    embed(&p, tokens);
    for (int l = 0; l < m->L; l++) {
        layer(&p, l);
        keep_features(&p, features, l);
    }
    score(&p, last_only, logits);
    return logits_sound(logits, last_only ? B : B * T, m->V) ? SPECDEC_OK : SPECDEC_E_NONFINITE;
}

// ---- the products and the attention alone ----
long specdec_matmul_scratch_bytes(int M, int K, int kernel, int threads) {
    if (out_of(M, 1, MAX_ROWS) || out_of(K, BLOCK, MAX_DIM) || K % BLOCK || out_of(threads, 1, SPECDEC_MAX_THREADS))
        return -1;
    if (kernel == K_PROMPT) return (long)(sizeof(float) * threads * linear_decoded_floats(K) + 64);
    if (kernel == K_Q8A || kernel == K_Q8A_REF)  // each worker's decoded columns, then the rounded activations
        return (long)((size_t)threads * q8a_columns_bytes(K) + q8a_rounded_bytes(M, K) + 64);
    if (kernel == K_BF16A)  // each worker's buffer, then the rounded activations
        return (long)((size_t)threads * bf16a_worker_bytes(K) + bf16a_rounded_bytes(M, K) + 64);
    return kernel == K_INT8 ? (long)(linear_rounded_bytes(M, K) + 64) : 64;
}

int specdec_matmul(const float *x, int M, int K, const void *w, int wblocks, int kind, int kernel, float *y, int N,
                   void *scratch, size_t scratch_bytes, int threads) {
    if (!x || !w || !y || !scratch) return SPECDEC_E_NULL;
    if (out_of(threads, 1, SPECDEC_MAX_THREADS)) return SPECDEC_E_THREADS;
    const int kinds = linear_kind_ok(kernel, kind);
    const long need = specdec_matmul_scratch_bytes(M, K, kernel, threads);
    if (!kinds || need < 0 || out_of(N, 1, MAX_DIM) || wblocks != kind_elements(kind, K))
        return SPECDEC_E_SHAPE;
    if (scratch_bytes < (size_t)need) return SPECDEC_E_SCRATCH;
    char *base = (char *)ALIGNED((uintptr_t)scratch);
    const size_t columns = kernel == K_Q8A || kernel == K_Q8A_REF ? (size_t)threads * q8a_columns_bytes(K)
                         : kernel == K_BF16A ? (size_t)threads * bf16a_worker_bytes(K) : 0;
    linear(threads, kernel, kind, x, M, K, w, y, N, N, (float *)base, base + columns);
    return SPECDEC_OK;
}

long specdec_attention_scratch_bytes(int T, int Hq, int Hkv, int D, int S, int threads) {
    if (out_of(T, 1, MAX_ROWS) || out_of(Hkv, 1, 4096) || out_of(Hq, Hkv, 4096) || Hq % Hkv || out_of(D, 1, 4096) ||
        out_of(S, 1, 1L << 24) || out_of(threads, 1, SPECDEC_MAX_THREADS))
        return -1;
    return (long)(attention_scratch_bytes(1, T, Hq, Hkv, D, S) + 64);
}

int specdec_attention(const float *q, int T, int Hq, int Hkv, int D, const float *keys, const float *values, int S,
                      int pos, float scale, float *out, void *scratch, size_t scratch_bytes, int threads) {
    if (!q || !keys || !values || !out || !scratch) return SPECDEC_E_NULL;
    const long need = specdec_attention_scratch_bytes(T, Hq, Hkv, D, S, threads);
    if (out_of(threads, 1, SPECDEC_MAX_THREADS)) return SPECDEC_E_THREADS;
    if (need < 0) return SPECDEC_E_SHAPE;
    if (pos < 0 || pos > S - T) return SPECDEC_E_POSITION;
    if (scratch_bytes < (size_t)need) return SPECDEC_E_SCRATCH;
    const int32_t at = pos;
    const attention_t a = {1, T, Hq, Hkv, D, S, 0, scale, &at, q, &keys, &values, out};
    attention(threads, &a, (char *)ALIGNED((uintptr_t)scratch));
    return SPECDEC_OK;
}

// A trained draft head's layer in one call (specdec_native.h: head_t, specdec_head_forward): the norms, rotary and
// residuals done by the caller's thread (a head call feeds few rows), the products and the attention on the pool as a
// target's forward has them. Scratch comes from the caller (specdec_head_scratch_bytes): nothing is allocated.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"

enum { P_QKV = 0, P_O = 1, P_GATE_UP = 2, P_DOWN = 3, P_LM_HEAD = 4 };  // head_t.kinds' order

static int head_kernel(int kernel) { return kernel == K_STEP || kernel == K_Q8A || kernel == K_Q8A_REF; }

static int check_dims(const head_t *h) {
    if (layer_dims_bad(h->H, h->Hq, h->Hkv, h->D, h->I) || out_of(h->V, 1, 1L << 24) ||
        out_of(h->positions, 1, 1L << 24) || out_of(h->residual_normed, 0, 1) || !(h->eps >= 0.f) ||
        !isfinite(h->scale))
        return SPECDEC_E_SHAPE;
    return SPECDEC_OK;
}

static int check_head(const head_t *h, int kernel) {
    if (!h) return SPECDEC_E_NULL;
    if (check_dims(h) || !head_kernel(kernel)) return SPECDEC_E_SHAPE;
    for (int i = 0; i < 5; i++)
        if (!kind_known(h->kinds[i]) || !linear_kind_ok(kernel, h->kinds[i])) return SPECDEC_E_SHAPE;
    if (!h->input_norm || !h->hidden_norm || !h->post_norm || !h->norm || !h->qkv || !h->o || !h->gate_up ||
        !h->down || !h->lm_head || !h->cos || !h->sin)
        return SPECDEC_E_NULL;
    return SPECDEC_OK;
}

// ---- scratch ----
typedef struct { size_t x, qkv, q, att, tmp, h, xn, gu, act, decoded, rounded, attn, ptrs, end; } head_layout;

static head_layout layout_of(const head_t *h, int B, int T, int S, int threads) {
    const size_t M = (size_t)B * T, f = sizeof(float), QD = (size_t)h->Hq * h->D;
    const size_t QKV = (size_t)(h->Hq + 2 * h->Hkv) * h->D;
    int widest = 2 * h->H;  // qkv's inputs
    if ((int)QD > widest) widest = (int)QD;
    if (h->I > widest) widest = h->I;
    const size_t sizes[] = {f * M * 2 * h->H, f * M * QKV, f * M * QD, f * M * QD, f * M * h->H,
                            f * M * h->H, f * M * h->H, f * M * 2 * h->I, f * M * h->I,
                            f * (size_t)threads * linear_decoded_floats(widest), linear_rounded_bytes((int)M, widest),
                            attention_scratch_bytes(B, T, h->Hq, h->Hkv, h->D, S),
                            2 * sizeof(float *) * (size_t)B + sizeof(int32_t) * (size_t)B};
    size_t offsets[sizeof(sizes) / sizeof(sizes[0])], at = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        offsets[i] = at;
        at += ALIGNED(sizes[i]);
    }
    const head_layout l = {offsets[0], offsets[1], offsets[2], offsets[3],  offsets[4],  offsets[5], offsets[6],
                           offsets[7], offsets[8], offsets[9], offsets[10], offsets[11], offsets[12],
                           at + 64};  // + 64: the caller's buffer may start anywhere
    return l;
}

long specdec_head_scratch_bytes(const head_t *h, int B, int T, int S, int threads) {
    if (!h || check_dims(h) || rows_bad(B, T, S, threads)) return -1;
    return (long)layout_of(h, B, T, S, threads).end;
}

// ---- the layer ----
#define AT(base, l, field) ((float *)((base) + (l).field))

typedef struct {
    const head_t *h;
    char *base;
    head_layout at;
    int threads, kernel;
} head_pass;

static void product(const head_pass *p, int which, const float *x, int M, int K, float *y, int N) {
    const void *const w[5] = {p->h->qkv, p->h->o, p->h->gate_up, p->h->down, p->h->lm_head};
    linear(p->threads, p->kernel, p->h->kinds[which], x, M, K, w[which], y, N, N, AT(p->base, p->at, decoded),
           p->base + p->at.rounded);
}

// rows r of the inputs: x = [RMSNorm(embedded), RMSNorm(hidden)]
static void inputs(const head_pass *p, const float *embedded, const float *hidden, int M) {
    const head_t *h = p->h;
    const size_t H = (size_t)h->H;
    float *x = AT(p->base, p->at, x);
    for (size_t r = 0; r < (size_t)M; r++) {
        row_rmsnorm(embedded + r * H, h->input_norm, h->eps, h->H, x + r * 2 * H);
        row_rmsnorm(hidden + r * H, h->hidden_norm, h->eps, h->H, x + r * 2 * H + H);
    }
}

// each row's k and v rotated into its KV at its position; the q of the rows kept (every row, or each row's last) into
// the q buffer, in order
static void place(const head_pass *p, int B, int T, const int32_t *pos, float *const *keys, float *const *values,
                  int S, int last_only) {
    const head_t *h = p->h;
    const int D = h->D, Hq = h->Hq, Hkv = h->Hkv, half = D / 2;
    const size_t QKV = (size_t)(Hq + 2 * Hkv) * D;
    const float *qkv = AT(p->base, p->at, qkv);
    float *q = AT(p->base, p->at, q);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const size_t row = (size_t)b * T + t;
            const int at = pos[b] + t;
            const float *in = qkv + row * QKV, *cs = h->cos + (size_t)at * half, *sn = h->sin + (size_t)at * half;
            for (int k = 0; k < Hkv; k++) {
                row_rotate(in + (size_t)(Hq + k) * D, cs, sn, D, keys[b] + ((size_t)k * S + at) * D);
                memcpy(values[b] + ((size_t)k * S + at) * D, in + (size_t)(Hq + Hkv + k) * D, sizeof(float) * D);
            }
            if (last_only && t != T - 1) continue;
            const size_t kept = last_only ? (size_t)b : row;
            for (int k = 0; k < Hq; k++) row_rotate(in + (size_t)k * D, cs, sn, D, q + (kept * Hq + k) * D);
        }
}

int specdec_head_forward(const head_t *h, void *scratch, size_t scratch_bytes, const float *embedded,
                         const float *hidden, int B, int T, const int32_t *pos, float *const *keys,
                         float *const *values, int S, int last_only, int kernel, int threads, float *logits,
                         float *prenorm) {
    int status = check_head(h, kernel);
    if (status) return status;
    if (!scratch || !embedded || !hidden || !pos || !keys || !values || !logits || !prenorm) return SPECDEC_E_NULL;
    if ((status = rows_bad(B, T, S, threads))) return status;
    for (int b = 0; b < B; b++) {
        if (!keys[b] || !values[b]) return SPECDEC_E_NULL;
        if (pos[b] < 0 || pos[b] > S - T || pos[b] > h->positions - T) return SPECDEC_E_POSITION;
    }
    const head_layout at = layout_of(h, B, T, S, threads);
    if (scratch_bytes < at.end) return SPECDEC_E_SCRATCH;
    const head_pass p = {h, (char *)ALIGNED((uintptr_t)scratch), at, threads, kernel};
    const int H = h->H, I = h->I, M = B * T, QD = h->Hq * h->D, QKV = (h->Hq + 2 * h->Hkv) * h->D;
    const int kept = last_only ? B : M, steps = last_only ? 1 : T;  // the rows past the attention: each row's last
    inputs(&p, embedded, hidden, M);
    product(&p, P_QKV, AT(p.base, at, x), M, 2 * H, AT(p.base, at, qkv), QKV);
    place(&p, B, T, pos, keys, values, S, last_only);
    const float **rows = (const float **)(p.base + at.ptrs);  // each row's keys, then values
    int32_t *from = (int32_t *)(rows + 2 * B);                // ... and its first kept query's position
    for (int b = 0; b < B; b++) {
        rows[b] = keys[b], rows[B + b] = values[b];
        from[b] = pos[b] + T - steps;
    }
    const attention_t a = {B, steps, h->Hq, h->Hkv, h->D, S, 0, h->scale, from, AT(p.base, at, q), rows, rows + B,
                           AT(p.base, at, att)};
    attention(threads, &a, p.base + at.attn);
    float *tmp = AT(p.base, at, tmp), *hid = AT(p.base, at, h), *xn = AT(p.base, at, xn);
    float *gu = AT(p.base, at, gu), *act = AT(p.base, at, act);
    product(&p, P_O, AT(p.base, at, att), kept, QD, tmp, H);
    for (size_t r = 0; r < (size_t)kept; r++) {  // h = residual + o, then the second norm
        const size_t row = last_only ? r * T + T - 1 : r;  // its residual: the normed feature in x, or hidden
        const float *res = h->residual_normed ? AT(p.base, at, x) + row * 2 * H + H : hidden + row * H;
        for (int i = 0; i < H; i++) hid[r * H + i] = res[i] + tmp[r * H + i];
        row_rmsnorm(hid + r * H, h->post_norm, h->eps, H, xn + r * H);
    }
    product(&p, P_GATE_UP, xn, kept, H, gu, 2 * I);
    for (size_t r = 0; r < (size_t)kept; r++) row_silu_times(gu + r * 2 * I, gu + r * 2 * I + I, I, act + r * I);
    product(&p, P_DOWN, act, kept, I, tmp, H);
    for (size_t r = 0; r < (size_t)kept; r++) {  // prenorm = h + the MLP's output, then the final norm
        for (int i = 0; i < H; i++) prenorm[r * H + i] = hid[r * H + i] + tmp[r * H + i];
        row_rmsnorm(prenorm + r * H, h->norm, h->eps, H, xn + r * H);
    }
    product(&p, P_LM_HEAD, xn, kept, H, logits, h->V);
    return logits_sound(logits, kept, h->V) ? SPECDEC_OK : SPECDEC_E_NONFINITE;
}

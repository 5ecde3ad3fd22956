// specdec's native engine: the model descriptor and the exported functions, defined once (the weight kinds and their
// blocks: specdec_kinds.h). specdec/native/model.py mirrors the model descriptor (ctypes); the loader
// (specdec/native/build.py) checks SPECDEC_ABI_VERSION, every weight kind and every size below against the library it
// opened.
// Bump SPECDEC_ABI_VERSION with any change to model_t, an export's signature or a status code, and
// SPECDEC_FORMAT_VERSION (what a bundle's weights file records) with any change to a block layout.
#ifndef SPECDEC_NATIVE_H
#define SPECDEC_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#include "specdec_kinds.h"  // the weight kinds: SPECDEC_BLOCK, the block structs, SPECDEC_W_*, model_t.kind's SPECDEC_*

#define SPECDEC_ABI_VERSION 11
#define SPECDEC_FORMAT_VERSION 4
#define SPECDEC_MAX_THREADS 256 // threads one call may use (the caller and its workers)
#define SPECDEC_MAX_FEATURES 16 // layers one forward may return the hidden states of

// A block of activations rounded to two int8 parts (the draft): x ~ d * (128 * qs + lo), s the exact block sum
typedef struct { float d, s; int8_t qs[SPECDEC_BLOCK], lo[SPECDEC_BLOCK]; } blkq;
// ... two of them, for blk4p: sc = {d0, d1, s0, s1}
typedef struct { float sc[4]; int8_t qs[2][SPECDEC_BLOCK], lo[2][SPECDEC_BLOCK]; } blkqp;

_Static_assert(sizeof(blkq) == 72, "blkq is 72 bytes");
_Static_assert(sizeof(blkqp) == 2 * sizeof(blkq), "blkqp is two blkq");

// A model's MLP (model_t.mlp)
enum {
    SPECDEC_MLP_SILU_GATED = 0,  // gate_up [2 I, H], gate rows then up rows: down(SiLU(gate) * up)
    SPECDEC_MLP_GELU_TANH = 1,   // gate_up the up rows alone [I, H]: down(GELU(up)), GELU's tanh approximation
    SPECDEC_MLP_GELU = 2,        // ... GELU's exact erf form
};

// A LLaMA-layout model: per layer RMSNorm, packed q/k/v (plus biases, where qkv_bias is set; each head of q and k
// RMS-normalized, where q_norm and k_norm are set), rotate-half rotary,
// causal GQA over static KV (within a sliding window, where window is set), o, RMSNorm,
// packed gate/up, SiLU(gate) * up, down; a final RMSNorm and the head's V rows.
// Or GPT-2's layout, the same with: LayerNorm for every norm (the *_norm_bias tables set), learned positions added to
// the embedding in place of rotary (position_table set, cos and sin NULL), a bias after every product (o_bias,
// gate_up_bias, down_bias beside qkv_bias), and GELU of one up product as the MLP (mlp).
typedef struct {
    int32_t L, H, Hq, Hkv, D, I, V;  // layers, hidden, query heads, KV heads, head size, MLP width, head rows
    int32_t vocab;                   // embedding rows: every token id must be below this
    int32_t positions;               // rows of the rotary tables: every position must be below this
    int32_t kind;                    // SPECDEC_Q41, _BF16, _F16, _F32, _Q80 or _MIXED
    float eps, scale;                // RMSNorm epsilon, attention scores' scale
    const void *embedding;  // [vocab, H]: fp32 (Q41, Q80) or rows of kind; NULL where embedding_rows holds it
    const float *const *in_norm, *const *post_norm;  // [L] of [H]
    const void *const *qkv, *const *o, *const *gate_up, *const *down;  // [L] of blocks [N, K / SPECDEC_BLOCK] or
                                                                        // rows [N, K]
    const blk4p *const *qkv_p, *const *o_p, *const *gate_up_p, *const *down_p;  // [L] of [N, ceil(K / 64)]: the
                                                                                  // draft's (quant); else NULL
    const float *final_norm;  // [H]
    const void *head;         // blk8 [V, H / SPECDEC_BLOCK] (Q41, Q80, a draft's), or rows [V, H]
    const float *cos, *sin;   // [positions, D / 2], or both NULL where position_table is set
    const void *embedding_rows;  // [vocab, H / SPECDEC_BLOCK] of the head's blocks (blk8, or head_kind's): row t of
                                 // the embedding is their values (tied weights), or NULL
    const float *const *qkv_bias;  // [L] of [(Hq + 2 Hkv) D]: biases added to q/k/v before rotary (Qwen2), or NULL
    const int32_t *kinds;  // [L][5]: the weight kind (a block of SPECDEC_BLOCK with fp32 kernels: SPECDEC_W_Q41, _Q5,
                           // _Q80 or _Q6) of each layer's qkv (its q/k rows where qkv_v[l] is set), o, gate_up, down
                           // and qkv_v (SPECDEC_MIXED); NULL otherwise
    const void *const *qkv_v;  // [L]: the v rows [Hkv D, H / SPECDEC_BLOCK] of a layer whose q/k and v lie on
                               // different grids (SPECDEC_MIXED; NULL entries for the others), or NULL
    const float *const *q_norm, *const *k_norm;  // [L] of [D]: RMSNorm (eps) of each head of q and of k before rotary
                                                  // (Qwen3), or both NULL
    int32_t head_kind;  // SPECDEC_MIXED: the head's weight kind (SPECDEC_W_Q41, _Q5, _Q80 or _Q6: a Q6_K output's
                        // blk6); every other GGUF kind's head is blk8
    int32_t window;     // keys a query sees, its own included (a sliding window: Mistral's), or 0: every earlier key
    int32_t mlp;        // SPECDEC_MLP_SILU_GATED, _GELU_TANH or _GELU
    const float *const *in_norm_bias, *const *post_norm_bias;  // [L] of [H]: LayerNorm's biases, where every norm is
                                                                // LayerNorm ((x - mean) / std * gamma + beta: GPT-2's);
                                                                // both NULL: RMSNorm
    const float *final_norm_bias;                               // [H], set exactly where in_norm_bias is
    const float *const *o_bias, *const *gate_up_bias, *const *down_bias;  // [L] of [H], [2 I or I], [H]: biases added
                                                                          // after those products, or NULL
    const float *position_table;  // [positions, H]: learned positions added to each token's embedding, where cos and
                                  // sin are NULL (no rotary: GPT-2's); or NULL
} model_t;

// The hidden states a forward also returns (a trained draft head's input): for each of n layers, every fed row's
// residual stream after that layer (its attention and MLP added), fp32
typedef struct {
    const int32_t *layers;  // [n], each in 0..L-1
    int32_t n;              // 1..SPECDEC_MAX_FEATURES
    float *out;             // [B][T][n][H]: row b's token t, layers[f]'s hidden state at [b][t][f]
} features_t;

// A trained draft head's layer (EAGLE-3's layout; specdec/head/model.py is its numpy reference): each fed row takes
// its token's embedding e and a feature f (the fused target features, or the head's own prenorm of the position
// before), x = [RMSNorm(e, input_norm), RMSNorm(f, hidden_norm)] (2H wide); q/k/v of x, rotate-half rotary, causal GQA
// over the head's own static KV, o; h = the residual (RMSNorm(f, hidden_norm) where residual_normed is set, else f) +
// o; prenorm = h + down(SiLU(gate) * up) of RMSNorm(h, post_norm); logits = lm_head(RMSNorm(prenorm, norm)) over the
// draft vocabulary's V rows
typedef struct {
    int32_t H, Hq, Hkv, D, I, V;  // hidden, query heads, KV heads, head size, MLP width, draft vocabulary rows
    int32_t positions;            // rows of the rotary tables: every position must be below this
    int32_t residual_normed;      // 0 or 1
    float eps, scale;             // RMSNorm epsilon, attention scores' scale
    int32_t kinds[5];             // SPECDEC_W_* of qkv, o, gate_up, down, lm_head: block kinds the call's kernel takes
    const float *input_norm, *hidden_norm, *post_norm, *norm;  // [H]
    const void *qkv, *o, *gate_up, *down, *lm_head;  // [N, elements of K]: qkv [(Hq + 2 Hkv) D, 2H], o [H, Hq D],
                                                     // gate_up [2 I, H] (gate rows, then up), down [H, I], lm_head [V, H]
    const float *cos, *sin;       // [positions, D / 2]
} head_t;

// A forward's activations (specdec_forward's quant)
enum {
    SPECDEC_ACT_F32 = 0,    // fp32 activations times the model's weights (a target's graph's function)
    SPECDEC_ACT_DRAFT = 1,  // the draft's: activations rounded to two int8 parts times its paired blocks (*_p)
    SPECDEC_ACT_INT8 = 2,   // a target's, each row's activations rounded per block of 32 to int8 (one scale a block)
                            // before every product whose weights the table gives SPECDEC_Q8A (blk4, blk8, blk5, blk6), the
                            // head's too; other kinds' products stay fp32
    SPECDEC_ACT_BF16 = 3,   // a target's, each row's activations rounded to bf16 before every product with bf16 rows,
                            // the head's too, on AMX-BF16 tiles (specdec_matmul's SPECDEC_KERNEL_BF16A; where the CPU
                            // lacks them, SPECDEC_E_SHAPE); other kinds' products stay fp32
};

// Status codes: 0, or what was wrong with the arguments (nothing is written where a call fails its checks), or
// SPECDEC_E_NONFINITE: a forward ran, and a row of logits it wrote holds NaN or has no finite largest logit (+inf, or
// all -inf): corrupt weights, or values that overflow.
enum {
    SPECDEC_OK = 0,
    SPECDEC_E_NULL = 1,      // a pointer the call needs is NULL
    SPECDEC_E_SHAPE = 2,     // a count or size is out of range (rows, tokens, K % SPECDEC_BLOCK, dims)
    SPECDEC_E_TOKEN = 3,     // a token id outside 0..vocab - 1
    SPECDEC_E_POSITION = 4,  // pos < 0, pos + T > S, or past the rotary tables
    SPECDEC_E_SCRATCH = 5,   // the scratch is smaller than specdec_scratch_bytes asks
    SPECDEC_E_THREADS = 6,   // threads outside 1..SPECDEC_MAX_THREADS
    SPECDEC_E_NONFINITE = 7, // specdec_forward: a row of logits holds NaN or +inf, or is all -inf (logits and K/V
                             // are written)
};

int specdec_abi_version(void);
// sizeof of 0: blkq, 1: blkqp, 2: model_t, 3: features_t, 4: head_t; -1 for any other
long specdec_layout_size(int which);
// The table of weight kinds this library was built from (specdec_kinds.h): kind's element bytes, weights per element
// along K, kernels (SPECDEC_STEP, _PROMPT, _INT8, _Q8A, _Q8A_REF bits) and builds (SPECDEC_ISA_* bits) into traits[0..3], and the
// build this library is (one SPECDEC_ISA_* bit) into traits[4]; SPECDEC_E_SHAPE for a kind outside
// 0..SPECDEC_W_COUNT - 1.
int specdec_weight_kind(int kind, int32_t traits[5]);

// Bytes of scratch a forward of B rows of T tokens with the given threads needs (whatever its quant),
// or -1 for arguments a forward would refuse.
long specdec_scratch_bytes(const model_t *m, int B, int T, int S, int threads);

// B rows of T tokens each; row b at positions pos[b].. of its own KV (keys[b], values[b]: [L][Hkv, S, D], layer l at
// + l * layer_stride floats) -> logits [B][T or 1 (last_only)][V], and where features is not NULL, the hidden states
// it names (every fed token's, last_only or not). K/V land at [pos[b], pos[b] + T). Every logit is checked:
// SPECDEC_E_NONFINITE where a row holds NaN or has no finite largest logit. quant: a SPECDEC_ACT_* (in each, a row's
// logits are the same bits whatever the call's B, T and threads).
int specdec_forward(const model_t *m, void *scratch, size_t scratch_bytes, const int64_t *tokens, int B, int T,
                    const int32_t *pos, float *const *keys, float *const *values, long layer_stride, int S,
                    int last_only, int quant, int threads, float *logits, const features_t *features);

// A draft head's layer over B rows of T tokens, row b at positions pos[b].. of its KV (keys[b], values[b]: [Hkv, S,
// D]): embedded and hidden [B][T][H] (each token's embedding and feature) -> logits [B][T or 1][V] and prenorm
// [B][T or 1][H] (each row's last token alone with last_only). K/V land at [pos[b], pos[b] + T). kernel: the products'
// SPECDEC_KERNEL_STEP, _Q8A or _Q8A_REF, one the table gives every kind of h->kinds. SPECDEC_E_NONFINITE where a row
// of logits holds NaN or has no finite largest logit (all outputs written). A row's outputs are the same bits whatever
// the call's B, T and threads.
long specdec_head_scratch_bytes(const head_t *h, int B, int T, int S, int threads);
int specdec_head_forward(const head_t *h, void *scratch, size_t scratch_bytes, const float *embedded,
                         const float *hidden, int B, int T, const int32_t *pos, float *const *keys,
                         float *const *values, int S, int last_only, int kernel, int threads, float *logits,
                         float *prenorm);

// The products alone, for tests and benchmarks: x [M, K] fp32 -> y [M, N] through weights [N, wblocks] of a weight kind
// (SPECDEC_W_*) by a kernel (SPECDEC_KERNEL_*) that the table gives it; wblocks must be what K needs: ceil(K / PER)
// elements a column, K a multiple of SPECDEC_BLOCK.
long specdec_matmul_scratch_bytes(int M, int K, int kernel, int threads);
int specdec_matmul(const float *x, int M, int K, const void *w, int wblocks, int kind, int kernel, float *y, int N,
                   void *scratch, size_t scratch_bytes, int threads);

// The attention alone (tests check it against numpy): q [T, Hq, D] at positions pos..pos+T-1 over keys, values
// [Hkv, S, D] (holding positions 0..pos+T-1) -> out [T, Hq, D].
long specdec_attention_scratch_bytes(int T, int Hq, int Hkv, int D, int S, int threads);
int specdec_attention(const float *q, int T, int Hq, int Hkv, int D, const float *keys, const float *values, int S,
                      int pos, float scale, float *out, void *scratch, size_t scratch_bytes, int threads);

#endif

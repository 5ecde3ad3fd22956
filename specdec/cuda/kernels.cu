// The cuda backend's kernels (specdec/cuda/device.py compiles them with NVRTC at first use; CuPy caches the binary
// per GPU architecture). One header, the weight kinds' (device.py inlines it, so the source NVRTC compiles and CuPy
// caches by is whole); no system header: bf16 is the top half of an fp32 and f16 converts through PTX. Every kernel
// has a numpy reference of the same arguments in specdec/cuda/reference.py, which CI runs in its place; the device
// check compares the two on a GPU.
//
// Weights (specdec_kinds.h owns their kinds: these are its structs, and NVRTC checks its asserts): a weight is N
// output columns of K inputs, of one of CUDA_KINDS below: Q4_1 blocks (w = d*q + m), Q8_0 blocks (w = d*q), the
// draft's pairs of Q4_1 blocks with fp16 scales, or rows of bf16 / f16 / f32. Activations are fp32 throughout. KV of
// one layer: [slots, Hkv, S, D] fp32.
//
// Summation order: a row's result depends only on that row's inputs and position, never on how many rows a call
// holds (a product sums a column the same way for 1 row or 64; attention splits keys by the key count alone), so a
// verify pass of T tokens gives a position the bits a one-token step gives it, and greedy speculation equals plain
// greedy decoding on the same GPU.

#include "specdec_kinds.h"

typedef unsigned char u8;
typedef unsigned short u16;

// The weight kinds these kernels serve, each X(name, kind): its product and dequant kernels are named after it
// (linear_<name>, ...). specdec/cuda/layouts.py declares the table's others (UNSERVED); tests/cuda/test_kernels.py
// checks that the two cover the table.
#define CUDA_KINDS(X) X(q41, SPECDEC_W_Q41) X(q80, SPECDEC_W_Q80) X(q41p, SPECDEC_W_Q41P) X(bf16, SPECDEC_W_BF16) \
                      X(f16, SPECDEC_W_F16) X(f32, SPECDEC_W_F32)

#define WARP 32     // lanes of a warp
#define LINEAR_WARPS 4  // output columns per block of the product kernels
#define ROWS 8          // rows a product kernel holds in registers at once
#define ATT_WARPS 4
#define NEG_INF __int_as_float(0xff800000)
#define NAN_F __int_as_float(0x7fc00000)

__device__ __forceinline__ float bf16_f(u16 h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ float f16_f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// the SPECDEC_BLOCK weights of group g (inputs g * SPECDEC_BLOCK on) of column n: its block, a pair's half, or a
// stretch of its row
template <int KIND>
__device__ __forceinline__ void group(const void *w, int n, int K, int g, float v[SPECDEC_BLOCK]) {
    static_assert(SPECDEC_BLOCK == 32, "a group's loads below take 32 weights");
    const int groups = K / SPECDEC_BLOCK;
    if constexpr (KIND == SPECDEC_W_Q41) {
        const blk4 *b = (const blk4 *)w + (size_t)n * groups + g;
        const float d = b->d, m = b->m;
#pragma unroll
        for (int j = 0; j < SPECDEC_BLOCK / 2; j++) {
            const unsigned q = b->qs[j];
            v[j] = fmaf(d, (float)(q & 15u), m);
            v[j + SPECDEC_BLOCK / 2] = fmaf(d, (float)(q >> 4), m);
        }
    } else if constexpr (KIND == SPECDEC_W_Q80) {
        const blk8 *b = (const blk8 *)w + (size_t)n * groups + g;
        const float d = b->d;
#pragma unroll
        for (int j = 0; j < SPECDEC_BLOCK; j++) v[j] = d * (float)b->qs[j];
    } else if constexpr (KIND == SPECDEC_W_Q41P) {
        const blk4p *b = (const blk4p *)w + (size_t)n * ((groups + 1) / 2) + g / 2;
        const int second = g & 1;
        const float d = f16_f(b->h[second]), m = f16_f(b->h[2 + second]);
#pragma unroll
        for (int j = 0; j < SPECDEC_BLOCK; j++) v[j] = fmaf(d, (float)(second ? b->qs[j] >> 4 : b->qs[j] & 15u), m);
    } else if constexpr (KIND == SPECDEC_W_F32) {
        const float4 *p = (const float4 *)((const float *)w + (size_t)n * K + SPECDEC_BLOCK * g);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float4 f = p[j];
            v[4 * j] = f.x, v[4 * j + 1] = f.y, v[4 * j + 2] = f.z, v[4 * j + 3] = f.w;
        }
    } else if constexpr (KIND == SPECDEC_W_BF16 || KIND == SPECDEC_W_F16) {  // 8 values a 16-byte load
        const uint4 *p = (const uint4 *)((const u16 *)w + (size_t)n * K + SPECDEC_BLOCK * g);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint4 u = p[j];
            const unsigned words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u16 lo = (u16)(words[i] & 0xffffu), hi = (u16)(words[i] >> 16);
                v[8 * j + 2 * i] = KIND == SPECDEC_W_BF16 ? bf16_f(lo) : f16_f(lo);
                v[8 * j + 2 * i + 1] = KIND == SPECDEC_W_BF16 ? bf16_f(hi) : f16_f(hi);
            }
        }
    } else {
        static_assert(KIND != KIND, "a kind of CUDA_KINDS without its decode here");
    }
}

enum { PLAIN = 0, NORM = 1, SILU = 2 };  // what a product reads as its input row (fusions that save a launch)

// input row r's values k .. k + 3: x itself; x * gamma (RMSNorm's gain; its scale multiplies the sum after); or
// SiLU(gate) * up of a [gate | up] row of width 2K
template <int INPUT>
__device__ __forceinline__ float4 input4(const float *x, const float *gamma, int K, int r, int k) {
    if (INPUT == SILU) {
        const float *row = x + (size_t)r * 2 * K + k;
        const float4 g = *(const float4 *)row, u = *(const float4 *)(row + K);
        return make_float4(g.x / (1.f + expf(-g.x)) * u.x, g.y / (1.f + expf(-g.y)) * u.y,
                           g.z / (1.f + expf(-g.z)) * u.z, g.w / (1.f + expf(-g.w)) * u.w);
    }
    const float4 f = *(const float4 *)(x + (size_t)r * K + k);
    if (INPUT == PLAIN) return f;
    const float4 g = *(const float4 *)(gamma + k);
    return make_float4(f.x * g.x, f.y * g.y, f.z * g.z, f.w * g.w);
}

// 1 / sqrt(mean + eps) of a norm's sum of squares, or NaN where it overflowed: 1 / sqrt(inf) is 0, which would turn
// the row to zeros and the logits to one silent token; NaN reaches argmax's check of every logit instead
__device__ __forceinline__ float norm_scale(float sum, int n, float eps) {
    return isinf(sum) ? NAN_F : 1.f / sqrtf(sum / n + eps);
}

// y[M, N] (+)= in[M, K] . W^T: one warp a column; lane l sums groups l, l + 32, ... of each row in order, then the
// warp adds its lanes by a fixed butterfly. accumulate: add to y (a residual stream) instead of overwriting it.
// NORM: in = x * gamma and the sum is scaled by rsqrt(mean(x^2) + eps), the warp's own RMSNorm of the row.
template <int KIND, int INPUT>
__device__ void linear_body(const float *x, const float *gamma, float eps, int M, int K, const void *w, int N,
                            float *y, int accumulate) {
    const int lane = threadIdx.x % WARP, n = blockIdx.x * LINEAR_WARPS + threadIdx.x / WARP, groups = K / SPECDEC_BLOCK;
    if (n >= N) return;
    float v[SPECDEC_BLOCK];
    for (int r0 = 0; r0 < M; r0 += ROWS) {
        float acc[ROWS], scale[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            acc[r] = 0.f, scale[r] = 1.f;
            if (INPUT == NORM && r0 + r < M) {
                float s = 0.f;
                for (int k = 4 * lane; k < K; k += 4 * WARP) {
                    const float4 f = *(const float4 *)(x + (size_t)(r0 + r) * K + k);
                    s = fmaf(f.x, f.x, s), s = fmaf(f.y, f.y, s), s = fmaf(f.z, f.z, s), s = fmaf(f.w, f.w, s);
                }
                scale[r] = norm_scale(warp_sum(s), K, eps);
            }
        }
        for (int g = lane; g < groups; g += WARP) {
            group<KIND>(w, n, K, g, v);
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                if (r0 + r >= M) break;
                float s = acc[r];
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const float4 f = input4<INPUT>(x, gamma, K, r0 + r, SPECDEC_BLOCK * g + 4 * j);
                    s = fmaf(v[4 * j], f.x, s);
                    s = fmaf(v[4 * j + 1], f.y, s);
                    s = fmaf(v[4 * j + 2], f.z, s);
                    s = fmaf(v[4 * j + 3], f.w, s);
                }
                acc[r] = s;
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (r0 + r >= M) break;
            const float total = warp_sum(acc[r]) * scale[r];
            if (lane == 0) {
                float *out = y + (size_t)(r0 + r) * N + n;
                *out = accumulate ? *out + total : total;
            }
        }
    }
}

#define LINEAR(suffix, KIND)                                                                                       \
    extern "C" __global__ void linear_##suffix(const float *x, int M, int K, const void *w, int N, float *y,      \
                                               int accumulate) {                                                  \
        linear_body<KIND, PLAIN>(x, 0, 0.f, M, K, w, N, y, accumulate);                                           \
    }                                                                                                              \
    extern "C" __global__ void linear_norm_##suffix(const float *x, const float *gamma, float eps, int M, int K,  \
                                                    const void *w, int N, float *y, int accumulate) {             \
        linear_body<KIND, NORM>(x, gamma, eps, M, K, w, N, y, accumulate);                                        \
    }                                                                                                              \
    extern "C" __global__ void linear_silu_##suffix(const float *gu, int M, int K, const void *w, int N, float *y, \
                                                    int accumulate) {                                             \
        linear_body<KIND, SILU>(gu, 0, 0.f, M, K, w, N, y, accumulate);                                           \
    }
CUDA_KINDS(LINEAR)

// W as fp32 rows [N, K] (for cuBLAS on a prefill chunk): one thread a group of SPECDEC_BLOCK
template <int KIND>
__device__ void dequant_body(const void *w, int N, int K, float *out) {
    const size_t at = (size_t)blockIdx.x * blockDim.x + threadIdx.x, groups = K / SPECDEC_BLOCK;
    if (at >= (size_t)N * groups) return;
    float v[SPECDEC_BLOCK];
    group<KIND>(w, (int)(at / groups), K, (int)(at % groups), v);
#pragma unroll
    for (int j = 0; j < SPECDEC_BLOCK; j++) out[at * SPECDEC_BLOCK + j] = v[j];
}

#define DEQUANT(suffix, KIND) \
    extern "C" __global__ void dequant_##suffix(const void *w, int N, int K, float *out) { \
        dequant_body<KIND>(w, N, K, out); \
    }
CUDA_KINDS(DEQUANT)

// out[m] = row ids[m] of the table [vocab, H] (Q8_0 blocks, or rows of bf16 / f16 / f32); one block a row
extern "C" __global__ void embed(const void *table, int kind, const int *ids, int H, float *out) {
    const int m = blockIdx.x;
    const size_t row = (size_t)ids[m];
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float v;
        if (kind == SPECDEC_W_Q80) {
            const blk8 *b = (const blk8 *)table + row * (H / SPECDEC_BLOCK) + i / SPECDEC_BLOCK;
            v = b->d * (float)b->qs[i % SPECDEC_BLOCK];
        } else if (kind == SPECDEC_W_BF16) v = bf16_f(((const u16 *)table)[row * H + i]);
        else if (kind == SPECDEC_W_F16) v = f16_f(((const u16 *)table)[row * H + i]);
        else v = ((const float *)table)[row * H + i];
        out[(size_t)m * H + i] = v;
    }
}

// a block's sum in a fixed order: each thread's strided sum, each warp's butterfly, then the warps in order
__device__ float block_sum(float v, float *shared) {
    v = warp_sum(v);
    const int warps = blockDim.x / WARP;
    __syncthreads();
    if (threadIdx.x % WARP == 0) shared[threadIdx.x / WARP] = v;
    __syncthreads();
    float total = 0.f;
    for (int i = 0; i < warps; i++) total += shared[i];
    return total;
}

__device__ float block_max(float v, float *shared) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warps = blockDim.x / WARP;
    __syncthreads();
    if (threadIdx.x % WARP == 0) shared[threadIdx.x / WARP] = v;
    __syncthreads();
    float best = shared[0];
    for (int i = 1; i < warps; i++) best = fmaxf(best, shared[i]);
    return best;
}

// out[r] = x[r * step + offset] * rsqrt(mean(x^2) + eps) * gamma: one block a row (step, offset pick each row's last
// position for a last-only head)
extern "C" __global__ void rmsnorm(const float *x, const float *gamma, float eps, int H, int step, int offset,
                                   float *out) {
    __shared__ float shared[32];  // a partial a warp: a block has at most 32 warps
    const float *in = x + ((size_t)blockIdx.x * step + offset) * H;
    float s = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) s = fmaf(in[i], in[i], s);
    const float r = norm_scale(block_sum(s, shared), H, eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) out[(size_t)blockIdx.x * H + i] = in[i] * r * gamma[i];
}

// rotary on q (into q [M, Hq, D]) and k, and k, v written to the KV of each row's slot at its position:
// grid (M, Hq + Hkv), one thread a rotated pair; row m = b * T + t sits at pos[b] + t of slot slots[b]
extern "C" __global__ void rope_kv(const float *qkv, const float *cos, const float *sin, const int *pos,
                                   const int *slots, int T, int Hq, int Hkv, int D, int S, float *q, float *keys,
                                   float *values) {
    const int m = blockIdx.x, h = blockIdx.y, b = m / T, at = pos[b] + m % T, half = D / 2;
    const float *in = qkv + (size_t)m * (Hq + 2 * Hkv) * D + (size_t)h * D;
    const float *cs = cos + (size_t)at * half, *sn = sin + (size_t)at * half;
    float *out = h < Hq ? q + ((size_t)m * Hq + h) * D
                        : keys + (((size_t)slots[b] * Hkv + (h - Hq)) * S + at) * D;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float x1 = in[i], x2 = in[i + half];
        out[i] = x1 * cs[i] - x2 * sn[i];
        out[i + half] = x2 * cs[i] + x1 * sn[i];
    }
    if (h >= Hq) {
        const float *v = qkv + (size_t)m * (Hq + 2 * Hkv) * D + (size_t)(h + Hkv) * D;
        float *dst = values + (((size_t)slots[b] * Hkv + (h - Hq)) * S + at) * D;
        for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = v[i];
    }
}

// softmax(q . K^T * scale) . V over the keys 0 .. pos + t of the row's slot (its own new keys included, causal):
// grid (M, Hq), ATT_WARPS warps; dynamic shared memory (S + ATT_WARPS * D + 32) floats. Warp w takes keys w, w + 4,
// ...; the split depends on the key count only.
extern "C" __global__ void attention(const float *q, const float *keys, const float *values, const int *pos,
                                     const int *slots, int T, int Hq, int Hkv, int D, int S, float scale,
                                     float *out) {
    extern __shared__ float shared[];
    float *scores = shared, *partial = shared + S, *reduce = partial + ATT_WARPS * D;
    const int m = blockIdx.x, h = blockIdx.y, b = m / T, n = pos[b] + m % T + 1;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const size_t base = ((size_t)slots[b] * Hkv + h / (Hq / Hkv)) * S * D;
    const float *K = keys + base, *V = values + base, *qv = q + ((size_t)m * Hq + h) * D;
    for (int j = warp; j < n; j += ATT_WARPS) {
        float s = 0.f;
        for (int d = lane; d < D; d += WARP) s = fmaf(qv[d], K[(size_t)j * D + d], s);
        s = warp_sum(s);
        if (lane == 0) scores[j] = s * scale;
    }
    __syncthreads();
    float best = NEG_INF;
    for (int j = threadIdx.x; j < n; j += blockDim.x) best = fmaxf(best, scores[j]);
    best = block_max(best, reduce);
    float sum = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = expf(scores[j] - best);
        scores[j] = e;
        sum += e;
    }
    sum = block_sum(sum, reduce);  // its barriers also publish the exponentials
    float acc[8];  // D <= 256: lane l holds d = l, l + 32, ...
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0.f;
    for (int j = warp; j < n; j += ATT_WARPS) {
        const float p = scores[j];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int d = lane + WARP * i;
            if (d < D) acc[i] = fmaf(p, V[(size_t)j * D + d], acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int d = lane + WARP * i;
        if (d < D) partial[warp * D + d] = acc[i];
    }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < ATT_WARPS; w++) o += partial[w * D + d];
        out[((size_t)m * Hq + h) * D + d] = o / sum;
    }
}

// act[m, i] = SiLU(gu[m, i]) * gu[m, I + i]
extern "C" __global__ void silu_mul(const float *gu, int M, int I, float *act) {
    const size_t at = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (at >= (size_t)M * I) return;
    const size_t m = at / I, i = at % I;
    const float g = gu[m * 2 * I + i];
    act[at] = g / (1.f + expf(-g)) * gu[m * 2 * I + I + i];
}

// after one greedy draft step of B rows: row b's next input token (its argmax, mapped through a trimmed head's token
// ids, where an unscored token's logit `fill` wins or ties: the first unscored id) into tokens[b] and chain[b], and its
// position one on; the next step of the same graph reads both. A row whose logits were not all finite (best NaN:
// argmax) gets -1 in chain[b], which the host refuses; its next input stays a valid id
extern "C" __global__ void chain_next(const int *ids, const float *best, const int *head_rows, int mapped, float fill,
                                      int fill_token, int B, int *tokens, int *pos, int *chain) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    int token = mapped ? head_rows[ids[b]] : ids[b];
    if (mapped && (best[b] < fill || (best[b] == fill && fill_token < token))) token = fill_token;
    tokens[b] = token;
    chain[b] = best[b] == best[b] ? token : -1;
    pos[b] += 1;
}

// ids[r], best[r]: the first index of row r's largest logit and that logit (numpy's argmax); one block a row. best[r]
// is NaN where a logit of the row is NaN or the largest is not finite (+inf, or all -inf): the check of every logit
// rides on the read argmax makes anyway
extern "C" __global__ void argmax(const float *x, int V, int *ids, float *best) {
    __shared__ float values[32];  // a candidate a warp (at most 32)
    __shared__ int where[32];
    const float *row = x + (size_t)blockIdx.x * V;
    float v = NEG_INF;
    int at = 0x7fffffff, bad = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        bad |= row[i] != row[i];
        if (row[i] > v || at == 0x7fffffff) v = row[i], at = i;
    }
    bad = __syncthreads_or(bad);
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oa = __shfl_xor_sync(0xffffffffu, at, o);
        if (ov > v || (ov == v && oa < at)) v = ov, at = oa;
    }
    if (threadIdx.x % WARP == 0) values[threadIdx.x / WARP] = v, where[threadIdx.x / WARP] = at;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x / WARP); w++)
            if (values[w] > v || (values[w] == v && where[w] < at)) v = values[w], at = where[w];
        ids[blockIdx.x] = at;
        best[blockIdx.x] = bad || !isfinite(v) ? NAN_F : v;
    }
}

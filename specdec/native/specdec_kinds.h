// specdec's weight kinds, defined once (ggml's type traits): the block structs, the elements of rows, and one table
// that gives each kind its id, element, bytes, weights per element, kernels, builds and decode. Everything else reads
// this file rather than restating it:
// - the native kernels include it through specdec_native.h (the SPECDEC_W_* enum and the asserts below; internal.h
//   turns the table into the traits array that linear.c and forward.c look kinds up in);
// - specdec/cuda/kernels.cu includes it (specdec/cuda/device.py inlines it for NVRTC): the GPU's structs are these,
//   and NVRTC checks the same asserts;
// - specdec/kinds.py parses it (the defines, the enums, the structs as numpy dtypes, the tables' rows), so Python
//   holds no second copy of any of it.
// It compiles as C (gcc) and as C++ (NVRTC): it includes nothing but <stdint.h>, which NVRTC lacks.
// Bump SPECDEC_FORMAT_VERSION (specdec_native.h) with any change to an element's layout, and never reuse an id.
#ifndef SPECDEC_KINDS_H
#define SPECDEC_KINDS_H

#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned short uint16_t;
#else
#include <stdint.h>
#endif
#ifdef __cplusplus
#define SPECDEC_STATIC_ASSERT static_assert
#else
#define SPECDEC_STATIC_ASSERT _Static_assert
#endif

#define SPECDEC_BLOCK 32  // weights per block along K (a GGUF's)

// The elements of rows [N, K] in a checkpoint's own precision
typedef float f32;
typedef uint16_t f16;   // an IEEE half's bits
typedef uint16_t bf16;  // the top half of an fp32's bits

// Q4_1: w = d * q + m; qs[j] holds q[j] in its low nibble and q[j + 16] in its high one
typedef struct { float d, m; uint8_t qs[SPECDEC_BLOCK / 2]; } blk4;
// Q8_0: w = d * q
typedef struct { float d; int8_t qs[SPECDEC_BLOCK]; } blk8;
// 5-bit codes with a scale and a minimum (a GGUF's Q5_0, Q5_1 or Q5_K block): w = d * q + m, q in 0..31. The 32
// codes are packed in `codes` as 160 bits (little-endian: bit t of byte b is bit 8 b + t), 5 bits a slot, slot i
// holding q[SPECDEC_Q5_ORDER[i]]: q[0..15] all lie in bytes 0-15 and q[16..31] in bytes 5-20, at the same offsets
// from them, so each half is one 16-byte load; and within each 8-byte half of such a load lie the codes of the
// 16-lane vector's lanes that a 128-bit broadcast puts there (linear.c: q5_decode16). d and m follow the codes, so
// the second load stays inside the block.
#define SPECDEC_Q5_ORDER {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29, \
                          2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}
typedef struct { uint8_t codes[SPECDEC_BLOCK * 5 / 8]; float d, m; } blk5;
// Q8_0 with a scale per 16 (a GGUF Q6_K's sub-blocks): w = d[0] * q for elements 0-15, d[1] * q for 16-31
typedef struct { float d[2]; int8_t qs[SPECDEC_BLOCK]; } blk6;
// Two Q4_1 blocks of a column (the draft's copy): fp16 d0, d1, m0, m1 (a GGUF's own precision), then
// qs[j] = q0[j] | q1[j] << 4. 40 bytes per 64 weights where two blk4 take 48. An odd count ends in a zero block.
typedef struct { f16 h[4]; uint8_t qs[SPECDEC_BLOCK]; } blk4p;

// The kernels of specdec_matmul (its `kernel`), and their bits in the table's KERNELS
enum { SPECDEC_KERNEL_STEP = 0, SPECDEC_KERNEL_PROMPT = 1, SPECDEC_KERNEL_INT8 = 2, SPECDEC_KERNEL_Q8A = 3,
       SPECDEC_KERNEL_Q8A_REF = 4, SPECDEC_KERNEL_BF16A = 5 };
#define SPECDEC_STEP (1 << SPECDEC_KERNEL_STEP)      // a decode step's and a verify pass's: fp32 activations
#define SPECDEC_PROMPT (1 << SPECDEC_KERNEL_PROMPT)  // a prompt's: the weights decoded to fp32 first
#define SPECDEC_INT8 (1 << SPECDEC_KERNEL_INT8)      // activations rounded to two int8 parts per block: the draft's
#define SPECDEC_Q8A (1 << SPECDEC_KERNEL_Q8A)        // ... to one int8 part per block (SPECDEC_ACT_INT8: linear_q8a.c)
#define SPECDEC_Q8A_REF (1 << SPECDEC_KERNEL_Q8A_REF)  // ... the same in plain C: the bits SPECDEC_Q8A must give
#define SPECDEC_Q8A_BOTH (SPECDEC_Q8A | SPECDEC_Q8A_REF)
#define SPECDEC_BF16A (1 << SPECDEC_KERNEL_BF16A)    // ... to bf16, times bf16 rows on AMX tiles (SPECDEC_ACT_BF16:
                                                    // linear_bf16a.c; AVX-512 builds, where the CPU has AMX-BF16)
// The builds of the kernels (specdec/native/build.py: Isa), as bits of the table's ISAS
enum { SPECDEC_ISA_AVX2 = 1, SPECDEC_ISA_AVX512 = 2, SPECDEC_ISA_AVX512_VBMI = 4, SPECDEC_ISA_AVX2_VNNI = 8 };
#define SPECDEC_EVERY_ISA (SPECDEC_ISA_AVX2 | SPECDEC_ISA_AVX512 | SPECDEC_ISA_AVX512_VBMI | SPECDEC_ISA_AVX2_VNNI)

// The weight kinds: a product's weights are N columns of K inputs, each column ceil(K / PER) elements.
// X(NAME, ID, ELEMENT, BYTES, PER, KERNELS, ISAS, DECODE)
//   NAME     SPECDEC_W_<NAME>; lowercased, the kind's name in Python and in kernels.cu's kernel names
//   ID       specdec_matmul's kind and model_t.kinds' (a bundle's weights never record it; never reuse one)
//   ELEMENT  a block struct above, or a row's element (f32, f16, bf16); BYTES its size (asserted below)
//   PER      weights an element holds along K: SPECDEC_BLOCK (a block), 2 * SPECDEC_BLOCK (a pair), 1 (a row's)
//   KERNELS  the kernels of specdec_matmul that run it; ISAS the builds that have them
//   DECODE   a weight's value
#define SPECDEC_WEIGHT_KINDS(X) \
    X(Q41,  0, blk4,  24, SPECDEC_BLOCK,     SPECDEC_STEP | SPECDEC_PROMPT | SPECDEC_Q8A_BOTH, SPECDEC_EVERY_ISA, \
      "d * q + m, q in 0..15") \
    X(Q80,  1, blk8,  36, SPECDEC_BLOCK,     SPECDEC_STEP | SPECDEC_PROMPT | SPECDEC_INT8 | SPECDEC_Q8A_BOTH, \
      SPECDEC_EVERY_ISA, \
      "d * q, q in -127..127") \
    X(Q41P, 2, blk4p, 40, 2 * SPECDEC_BLOCK, SPECDEC_INT8,                   SPECDEC_EVERY_ISA, \
      "each half: d * q + m, q in 0..15, d and m fp16") \
    X(BF16, 3, bf16,   2, 1,                 SPECDEC_STEP | SPECDEC_PROMPT | SPECDEC_BF16A, SPECDEC_EVERY_ISA, \
      "the fp32 of these top 16 bits") \
    X(F16,  4, f16,    2, 1,                 SPECDEC_STEP | SPECDEC_PROMPT,  SPECDEC_EVERY_ISA, \
      "the IEEE half, exactly in fp32") \
    X(F32,  5, f32,    4, 1,                 SPECDEC_STEP | SPECDEC_PROMPT,  SPECDEC_EVERY_ISA, \
      "itself") \
    X(Q6,   6, blk6,  40, SPECDEC_BLOCK,     SPECDEC_STEP | SPECDEC_PROMPT | SPECDEC_Q8A_BOTH, SPECDEC_EVERY_ISA, \
      "d[0] * q for elements 0-15, d[1] * q for 16-31, q in -127..127") \
    X(Q5,   7, blk5,  28, SPECDEC_BLOCK,     SPECDEC_STEP | SPECDEC_PROMPT | SPECDEC_Q8A_BOTH, SPECDEC_EVERY_ISA, \
      "d * q + m, q in 0..31")

enum {
#define SPECDEC_KIND_ID(NAME, ID, ...) SPECDEC_W_##NAME = ID,
    SPECDEC_WEIGHT_KINDS(SPECDEC_KIND_ID)
#undef SPECDEC_KIND_ID
    SPECDEC_W_EACH = -1,  // a model's linears each of its own kind (SPECDEC_MIXED: model_t.kinds and head_kind)
};
#define SPECDEC_KIND_ONE(...) +1
enum { SPECDEC_W_COUNT = 0 SPECDEC_WEIGHT_KINDS(SPECDEC_KIND_ONE) };
#undef SPECDEC_KIND_ONE
// Each element is its BYTES, and the ids are 0..SPECDEC_W_COUNT - 1 (internal.h's array, indexed by them, refuses a
// repeated one). Every element packs without padding, so these sizes also fix every field's offset (kinds.py).
#define SPECDEC_KIND_ASSERT(NAME, ID, ELEMENT, BYTES, PER, ...) \
    SPECDEC_STATIC_ASSERT(sizeof(ELEMENT) == BYTES && ID >= 0 && ID < SPECDEC_W_COUNT && PER >= 1, \
                          "the weight kind " #NAME " as the table gives it");
SPECDEC_WEIGHT_KINDS(SPECDEC_KIND_ASSERT)
#undef SPECDEC_KIND_ASSERT

// How a target holds its linear weights, head and embedding (model_t.kind): the GGUF grids, or rows [N, K] of a
// checkpoint's own precision (activations fp32, or int8 where specdec_forward's SPECDEC_ACT_INT8 says). A model whose linears are blocks has its
// embedding fp32, or reads it from the head's blocks (model_t.embedding_rows); one of rows has it in rows of LINEAR.
// X(NAME, ID, LINEAR, HEAD): SPECDEC_<NAME> = ID; lowercased, NAME is the layout a bundle's native record names
//   LINEAR, HEAD  the weight kinds of its linears and its head (SPECDEC_W_EACH: model_t.kinds, model_t.head_kind)
#define SPECDEC_MODEL_KINDS(X) \
    X(Q41,   0, SPECDEC_W_Q41,  SPECDEC_W_Q80)  \
    X(BF16,  1, SPECDEC_W_BF16, SPECDEC_W_BF16) \
    X(F16,   2, SPECDEC_W_F16,  SPECDEC_W_F16)  \
    X(F32,   3, SPECDEC_W_F32,  SPECDEC_W_F32)  \
    X(Q80,   4, SPECDEC_W_Q80,  SPECDEC_W_Q80)  \
    X(MIXED, 5, SPECDEC_W_EACH, SPECDEC_W_EACH)  // a K-quant GGUF's: each linear and the head in blocks of its grid

enum {
#define SPECDEC_MODEL_ID(NAME, ID, ...) SPECDEC_##NAME = ID,
    SPECDEC_MODEL_KINDS(SPECDEC_MODEL_ID)
#undef SPECDEC_MODEL_ID
};
#define SPECDEC_MODEL_ONE(...) +1
enum { SPECDEC_MODEL_COUNT = 0 SPECDEC_MODEL_KINDS(SPECDEC_MODEL_ONE) };
#undef SPECDEC_MODEL_ONE

#endif

// Small-batch matmuls on GGUF's Q8_0, Q5_0, Q5_1, K-quant (Q4_K, Q5_K, Q6_K) and IQ4_NL / IQ4_XS weights, repacked once at load
// into tiles of 16 output columns: y[M, N] = x[M, K] W[N, K]^T for M = 1..16 rows a call.
//
// The activations are q4.h's: each row on its own, in blocks of 32, to int8 (d, s = d sum(q), and
// the integer sums of each block and of each half block). Per output column n and block b of 32:
//   - an exact int32 dot of the weights' unsigned integers u and the int8 row q, less the weights'
//     zero point z times the row's integer sum:  dot = sum(u q) - z sum(q), over each of the
//     block's `halves` (1, or 2 halves of 16 where the type scales every 16 weights: Q6_K);
//   - then float32, in order:  acc = fma(float(dot_h), scale_h * d, acc)   for h = 0, (1)
//                              acc = fma(offset, s, acc)                    (Q4_K, Q5_K only)
//     where scale_h and offset are the column's exact float32 factors of that block:
//       Q8_0: u = q_w + 128, z = 128, scale = d_w                      (w = d_w q_w, q_w -128..127)
//       Q4_K: u = q_w (0..15), z = 0, scale = d_w sc_j, offset = -dmin_w m_j   (w = d sc q - dmin m)
//       Q5_K: as Q4_K with u = q_w (0..31)
//       Q6_K: u = q_w + 32 (0..63), z = 32, scale_h = d_w sc_s for s = 2b + h   (w = d sc q_w)
//       Q5_0: u = q_w (0..31), z = 16, scale = d_w                   (w = d (q - 16))
//       Q5_1: u = q_w (0..31), z = 0, scale = d_w, offset = m_w      (w = d q + m)
//       IQ4_NL: u = kv[i] + 128 (1..241), z = 128, scale = d_w       (w = d kv[i], ggml's 16 values)
//       IQ4_XS: as IQ4_NL with scale = d_w (ls_j - 32) for a 6-bit ls_j per 32
//     (float16 d times a 6- or 8-bit integer is exact in float32, so the factors are the file's
//     own values, whatever order they are formed in.)
// So a row's result depends on that row and W only: not on M, the thread count (columns are split,
// never K) or the ISA; every ISA file gives the reference's bits (tests/native/test_kquant_kernel.py).
// The activations' blocks of 32 differ from llama.cpp's Q8_K (one scale per 256): finer, so a
// product is at least as close to the float one (scripts/kernel_accuracy.py re-measures).
#pragma once
#include <cstdint>

#include "q4.h"

#define KQ_COLS 16      // output columns per tile
#define KQ_SUPER 256    // weights per K-quant super-block along K
#define KQ_BLOCKS 8     // blocks of 32 per super-block

// GGUF's type ids (ggml.h's ggml_type), which name a weight's tiles
enum kq_type { KQ_Q5_0 = 6, KQ_Q5_1 = 7, KQ_Q8_0 = 8, KQ_Q4_K = 12, KQ_Q5_K = 13, KQ_Q6_K = 14, KQ_IQ4_NL = 20, KQ_IQ4_XS = 23 };

// IQ4_NL's and IQ4_XS's 16 values (ggml's kvalues_iq4nl), each plus 128: the unsigned u a 4-bit index stands for
#define KQ_IQ4_VALUES_U8 1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241

// Q8_0: one tile per 16 columns x 32 inputs.
struct q8_0_tile {
    // u[64 i + 4 c + t] = q_w[c][4 i + t] + 128, i = 0..7, c = column 0..15, t = 0..3: each 64 bytes
    // one VNNI operand, 4 consecutive k of 16 columns, one 32-bit lane a column
    uint8_t u[512];
    uint16_t d[KQ_COLS];  // float16 scale of each column's block
};
static_assert(sizeof(q8_0_tile) == 544, "wrong q8_0 tile size/padding");

// Q4_K: one tile per 16 columns x 256 inputs (a super-block); block j = inputs 32 j .. 32 j + 31.
struct q4_k_tile {
    uint8_t nibbles[KQ_BLOCKS][256];  // block j in q4_tile's nibble order (q4.h)
    uint8_t sc[KQ_BLOCKS][KQ_COLS];   // 6-bit scale of block j, column c
    uint8_t m[KQ_BLOCKS][KQ_COLS];    // 6-bit min of block j, column c
    uint16_t d[KQ_COLS];              // float16 super-block scale of each column
    uint16_t dmin[KQ_COLS];           // float16 super-block min scale
};
static_assert(sizeof(q4_k_tile) == 2368, "wrong q4_K tile size/padding");

// Q5_K: Q4_K's tile and each weight's fifth bit.
struct q5_k_tile {
    q4_k_tile low;  // the low 4 bits, scales and mins
    // high[j][4 c + t] bit i = bit 4 of q_w[c][32 j + 4 i + t], i = 0..7: one byte a VNNI byte slot
    uint8_t high[KQ_BLOCKS][64];
};
static_assert(sizeof(q5_k_tile) == 2880, "wrong q5_K tile size/padding");

// Q6_K: one tile per 16 columns x 256 inputs; 16 sub-blocks of 16, each with its own 8-bit scale.
struct q6_k_tile {
    uint8_t nibbles[KQ_BLOCKS][256];  // the low 4 bits of u = q_w + 32, in q4_tile's nibble order
    // high[j][h][4 c + t] bits 2 i'..2 i' + 1 = bits 4..5 of u[c][32 j + 16 h + 4 i' + t], i' = 0..3
    uint8_t high[KQ_BLOCKS][2][64];
    int8_t sc[2 * KQ_BLOCKS][KQ_COLS];  // scale of sub-block s (inputs 16 s .. 16 s + 15), column c
    uint16_t d[KQ_COLS];                // float16 super-block scale
};
static_assert(sizeof(q6_k_tile) == 3360, "wrong q6_K tile size/padding");

// Q5_0: one tile per 16 columns x 32 inputs.
struct q5_0_tile {
    uint8_t nibbles[256];  // the low 4 bits of u, in q4_tile's order
    uint8_t high[64];      // high[4 c + t] bit i = bit 4 of u[c][4 i + t] (as q5_k_tile's)
    uint16_t d[KQ_COLS];   // float16 scale of each column's block
};
static_assert(sizeof(q5_0_tile) == 352, "wrong q5_0 tile size/padding");

// Q5_1: Q5_0's tile and each column's float16 min.
struct q5_1_tile {
    q5_0_tile low;
    uint16_t m[KQ_COLS];
};
static_assert(sizeof(q5_1_tile) == 384, "wrong q5_1 tile size/padding");

// IQ4_NL: one tile per 16 columns x 32 inputs; each nibble indexes the 16 values.
struct iq4_nl_tile {
    uint8_t nibbles[256];  // indices in q4_tile's order
    uint16_t d[KQ_COLS];
};
static_assert(sizeof(iq4_nl_tile) == 288, "wrong iq4_nl tile size/padding");

// IQ4_XS: one tile per 16 columns x 256 inputs.
struct iq4_xs_tile {
    uint8_t nibbles[KQ_BLOCKS][256];  // indices of block j in q4_tile's order
    int8_t sc[KQ_BLOCKS][KQ_COLS];    // ls_j - 32 of block j, column c
    uint16_t d[KQ_COLS];
};
static_assert(sizeof(iq4_xs_tile) == 2208, "wrong iq4_xs tile size/padding");

// Rows 0..M-1 (M <= 16) times the column block whose tiles begin at `tiles` (kb blocks of 32 along K)
// -> y[m * ldy + c], c = 0..15. `rows[m].sum16` must be set for Q6_K.
typedef void (*kq_block_fn)(const uint8_t* tiles, int kb, const q8_row* rows, int M, float* y, long ldy);

struct kq_kernels {
    kq_block_fn q8_0, q4_k, q5_k, q6_k, q5_0, q5_1, iq4_nl, iq4_xs;
};
extern const kq_kernels kq_ref, kq_avx2, kq_avx512vnni;

// Column c (0..15) of a column block's tiles as floats [kb * 32]: each weight as the file's blocks
// define it (gguf's dequantize, bit for bit), for looking up embedding rows in the head's tiles.
void kq_row_ref(const uint8_t* tiles, int type, int kb, int c, float* out);

// Inputs one block of the type spans in the file (what K must be a multiple of).
inline int kq_block_inputs(int type) {
    return type == KQ_Q4_K || type == KQ_Q5_K || type == KQ_Q6_K || type == KQ_IQ4_XS ? KQ_SUPER : 32;
}

// Bytes of tiles per block of 32 inputs of a 16-column block (a super-block's share for K-quants).
inline long kq_block_bytes(int type) {
    switch (type) {
        case KQ_Q8_0: return sizeof(q8_0_tile);
        case KQ_Q4_K: return sizeof(q4_k_tile) / KQ_BLOCKS;
        case KQ_Q5_K: return sizeof(q5_k_tile) / KQ_BLOCKS;
        case KQ_Q6_K: return sizeof(q6_k_tile) / KQ_BLOCKS;
        case KQ_Q5_0: return sizeof(q5_0_tile);
        case KQ_Q5_1: return sizeof(q5_1_tile);
        case KQ_IQ4_NL: return sizeof(iq4_nl_tile);
        case KQ_IQ4_XS: return sizeof(iq4_xs_tile) / KQ_BLOCKS;
        default: return 0;
    }
}

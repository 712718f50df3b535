// Small-batch matmuls on GGUF's F16 and BF16 matrices, repacked once at load into tiles of 16 output
// columns: y[M, N] = x[M, K] W[N, K]^T for any M (16 rows a call), x float32 (bfloat16 x widened).
//
// A column block's tile holds its weights k-major, the file's own 16-bit values: w[k][c] for
// k = 0..K-1, c = 0..15, 32 bytes a k, so one load gives 16 columns of one input. Both types widen
// to float32 exactly. Per output column n and row m, four float32 partial sums over the inputs
// k = j (mod 4), j = 0..3, each in order of k, then one fixed sum:
//     p_j = fma(x[m][k], float(w[k][n]), p_j)        k = j, j + 4, j + 8, ...
//     y[m][n] = (p_0 + p_1) + (p_2 + p_3)
// So a row's result depends on that row and W only: not on M, the thread count (columns are split,
// never K) or the ISA; every ISA file gives the reference's bits (tests/native/test_f16_kernel.py).
// The activations stay float32 (llama.cpp rounds them to the weight's type first): the product is
// the float product of the file's weights, up to float32 rounding.
#pragma once
#include <cstdint>

#define FX_COLS 16   // output columns per tile
#define FX_CHAINS 4  // partial sums a column (the FMA latency a one-row call hides)

// GGUF's type ids (ggml.h's ggml_type)
enum fx_type { FX_F16 = 1, FX_BF16 = 30 };

inline bool fx_is(int64_t type) { return type == FX_F16 || type == FX_BF16; }

// Rows 0..M-1 of x (row m at x + m * ldx, K floats; M <= 16) times the column block whose tile begins
// at `tile` (K x 16 values of `type`) -> y[m * ldy + c], c = 0..15.
typedef void (*fx_block_fn)(const uint16_t* tile, int type, int K, const float* x, long ldx, int M, float* y,
                            long ldy);

extern const fx_block_fn fx_block_ref, fx_block_avx2, fx_block_avx512;

// Column c (0..15) of a column block's tile as floats [K] (an embedding row looked up in the head's tile).
void fx_row_ref(const uint16_t* tile, int type, int K, int c, float* out);

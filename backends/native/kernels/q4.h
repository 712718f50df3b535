// Small-batch 4-bit matmul: y[M, N] = x[M, K] W[N, K]^T for M = 1..16 rows, W in 4-bit groups.
//
// Numerics (the same in every ISA file, so every path gives the reference's bits):
//  - each row of x is quantized on its own, in blocks of 32, to int8 (llama.cpp's q8_1):
//    d = max|x| / 127, q = round-to-nearest-even(x * (1 / d)), s = d * sum(q);
//  - per output column n and block b, an exact int32 dot of the 4-bit weights and the int8 row;
//  - then float32, blocks in order b = 0, 1, ...:  acc = fma(float(dot), d_w * d, acc);
//                                                 acc = fma(m_w, s, acc)
//    (w = d_w * q_w + m_w, q_w in 0..15, as GGUF Q4_1).
// A row's result depends on nothing but that row and W: not on M, not on the thread count (work
// is split over columns only, never over K), not on the ISA.
#pragma once
#include <cstdint>
#include <cstring>

// IEEE float16 -> float32, exact (as F16C's vcvtph2ps)
inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);  // inf, nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalize
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

#define Q4_BLOCK 32  // weights per group along K
#define Q4_COLS 16   // output columns per tile

// One tile: 16 output columns x 32 inputs, 320 bytes, tiles of a column block consecutive in K.
struct q4_tile {
    // nibbles[64 g + 4 c + t], g = 0..3, c = column 0..15, t = 0..3:
    //   low nibble  = q_w[c][4 g + t]        (k 0..15)
    //   high nibble = q_w[c][16 + 4 g + t]   (k 16..31)
    // so that the low (or high) nibbles of 64 bytes are one VNNI operand: 4 consecutive k of
    // each of 16 columns, one 32-bit lane a column.
    //   byte:   [c0: k0 k1 k2 k3][c1: k0 k1 k2 k3] ... [c15: k0 k1 k2 k3]   (g = 0, low nibbles)
    uint8_t nibbles[256];
    uint16_t d[Q4_COLS];  // float16 scale of each column's group
    uint16_t m[Q4_COLS];  // float16 offset of each column's group
};
static_assert(sizeof(q4_tile) == 320, "wrong q4 tile size/padding");

// A row of x quantized as above: q [K]; d, s and the blocks' integer sums [K / 32].
struct q8_row {
    const int8_t* q;
    const float* d;
    const float* s;
    const int32_t* sum;
    const int32_t* sum16;  // the integer sums of each half block [K / 16] (kquant.h's Q6_K)
};

// Columns 16 nb .. 16 nb + 15 of rows 0..M-1 (M <= 16): tiles of that column block [K / 32];
// y[m * ldy + c] for c = 0..15.
typedef void (*q4_block_fn)(const q4_tile* tiles, int kb, const q8_row* rows, int M, float* y, long ldy);

void q4_block_ref(const q4_tile* tiles, int kb, const q8_row* rows, int M, float* y, long ldy);
void q4_block_avx2(const q4_tile* tiles, int kb, const q8_row* rows, int M, float* y, long ldy);
void q4_block_avx512vnni(const q4_tile* tiles, int kb, const q8_row* rows, int M, float* y, long ldy);

// Column c (0..15) of a column block's tiles as floats d q + m [kb * 32] (an embedding row).
void q4_row_ref(const q4_tile* tiles, int kb, int c, float* out);

// Quantize x [K] (K % 32 == 0) into q [K], d, s, sum [K / 32] (q8_row's layout).
typedef void (*q8_quantize_fn)(const float* x, int K, int8_t* q, float* d, float* s, int32_t* sum);

void q8_quantize_ref(const float* x, int K, int8_t* q, float* d, float* s, int32_t* sum);
void q8_quantize_avx2(const float* x, int K, int8_t* q, float* d, float* s, int32_t* sum);
void q8_quantize_avx512vnni(const float* x, int K, int8_t* q, float* d, float* s, int32_t* sum);

// ---- the LM head's approximate logits (argmax_head.py) ----
// W [V, K] int8 (-127..127) with one float32 scale a row; x quantized as above. Per row v and
// block b an exact int32 dot, then float32 over blocks in order: acc = fma(float(dot), d, acc);
// logit = acc * scale[v].
struct q8_tile {
    // w[64 i + 4 r + t] = W[r][4 i + t] + 128 (unsigned), i = 0..7, r = row 0..15, t = 0..3:
    // 64 bytes are one VNNI operand, 4 consecutive k of 16 rows
    uint8_t w[512];
};
static_assert(sizeof(q8_tile) == 512, "wrong q8 tile size/padding");

// Head rows 16 vb .. 16 vb + 15 for activation rows 0..M-1 (M <= 16): the tiles of that row
// block [K / 32], their scales [16]; y[m * ldy + r] for r = 0..15.
typedef void (*q8_head_fn)(const q8_tile* tiles, int kb, const float* scale, const q8_row* rows, int M,
                           float* y, long ldy);

void q8_head_ref(const q8_tile* tiles, int kb, const float* scale, const q8_row* rows, int M, float* y, long ldy);
void q8_head_avx2(const q8_tile* tiles, int kb, const float* scale, const q8_row* rows, int M, float* y, long ldy);
void q8_head_avx512vnni(const q8_tile* tiles, int kb, const float* scale, const q8_row* rows, int M, float* y,
                        long ldy);

// ---- the float32 logits the head's choice is made from (argmax_head.py) ----
// One fixed summation order for a token's logit w . x (K % 16 == 0), so that a row's choice never
// depends on which other rows or tokens are computed with it: 16 partial sums, lane j over
// k = j, j + 16, ..., each step s[j] = s[j] + w[k] x[k] (product and sum each rounded to float32,
// never fused), then the lanes folded in halves: s[j] += s[j + 8], s[j] += s[j + 4], s[j] += s[j + 2],
// s[0] + s[1]. Plain IEEE float32 operations, so any vector width gives the same bits.
#define HEAD_DOT_LANES 16

typedef float (*head_dot_fn)(const float* w, const float* x, long K);
float head_dot_ref(const float* w, const float* x, long K);
float head_dot_avx512vnni(const float* w, const float* x, long K);

// ---- the head's candidates (q4_op.cpp head_candidates) ----
// Over tokens v of [0, V): bound = c0 w0[v] + c1 w1[v] (two products, then their sum); low / high
// = the max of A[v] - bound / A[v] + bound (a max is exact in any order).
typedef void (*head_range_fn)(const float* A, const float* w0, const float* w1, float c0, float c1, long V,
                              float* low, float* high);
// The tokens v (ascending, into ids) whose A[v] + bound >= floor; returns how many.
typedef long (*head_pick_fn)(const float* A, const float* w0, const float* w1, float c0, float c1, long V,
                             float floor, int32_t* ids);
void head_range_ref(const float* A, const float* w0, const float* w1, float c0, float c1, long V, float* low,
                    float* high);
long head_pick_ref(const float* A, const float* w0, const float* w1, float c0, float c1, long V, float floor,
                   int32_t* ids);
void head_range_avx512vnni(const float* A, const float* w0, const float* w1, float c0, float c1, long V, float* low,
                           float* high);
long head_pick_avx512vnni(const float* A, const float* w0, const float* w1, float c0, float c1, long V, float floor,
                          int32_t* ids);

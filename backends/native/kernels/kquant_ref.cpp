// The reference: scalar C++ that defines kquant.h's arithmetic; every ISA file must give its bits.
#include <cmath>

#include "kquant.h"

namespace {

// A nibble of block j's q4_tile-ordered bytes: weight k (0..31) of column c.
int nibble(const uint8_t* nibbles, int c, int k) {
    uint8_t byte = nibbles[64 * ((k / 4) % 4) + 4 * c + k % 4];
    return k < 16 ? byte & 0x0F : byte >> 4;
}

// Each type's view of block b of a column block: its unsigned weight u(c, k), its zero point, its
// float32 scale of half h and its offset (kquant.h).
struct Q8_0 {
    static constexpr int halves = 1, zero = 128;
    static constexpr bool has_min = false;
    const q8_0_tile& t;
    Q8_0(const uint8_t* tiles, int b) : t(reinterpret_cast<const q8_0_tile*>(tiles)[b]) {}
    int u(int c, int k) const { return t.u[64 * (k / 4) + 4 * c + k % 4]; }
    float scale(int c, int) const { return half_to_float(t.d[c]); }
    float offset(int) const { return 0.0f; }
};

struct Q4_K {
    static constexpr int halves = 1, zero = 0;
    static constexpr bool has_min = true;
    const q4_k_tile& t;
    int j;
    Q4_K(const uint8_t* tiles, int b, long stride = sizeof(q4_k_tile))
        : t(*reinterpret_cast<const q4_k_tile*>(tiles + (b / KQ_BLOCKS) * stride)), j(b % KQ_BLOCKS) {}
    int u(int c, int k) const { return nibble(t.nibbles[j], c, k); }
    float scale(int c, int) const { return half_to_float(t.d[c]) * (float)t.sc[j][c]; }
    float offset(int c) const { return -(half_to_float(t.dmin[c]) * (float)t.m[j][c]); }
};

struct Q5_K : Q4_K {
    const uint8_t* high;
    Q5_K(const uint8_t* tiles, int b)
        : Q4_K(tiles, b, sizeof(q5_k_tile)),
          high(reinterpret_cast<const q5_k_tile*>(tiles)[b / KQ_BLOCKS].high[b % KQ_BLOCKS]) {}
    int u(int c, int k) const { return Q4_K::u(c, k) | ((high[4 * c + k % 4] >> (k / 4)) & 1) << 4; }
};

struct Q6_K {
    static constexpr int halves = 2, zero = 32;
    static constexpr bool has_min = false;
    const q6_k_tile& t;
    int j;
    Q6_K(const uint8_t* tiles, int b)
        : t(reinterpret_cast<const q6_k_tile*>(tiles)[b / KQ_BLOCKS]), j(b % KQ_BLOCKS) {}
    int u(int c, int k) const {
        return nibble(t.nibbles[j], c, k) | ((t.high[j][k / 16][4 * c + k % 4] >> (2 * (k / 4 % 4))) & 3) << 4;
    }
    float scale(int c, int h) const { return half_to_float(t.d[c]) * (float)t.sc[2 * j + h][c]; }
    float offset(int) const { return 0.0f; }
};

struct Q5_0 {
    static constexpr int halves = 1, zero = 16;
    static constexpr bool has_min = false;
    const q5_0_tile& t;
    Q5_0(const uint8_t* tiles, int b, long stride = sizeof(q5_0_tile))
        : t(*reinterpret_cast<const q5_0_tile*>(tiles + b * stride)) {}
    int u(int c, int k) const { return nibble(t.nibbles, c, k) | ((t.high[4 * c + k % 4] >> (k / 4)) & 1) << 4; }
    float scale(int c, int) const { return half_to_float(t.d[c]); }
    float offset(int) const { return 0.0f; }
};

struct Q5_1 : Q5_0 {
    static constexpr int zero = 0;
    static constexpr bool has_min = true;
    const uint16_t* m;
    Q5_1(const uint8_t* tiles, int b)
        : Q5_0(tiles, b, sizeof(q5_1_tile)), m(reinterpret_cast<const q5_1_tile*>(tiles)[b].m) {}
    float offset(int c) const { return half_to_float(m[c]); }
};

constexpr uint8_t IQ4_U[16] = {KQ_IQ4_VALUES_U8};

struct IQ4_NL {
    static constexpr int halves = 1, zero = 128;
    static constexpr bool has_min = false;
    const iq4_nl_tile& t;
    IQ4_NL(const uint8_t* tiles, int b) : t(reinterpret_cast<const iq4_nl_tile*>(tiles)[b]) {}
    int u(int c, int k) const { return IQ4_U[nibble(t.nibbles, c, k)]; }
    float scale(int c, int) const { return half_to_float(t.d[c]); }
    float offset(int) const { return 0.0f; }
};

struct IQ4_XS {
    static constexpr int halves = 1, zero = 128;
    static constexpr bool has_min = false;
    const iq4_xs_tile& t;
    int j;
    IQ4_XS(const uint8_t* tiles, int b)
        : t(reinterpret_cast<const iq4_xs_tile*>(tiles)[b / KQ_BLOCKS]), j(b % KQ_BLOCKS) {}
    int u(int c, int k) const { return IQ4_U[nibble(t.nibbles[j], c, k)]; }
    float scale(int c, int) const { return half_to_float(t.d[c]) * (float)t.sc[j][c]; }
    float offset(int) const { return 0.0f; }
};

template <class T>
void block_ref(const uint8_t* tiles, int kb, const q8_row* rows, int M, float* y, long ldy) {
    constexpr int span = Q4_BLOCK / T::halves;  // inputs a scale covers within the block
    for (int m = 0; m < M; m++) {
        const q8_row& x = rows[m];
        for (int c = 0; c < KQ_COLS; c++) {
            float acc = 0.0f;
            for (int b = 0; b < kb; b++) {
                const T w(tiles, b);
                for (int h = 0; h < T::halves; h++) {
                    int32_t dot = 0;
                    for (int k = h * span; k < (h + 1) * span; k++) dot += w.u(c, k) * x.q[b * Q4_BLOCK + k];
                    dot -= T::zero * (T::halves == 1 ? x.sum[b] : x.sum16[2 * b + h]);
                    acc = std::fmaf((float)dot, w.scale(c, h) * x.d[b], acc);
                }
                if (T::has_min) acc = std::fmaf(w.offset(c), x.s[b], acc);
            }
            y[m * ldy + c] = acc;
        }
    }
}

}  // namespace

const kq_kernels kq_ref = {block_ref<Q8_0>, block_ref<Q4_K>, block_ref<Q5_K>, block_ref<Q6_K>,
                           block_ref<Q5_0>, block_ref<Q5_1>, block_ref<IQ4_NL>, block_ref<IQ4_XS>};

namespace {

template <class T>
void row_of(const uint8_t* tiles, int kb, int c, float* out) {
    constexpr int span = Q4_BLOCK / T::halves;
    for (int b = 0; b < kb; b++) {
        const T w(tiles, b);
        for (int k = 0; k < Q4_BLOCK; k++) {  // gguf's dequantize, bit for bit (kquant.py)
            const float q = (float)(w.u(c, k) - T::zero);
            out[b * Q4_BLOCK + k] = T::has_min ? w.scale(c, 0) * q + w.offset(c) : w.scale(c, k / span) * q;
        }
    }
}

}  // namespace

void kq_row_ref(const uint8_t* tiles, int type, int kb, int c, float* out) {
    switch (type) {
        case KQ_Q8_0: return row_of<Q8_0>(tiles, kb, c, out);
        case KQ_Q4_K: return row_of<Q4_K>(tiles, kb, c, out);
        case KQ_Q5_K: return row_of<Q5_K>(tiles, kb, c, out);
        case KQ_Q6_K: return row_of<Q6_K>(tiles, kb, c, out);
        case KQ_Q5_0: return row_of<Q5_0>(tiles, kb, c, out);
        case KQ_Q5_1: return row_of<Q5_1>(tiles, kb, c, out);
        case KQ_IQ4_NL: return row_of<IQ4_NL>(tiles, kb, c, out);
        case KQ_IQ4_XS: return row_of<IQ4_XS>(tiles, kb, c, out);
    }
}

// The reference: scalar C++ that defines f16.h's arithmetic; every ISA file must give its bits.
#include <cmath>
#include <cstring>

#include "f16.h"
#include "q4.h"

namespace {

inline float widen(uint16_t v, int type) {
    if (type == FX_F16) return half_to_float(v);
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

void block(const uint16_t* tile, int type, int K, const float* x, long ldx, int M, float* y, long ldy) {
    for (int m = 0; m < M; m++)
        for (int c = 0; c < FX_COLS; c++) {
            float p[FX_CHAINS] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int k = 0; k < K; k++)
                p[k % FX_CHAINS] = std::fma(x[m * ldx + k], widen(tile[(long)k * FX_COLS + c], type), p[k % FX_CHAINS]);
            y[m * ldy + c] = (p[0] + p[1]) + (p[2] + p[3]);
        }
}

}  // namespace

const fx_block_fn fx_block_ref = block;

void fx_row_ref(const uint16_t* tile, int type, int K, int c, float* out) {
    for (int k = 0; k < K; k++) out[k] = widen(tile[(long)k * FX_COLS + c], type);
}

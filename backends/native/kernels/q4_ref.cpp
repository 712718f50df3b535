// The reference: scalar C++ that defines q4.h's arithmetic; every ISA file must give its bits.
#include <cmath>
#include <cstring>

#include "q4.h"

// IEEE float16 -> float32, exact (as F16C's vcvtph2ps)
static float half_to_float(uint16_t h) {
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

static int weight(const q4_tile& t, int c, int k) {  // q_w[c][k], k = 0..31 (see q4_tile)
    uint8_t byte = t.nibbles[64 * ((k / 4) % 4) + 4 * c + k % 4];
    return k < 16 ? byte & 0x0F : byte >> 4;
}

void q4_block_ref(const q4_tile* tiles, int kb, const q8_row* rows, int M, float* y, long ldy) {
    for (int m = 0; m < M; m++) {
        const q8_row& x = rows[m];
        for (int c = 0; c < Q4_COLS; c++) {
            float acc = 0.0f;
            for (int b = 0; b < kb; b++) {
                const q4_tile& t = tiles[b];
                int32_t dot = 0;
                for (int k = 0; k < Q4_BLOCK; k++) dot += weight(t, c, k) * x.q[b * Q4_BLOCK + k];
                acc = std::fmaf((float)dot, half_to_float(t.d[c]) * x.d[b], acc);
                acc = std::fmaf(half_to_float(t.m[c]), x.s[b], acc);
            }
            y[m * ldy + c] = acc;
        }
    }
}

void q8_head_ref(const q8_tile* tiles, int kb, const float* scale, const q8_row* rows, int M, float* y, long ldy) {
    for (int m = 0; m < M; m++)
        for (int r = 0; r < 16; r++) {
            float acc = 0.0f;
            for (int b = 0; b < kb; b++) {
                int32_t dot = 0;
                for (int k = 0; k < Q4_BLOCK; k++)
                    dot += ((int)tiles[b].w[64 * (k / 4) + 4 * r + k % 4] - 128) * rows[m].q[b * Q4_BLOCK + k];
                acc = std::fmaf((float)dot, rows[m].d[b], acc);
            }
            y[m * ldy + r] = acc * scale[r];
        }
}

void q8_quantize_ref(const float* x, int K, int8_t* q, float* d, float* s, int32_t* sums) {
    for (int b = 0; b < K / Q4_BLOCK; b++) {
        const float* xb = x + b * Q4_BLOCK;
        float amax = 0.0f;
        for (int k = 0; k < Q4_BLOCK; k++) amax = std::fmax(amax, std::fabs(xb[k]));
        float scale = amax / 127.0f, inv = amax > 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0;
        for (int k = 0; k < Q4_BLOCK; k++) {
            int v = (int)std::nearbyintf(xb[k] * inv);  // the default rounding: nearest, ties to even
            q[b * Q4_BLOCK + k] = (int8_t)v;
            sum += v;
        }
        d[b] = scale;
        s[b] = scale * (float)sum;
        sums[b] = sum;
    }
}

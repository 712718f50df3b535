// The reference: scalar C++ that defines q4.h's arithmetic; every ISA file must give its bits.
#include <cmath>
#include <cstring>

#include "q4.h"

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

float head_dot_ref(const float* w, const float* x, long K) {
    float s[HEAD_DOT_LANES] = {};
    for (long k = 0; k < K; k += HEAD_DOT_LANES)
        for (int j = 0; j < HEAD_DOT_LANES; j++) s[j] += w[k + j] * x[k + j];
    for (int half = HEAD_DOT_LANES / 2; half >= 1; half /= 2)
        for (int j = 0; j < half; j++) s[j] += s[j + half];
    return s[0];
}

void head_range_ref(const float* A, const float* w0, const float* w1, float c0, float c1, long V, float* low,
                    float* high) {
    float best_low = -INFINITY, best_high = -INFINITY;
    for (long v = 0; v < V; v++) {
        const float bound = c0 * w0[v] + c1 * w1[v];
        best_low = std::fmax(best_low, A[v] - bound);
        best_high = std::fmax(best_high, A[v] + bound);
    }
    *low = best_low, *high = best_high;
}

long head_pick_ref(const float* A, const float* w0, const float* w1, float c0, float c1, long V, float floor,
                   int32_t* ids) {
    long n = 0;
    for (long v = 0; v < V; v++)
        if (A[v] + (c0 * w0[v] + c1 * w1[v]) >= floor) ids[n++] = (int32_t)v;
    return n;
}

void q4_row_ref(const q4_tile* tiles, int kb, int c, float* out) {
    for (int b = 0; b < kb; b++)
        for (int k = 0; k < Q4_BLOCK; k++)  // d q + m (GGUF Q4_1; Q4_0's offset -8 d is exact)
            out[b * Q4_BLOCK + k] = half_to_float(tiles[b].d[c]) * (float)weight(tiles[b], c, k) + half_to_float(tiles[b].m[c]);
}

// f16.h's tiles on AVX2: a k's 16 columns as two registers of 8, widened from 16 bits (vcvtph2ps for
// F16, a shift for BF16); one row at a time, its 4 partial sums in 8 registers.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "f16.h"

namespace {

constexpr long PREFETCH_VALUES = 4096;  // 8 KB ahead of the loads

template <int type>
inline __m256 widen(const uint16_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if (type == FX_F16) return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

template <int type>
void row(const uint16_t* tile, int K, const float* x, float* y) {
    __m256 p[FX_CHAINS][2];
    for (int j = 0; j < FX_CHAINS; j++) p[j][0] = p[j][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += FX_CHAINS) {
        const uint16_t* w = tile + (long)k * FX_COLS;
        _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_VALUES), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_VALUES + 32), _MM_HINT_T0);
        for (int j = 0; j < FX_CHAINS; j++) {
            const __m256 xk = _mm256_set1_ps(x[k + j]);
            p[j][0] = _mm256_fmadd_ps(xk, widen<type>(w + j * FX_COLS), p[j][0]);
            p[j][1] = _mm256_fmadd_ps(xk, widen<type>(w + j * FX_COLS + 8), p[j][1]);
        }
    }
    for (int h = 0; h < 2; h++)
        _mm256_storeu_ps(y + 8 * h, _mm256_add_ps(_mm256_add_ps(p[0][h], p[1][h]), _mm256_add_ps(p[2][h], p[3][h])));
}

void block(const uint16_t* tile, int type, int K, const float* x, long ldx, int M, float* y, long ldy) {
    for (int m = 0; m < M; m++) {
        if (type == FX_F16)
            row<FX_F16>(tile, K, x + m * ldx, y + m * ldy);
        else
            row<FX_BF16>(tile, K, x + m * ldx, y + m * ldy);
    }
}

}  // namespace

const fx_block_fn fx_block_avx2 = block;

// f16.h's tiles on AVX512: a k's 16 columns in one register, widened from 16 bits (vcvtph2ps for
// F16, a shift for BF16); up to 4 rows share each weight load, each row with its 4 partial sums.
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#include <immintrin.h>

#include "f16.h"

namespace {

constexpr long PREFETCH_VALUES = 4096;  // 8 KB ahead of the loads: the next part of the tile

template <int type>
inline __m512 widen(const uint16_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if (type == FX_F16) return _mm512_cvtph_ps(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

template <int type, int R>
void rows(const uint16_t* tile, int K, const float* x, long ldx, float* y, long ldy) {
    __m512 p[R][FX_CHAINS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < FX_CHAINS; j++) p[r][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += FX_CHAINS) {
        const uint16_t* w = tile + (long)k * FX_COLS;
        _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_VALUES), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_VALUES + 32), _MM_HINT_T0);
        __m512 v[FX_CHAINS];
        for (int j = 0; j < FX_CHAINS; j++) v[j] = widen<type>(w + j * FX_COLS);
        for (int r = 0; r < R; r++)
            for (int j = 0; j < FX_CHAINS; j++)
                p[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + j]), v[j], p[r][j]);
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(_mm512_add_ps(p[r][0], p[r][1]), _mm512_add_ps(p[r][2], p[r][3])));
}

template <int type>
void typed(const uint16_t* tile, int K, const float* x, long ldx, int M, float* y, long ldy) {
    int m = 0;
    for (; m + 4 <= M; m += 4) rows<type, 4>(tile, K, x + m * ldx, ldx, y + m * ldy, ldy);
    switch (M - m) {
        case 3: rows<type, 3>(tile, K, x + m * ldx, ldx, y + m * ldy, ldy); break;
        case 2: rows<type, 2>(tile, K, x + m * ldx, ldx, y + m * ldy, ldy); break;
        case 1: rows<type, 1>(tile, K, x + m * ldx, ldx, y + m * ldy, ldy); break;
        default: break;
    }
}

void block(const uint16_t* tile, int type, int K, const float* x, long ldx, int M, float* y, long ldy) {
    if (type == FX_F16)
        typed<FX_F16>(tile, K, x, ldx, M, y, ldy);
    else
        typed<FX_BF16>(tile, K, x, ldx, M, y, ldy);
}

}  // namespace

const fx_block_fn fx_block_avx512 = block;

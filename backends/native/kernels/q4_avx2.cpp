// q4.h's block on AVX2: a tile as two halves of 8 columns; the exact int32 dot from vpmaddubsw
// (u8 x s8, pairs summed into int16: at most 2 * 15 * 127, never saturating) and vpmaddwd.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "q4.h"

template <int M>
static void rows_avx2(const q4_tile* tiles, int kb, const q8_row* rows, int half, float* y, long ldy) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[M];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < kb; b++) {
        const q4_tile& t = tiles[b];
        __m256i w[8];  // w[i]: k 4i..4i+3 of columns 8 half .. 8 half + 7
        for (int g = 0; g < 4; g++) {
            __m256i packed = _mm256_loadu_si256((const __m256i*)(t.nibbles + 64 * g + 32 * half));
            w[g] = _mm256_and_si256(packed, low);
            w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        }
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t.d + 8 * half)));
        __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t.m + 8 * half)));
        for (int m = 0; m < M; m++) {
            const int8_t* xq = rows[m].q + b * Q4_BLOCK;
            __m256i dot = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) {
                __m256i x = _mm256_set1_epi32(*(const int32_t*)(xq + 4 * i));
                dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(w[i], x), ones));
            }
            __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(rows[m].d[b]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m]);
            acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(rows[m].s[b]), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) _mm256_storeu_ps(y + m * ldy + 8 * half, acc[m]);
}

void q4_block_avx2(const q4_tile* tiles, int kb, const q8_row* rows, int M, float* y, long ldy) {
    for (int half = 0; half < 2; half++)
        for (int m0 = 0; m0 < M; m0 += 4) {  // 4 rows at a time: 16 ymm registers
            const q8_row* r = rows + m0;
            float* out = y + m0 * ldy;
            switch (M - m0 < 4 ? M - m0 : 4) {
                case 1: rows_avx2<1>(tiles, kb, r, half, out, ldy); break;
                case 2: rows_avx2<2>(tiles, kb, r, half, out, ldy); break;
                case 3: rows_avx2<3>(tiles, kb, r, half, out, ldy); break;
                default: rows_avx2<4>(tiles, kb, r, half, out, ldy); break;
            }
        }
}

void q8_quantize_avx2(const float* x, int K, int8_t* q, float* d, float* s, int32_t* sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < K / Q4_BLOCK; b++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + b * Q4_BLOCK + 8 * j);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        float scale = amax / 127.0f, inv = amax > 0.0f ? 1.0f / scale : 0.0f;
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i qj = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)),
                                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            sum = _mm256_add_epi32(sum, qj);
            alignas(32) int32_t lanes[8];
            _mm256_store_si256((__m256i*)lanes, qj);
            for (int l = 0; l < 8; l++) q[b * Q4_BLOCK + 8 * j + l] = (int8_t)lanes[l];
        }
        alignas(32) int32_t part[8];
        _mm256_store_si256((__m256i*)part, sum);
        d[b] = scale;
        sums[b] = part[0] + part[1] + part[2] + part[3] + part[4] + part[5] + part[6] + part[7];
        s[b] = scale * (float)sums[b];
    }
}

// The head: signed weights (W + 128 back to -127..127) as |w| (unsigned) x sign(x, w), so that
// vpmaddubsw's pair sums (at most 2 * 127 * 127) never saturate: the exact dot, as on VNNI.
template <int M>
static void head_avx2(const q8_tile* tiles, int kb, const float* scale, const q8_row* rows, int half, float* y,
                      long ldy) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[M];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < kb; b++) {
        __m256i dot[M];
        for (int m = 0; m < M; m++) dot[m] = _mm256_setzero_si256();
        for (int i = 0; i < 8; i++) {
            __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(tiles[b].w + 64 * i + 32 * half)), flip);
            __m256i aw = _mm256_sign_epi8(w, w);
            for (int m = 0; m < M; m++) {
                __m256i x = _mm256_set1_epi32(*(const int32_t*)(rows[m].q + b * Q4_BLOCK + 4 * i));
                dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones));
            }
        }
        for (int m = 0; m < M; m++)
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_set1_ps(rows[m].d[b]), acc[m]);
    }
    __m256 sc = _mm256_loadu_ps(scale + 8 * half);
    for (int m = 0; m < M; m++) _mm256_storeu_ps(y + m * ldy + 8 * half, _mm256_mul_ps(acc[m], sc));
}

void q8_head_avx2(const q8_tile* tiles, int kb, const float* scale, const q8_row* rows, int M, float* y, long ldy) {
    for (int half = 0; half < 2; half++)
        for (int m0 = 0; m0 < M; m0 += 4) {
            const q8_row* r = rows + m0;
            float* out = y + m0 * ldy;
            switch (M - m0 < 4 ? M - m0 : 4) {
                case 1: head_avx2<1>(tiles, kb, scale, r, half, out, ldy); break;
                case 2: head_avx2<2>(tiles, kb, scale, r, half, out, ldy); break;
                case 3: head_avx2<3>(tiles, kb, scale, r, half, out, ldy); break;
                default: head_avx2<4>(tiles, kb, scale, r, half, out, ldy); break;
            }
        }
}

// q4.h's block on AVX512 with VNNI: one 32-bit lane per output column, vpdpbusd (u8 weights x
// s8 activations, 4 products a lane) for the exact int32 dot; 8 rows share the unpacked weights.
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx512vl,fma,f16c")
#include <immintrin.h>

#include <cmath>

#include "q4.h"

constexpr long Q4_PREFETCH_BYTES = 8192;  // how far ahead in the tiles (scripts/kquant_rows_bench.py)

template <int M>
static void rows_avx512(const q4_tile* tiles, int kb, const q8_row* rows, float* y, long ldy) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[M];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < kb; b++) {
        // the tiles ahead into the cache while this block computes: with several rows the work per
        // byte outgrows what the hardware prefetcher hides (as kquant_avx512vnni.cpp)
        for (int at = 0; at < (int)sizeof(q4_tile); at += 64)
            _mm_prefetch((const char*)(tiles + b) + Q4_PREFETCH_BYTES + at, _MM_HINT_T0);
        const q4_tile& t = tiles[b];
        __m512i w[8];  // w[i]: k 4i..4i+3 of each column, unsigned
        for (int g = 0; g < 4; g++) {
            __m512i packed = _mm512_loadu_si512(t.nibbles + 64 * g);
            w[g] = _mm512_and_si512(packed, low);
            w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        }
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)t.d));
        __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)t.m));
        // the int32 dots, rows interleaved and split into CH partial sums a row so that enough
        // independent vpdpbusd chains are in flight (integer sums: exact in any order)
        constexpr int CH = M < 4 ? 4 / M : 1;
        __m512i dot[M * CH];
        for (int j = 0; j < M * CH; j++) dot[j] = _mm512_setzero_si512();
        for (int i = 0; i < 8; i++)
            for (int m = 0; m < M; m++) {
                const int32_t x4 = *(const int32_t*)(rows[m].q + b * Q4_BLOCK + 4 * i);
                dot[m * CH + i % CH] = _mm512_dpbusd_epi32(dot[m * CH + i % CH], w[i], _mm512_set1_epi32(x4));
            }
        for (int m = 0; m < M; m++) {
            __m512i sum = dot[m * CH];
            for (int c = 1; c < CH; c++) sum = _mm512_add_epi32(sum, dot[m * CH + c]);
            __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(rows[m].d[b]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[m]);
            acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(rows[m].s[b]), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) _mm512_storeu_ps(y + m * ldy, acc[m]);
}

void q4_block_avx512vnni(const q4_tile* tiles, int kb, const q8_row* rows, int M, float* y, long ldy) {
    for (int m0 = 0; m0 < M; m0 += 8) {  // 8 rows at a time: accumulators and weights fit the registers
        const q8_row* r = rows + m0;
        float* out = y + m0 * ldy;
        switch (M - m0 < 8 ? M - m0 : 8) {
            case 1: rows_avx512<1>(tiles, kb, r, out, ldy); break;
            case 2: rows_avx512<2>(tiles, kb, r, out, ldy); break;
            case 3: rows_avx512<3>(tiles, kb, r, out, ldy); break;
            case 4: rows_avx512<4>(tiles, kb, r, out, ldy); break;
            case 5: rows_avx512<5>(tiles, kb, r, out, ldy); break;
            case 6: rows_avx512<6>(tiles, kb, r, out, ldy); break;
            case 7: rows_avx512<7>(tiles, kb, r, out, ldy); break;
            default: rows_avx512<8>(tiles, kb, r, out, ldy); break;
        }
    }
}

void q8_quantize_avx512vnni(const float* x, int K, int8_t* q, float* d, float* s, int32_t* sum) {
    for (int b = 0; b < K / Q4_BLOCK; b++) {
        __m512 lo = _mm512_loadu_ps(x + b * Q4_BLOCK), hi = _mm512_loadu_ps(x + b * Q4_BLOCK + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        float scale = amax / 127.0f, inv = amax > 0.0f ? 1.0f / scale : 0.0f;
        const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m512i qlo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, _mm512_set1_ps(inv)), round));
        __m512i qhi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, _mm512_set1_ps(inv)), round));
        _mm_storeu_si128((__m128i*)(q + b * Q4_BLOCK), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i*)(q + b * Q4_BLOCK + 16), _mm512_cvtepi32_epi8(qhi));
        d[b] = scale;
        sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        s[b] = scale * (float)sum[b];
    }
}

// The head: unsigned weights (W + 128) x signed activations, so the dot carries 128 * sum(q), taken
// off again exactly in int32.
template <int M>
static void head_avx512(const q8_tile* tiles, int kb, const float* scale, const q8_row* rows, float* y, long ldy) {
    __m512 acc[M];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < kb; b++) {
        constexpr int CH = M < 4 ? 4 / M : 1;  // independent vpdpbusd chains, as in rows_avx512
        __m512i dot[M * CH];
        for (int j = 0; j < M * CH; j++) dot[j] = _mm512_setzero_si512();
        for (int i = 0; i < 8; i++) {
            __m512i w = _mm512_loadu_si512(tiles[b].w + 64 * i);
            for (int m = 0; m < M; m++) {
                const int32_t x4 = *(const int32_t*)(rows[m].q + b * Q4_BLOCK + 4 * i);
                dot[m * CH + i % CH] = _mm512_dpbusd_epi32(dot[m * CH + i % CH], w, _mm512_set1_epi32(x4));
            }
        }
        for (int m = 0; m < M; m++) {
            __m512i sum = dot[m * CH];
            for (int c = 1; c < CH; c++) sum = _mm512_add_epi32(sum, dot[m * CH + c]);
            sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * rows[m].sum[b]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(rows[m].d[b]), acc[m]);
        }
    }
    __m512 sc = _mm512_loadu_ps(scale);
    for (int m = 0; m < M; m++) _mm512_storeu_ps(y + m * ldy, _mm512_mul_ps(acc[m], sc));
}

void q8_head_avx512vnni(const q8_tile* tiles, int kb, const float* scale, const q8_row* rows, int M, float* y,
                        long ldy) {
    for (int m0 = 0; m0 < M; m0 += 8) {
        const q8_row* r = rows + m0;
        float* out = y + m0 * ldy;
        switch (M - m0 < 8 ? M - m0 : 8) {
            case 1: head_avx512<1>(tiles, kb, scale, r, out, ldy); break;
            case 2: head_avx512<2>(tiles, kb, scale, r, out, ldy); break;
            case 3: head_avx512<3>(tiles, kb, scale, r, out, ldy); break;
            case 4: head_avx512<4>(tiles, kb, scale, r, out, ldy); break;
            case 5: head_avx512<5>(tiles, kb, scale, r, out, ldy); break;
            case 6: head_avx512<6>(tiles, kb, scale, r, out, ldy); break;
            case 7: head_avx512<7>(tiles, kb, scale, r, out, ldy); break;
            default: head_avx512<8>(tiles, kb, scale, r, out, ldy); break;
        }
    }
}

// head_dot (q4.h): 16 lanes of product-then-sum, folded in halves, as the reference does.
float head_dot_avx512vnni(const float* w, const float* x, long K) {
    __m512 s = _mm512_setzero_ps();
    for (long k = 0; k < K; k += 16) s = _mm512_add_ps(s, _mm512_mul_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k)));
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}

static inline __m512 head_bound(const float* w0, const float* w1, __m512 c0, __m512 c1, long v) {
    return _mm512_add_ps(_mm512_mul_ps(c0, _mm512_loadu_ps(w0 + v)), _mm512_mul_ps(c1, _mm512_loadu_ps(w1 + v)));
}

void head_range_avx512vnni(const float* A, const float* w0, const float* w1, float c0, float c1, long V, float* low,
                           float* high) {
    const __m512 vc0 = _mm512_set1_ps(c0), vc1 = _mm512_set1_ps(c1);
    __m512 lo = _mm512_set1_ps(-INFINITY), hi = lo;
    for (long v = 0; v < V; v += 16) {  // V % 16 == 0 (q8_head)
        const __m512 a = _mm512_loadu_ps(A + v), bound = head_bound(w0, w1, vc0, vc1, v);
        lo = _mm512_max_ps(lo, _mm512_sub_ps(a, bound));
        hi = _mm512_max_ps(hi, _mm512_add_ps(a, bound));
    }
    *low = _mm512_reduce_max_ps(lo), *high = _mm512_reduce_max_ps(hi);
}

long head_pick_avx512vnni(const float* A, const float* w0, const float* w1, float c0, float c1, long V, float floor,
                          int32_t* ids) {
    const __m512 vc0 = _mm512_set1_ps(c0), vc1 = _mm512_set1_ps(c1), vfloor = _mm512_set1_ps(floor);
    long n = 0;
    for (long v = 0; v < V; v += 16) {
        const __m512 upper = _mm512_add_ps(_mm512_loadu_ps(A + v), head_bound(w0, w1, vc0, vc1, v));
        for (unsigned hits = _mm512_cmp_ps_mask(upper, vfloor, _CMP_GE_OQ); hits; hits &= hits - 1)
            ids[n++] = (int32_t)(v + __builtin_ctz(hits));
    }
    return n;
}

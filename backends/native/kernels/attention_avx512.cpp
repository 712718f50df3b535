// Decode and verify attention over the KV cache on AVX512: n query rows, row i attending over
// keys [0, start + i + 1), each row's result from its own query and keys alone.
//
// Numerics: float32 throughout (bfloat16 caches widened exactly), in an order that depends on
// nothing but the row: a score is a 16-lane fused dot product over head_dim, reduced across lanes
// in _mm512_reduce_add_ps's fixed order, times 1 / sqrt(head_dim); the softmax in two passes over
// the row's keys (max; then exp, summed in 16 lanes by key index mod 16 and reduced the same way),
// the values summed in key order per dim and divided by that sum. Keys past the row's end are
// never read, so a row's bits do not depend on the cache's padding, on the other rows of the call
// or on the thread count.
#pragma GCC target("avx512f,avx512bw,avx512vl,fma")
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "attention.h"

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bfloat16 -> float32, exact
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// exp(x) for x <= 0 (shifted scores), 16 at a time: 2^n p(r), x = n ln2 + r, |r| <= ln2 / 2, a
// degree-6 polynomial (relative error ~2e-7); 0 below -87.
inline __m512 exp_nonpositive(__m512 x) {
    const __m512 low = _mm512_set1_ps(-87.0f);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2 in two parts (Cody-Waite)
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-06f), r);
    __m512 p = _mm512_set1_ps(0.00138883f);
    for (float c : {0.00833336f, 0.0416666418f, 0.166666672f, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ), _mm512_setzero_ps());
}

constexpr int MAX_DIM = 256, MAX_GROUP = 16;

// The G query heads of one kv head, one row: q [G][hd] over keys k, v [keys][hd] -> out [G][hd].
template <typename T>
void attend_group(const float* const* q, int G, const T* k, const T* v, int keys, int hd, float scale,
                  float* scores, float* const* out) {
    const int chunks = hd / 16;
    float best[MAX_GROUP];
    for (int g = 0; g < G; g++) best[g] = -INFINITY;
    for (int j = 0; j < keys; j++) {
        __m512 kj[MAX_DIM / 16];
        for (int c = 0; c < chunks; c++) kj[c] = load16(k + (long)j * hd + 16 * c);
        for (int g = 0; g < G; g++) {
            __m512 lanes = _mm512_mul_ps(load16(q[g]), kj[0]);
            for (int c = 1; c < chunks; c++) lanes = _mm512_fmadd_ps(load16(q[g] + 16 * c), kj[c], lanes);
            const float s = _mm512_reduce_add_ps(lanes) * scale;
            scores[g * keys + j] = s;
            best[g] = s > best[g] ? s : best[g];
        }
    }
    for (int g = 0; g < G; g++) {  // probabilities in place, and their sum
        float* sg = scores + g * keys;
        __m512 total = _mm512_setzero_ps();
        const __m512 shift = _mm512_set1_ps(best[g]);
        int j = 0;
        for (; j + 16 <= keys; j += 16) {
            __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sg + j), shift));
            _mm512_storeu_ps(sg + j, p);
            total = _mm512_add_ps(total, p);
        }
        if (j < keys) {
            const __mmask16 tail = (__mmask16)((1u << (keys - j)) - 1);
            __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sg + j), shift));
            p = _mm512_maskz_mov_ps(tail, p);
            _mm512_mask_storeu_ps(sg + j, tail, p);
            total = _mm512_add_ps(total, p);
        }
        best[g] = 1.0f / _mm512_reduce_add_ps(total);  // now the sum's reciprocal
    }
    __m512 acc[MAX_GROUP][MAX_DIM / 16];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_setzero_ps();
    for (int j = 0; j < keys; j++) {
        __m512 vj[MAX_DIM / 16];
        for (int c = 0; c < chunks; c++) vj[c] = load16(v + (long)j * hd + 16 * c);
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * keys + j]);
            for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_fmadd_ps(p, vj[c], acc[g][c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(out[g] + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(best[g])));
}

template <typename T>
void attend(const float* q, const T* k, const T* v, const AttentionShape& s, int row, int kv, float* out) {
    const int G = s.heads / s.kv_heads, keys = (int)(s.start + row + 1);
    thread_local std::vector<float> scores;
    scores.resize((size_t)G * keys);
    const float* qs[MAX_GROUP];
    float* outs[MAX_GROUP];
    for (int g = 0; g < G; g++) {
        qs[g] = q + ((long)(kv * G + g) * s.rows + row) * s.head_dim;
        outs[g] = out + (long)g * s.head_dim;
    }
    const long cache_head = (long)kv * s.cache_len * s.head_dim;
    attend_group(qs, G, k + cache_head, v + cache_head, keys, s.head_dim, 1.0f / std::sqrt((float)s.head_dim),
                 scores.data(), outs);
}

}  // namespace

bool attention_fits(int heads, int kv_heads, int head_dim) {
    return heads % kv_heads == 0 && heads / kv_heads <= MAX_GROUP && head_dim % 16 == 0 && head_dim <= MAX_DIM;
}

void attend_rows_avx512(const float* q, const void* k, const void* v, bool bf16_cache, const AttentionShape& s,
                        int row, int kv, float* out) {
    if (bf16_cache)
        attend(q, (const uint16_t*)k, (const uint16_t*)v, s, row, kv, out);
    else
        attend(q, (const float*)k, (const float*)v, s, row, kv, out);
}

// Decode and verify attention over the KV cache on AVX512: n query rows, row i attending over
// keys [0, start + i + 1) (a sliding-window layer's row over the last `window` of them), each row's
// result from its own query and keys alone.
//
// Numerics: float32 throughout (bfloat16 caches widened exactly), in an order that depends on
// nothing but the row: a score is a 16-lane fused dot product over head_dim, reduced across lanes
// in _mm512_reduce_add_ps's fixed order (lane i + lane i + 8, then i + 4, i + 2, i + 1), times
// 1 / sqrt(head_dim); the softmax in two passes over the row's keys (max; then exp, summed in 16
// lanes by key index mod 16 and reduced the same way), the values summed in key order per dim and
// divided by that sum. Keys past the row's end never enter its result, so a row's bits do not
// depend on the cache's padding, on the other rows of the call or on the thread count. A window
// only moves where a row's keys start: the same arithmetic over them.
//
// Work: one call per (kv head, block of rows). Below ATTENTION_BLOCK_KEYS keys each row reads the
// cache in place, one key at a time (`attend`). Past it, the block's keys and values are widened to float32
// once, into a scratch buffer every row and query head of the block then reads (at long contexts
// attention is most of a pass, and a verify row would otherwise widen them all again); scores are
// made 16 keys at a time, their 16 lane sums folded together (fold16) with the additions a
// reduce_add of each would make.
#pragma GCC target("avx512f,avx512bw,avx512vl,fma")
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "attention.h"

namespace {

constexpr int MAX_DIM = 256, MAX_GROUP = 16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bfloat16 -> float32, exact
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}


// keys [keys, hd] of the cache -> float32 rows in dst, zeros up to `padded` keys
void widen(const uint16_t* src, float* dst, long keys, long padded, int hd) {
    for (long i = 0; i < keys * hd; i += 16)  // bfloat16 -> float32, exact
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + i))), 16)));
    for (long i = keys * hd; i < padded * hd; i += 16) _mm512_storeu_ps(dst + i, _mm512_setzero_ps());
}
void widen(const float* src, float* dst, long keys, long padded, int hd) {
    for (long i = 0; i < keys * hd; i += 16) _mm512_storeu_ps(dst + i, _mm512_loadu_ps(src + i));
    for (long i = keys * hd; i < padded * hd; i += 16) _mm512_storeu_ps(dst + i, _mm512_setzero_ps());
}

// Sixteen horizontal sums at once, each with exactly the additions of _mm512_reduce_add_ps (lane
// i + lane i + 8, then i + 4, i + 2, i + 1), so a score has the bits one reduce_add would give.
// Lane 4 k + i of the result is the sum of x[4 i + k] (a 4 x 4 transpose: see `scores`).
inline __m512 fold16(const __m512* x) {
    __m512 y[8], z[4], w[2];
    for (int j = 0; j < 8; j++)  // y[j]: x[2j], x[2j+1], lanes i + (i + 8), 8 each
        y[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int j = 0; j < 4; j++)  // z[j]: 128-bit block k holds x[4j + k], lanes i + (i + 4)
        z[j] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * j], y[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(y[2 * j], y[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int j = 0; j < 2; j++)  // w[j]: block k holds x[8j + k] and x[8j + 4 + k], lanes i + (i + 2)
        w[j] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * j], z[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(z[2 * j], z[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),  // lane 0 + lane 1
                         _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
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

// scores[j] = (q . k_j) * scale for keys j < keys, 16 at a time (up to the next multiple of 16:
// kf holds that many rows); the lanes go into fold16 transposed, so that lane t is key t.
template <int CH>
void scores(const float* q, const float* kf, int keys, float scale, float* out) {
    constexpr int hd = 16 * CH;
    __m512 qv[CH];
    for (int c = 0; c < CH; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int j0 = 0; j0 < keys; j0 += 16) {
        __m512 lanes[16];
        for (int m = 0; m < 16; m++) {
            const float* kj = kf + (long)(j0 + 4 * (m % 4) + m / 4) * hd;
            __m512 l = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kj));
            for (int c = 1; c < CH; c++) l = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kj + 16 * c), l);
            lanes[m] = l;
        }
        _mm512_storeu_ps(out + j0, _mm512_mul_ps(fold16(lanes), _mm512_set1_ps(scale)));
    }
}

// Scores of keys j < keys into probabilities in place; returns 1 / their sum.
float softmax(float* s, int keys) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 16 <= keys; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
    const __mmask16 tail = (__mmask16)((1u << (keys - j)) - 1);
    if (j < keys) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, s + j));
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (j = 0; j + 16 <= keys; j += 16) {
        __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift));
        _mm512_storeu_ps(s + j, p);
        total = _mm512_add_ps(total, p);
    }
    if (j < keys) {
        __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), shift));
        p = _mm512_maskz_mov_ps(tail, p);
        _mm512_mask_storeu_ps(s + j, tail, p);
        total = _mm512_add_ps(total, p);
    }
    return 1.0f / _mm512_reduce_add_ps(total);
}

// out = (sum over j < keys, in order, of p[j] v_j) * inv
template <int CH>
void values(const float* p, const float* vf, int keys, float inv, float* out) {
    constexpr int hd = 16 * CH;
    __m512 acc[CH];
    for (int c = 0; c < CH; c++) acc[c] = _mm512_setzero_ps();
    for (int j = 0; j < keys; j++) {
        const __m512 pj = _mm512_set1_ps(p[j]);
        for (int c = 0; c < CH; c++) acc[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vf + (long)j * hd + 16 * c), acc[c]);
    }
    for (int c = 0; c < CH; c++) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
}

// Short contexts: one row at a time, each key's score reduced on its own and the cache read in
// place (below ATTENTION_BLOCK_KEYS keys this is faster than widening it; the same bits).
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
    const long end = s.start + row + 1, first = first_key(s, end);
    const int G = s.heads / s.kv_heads, keys = (int)(end - first);
    thread_local std::vector<float> scores;
    scores.resize((size_t)G * keys);
    const float* qs[MAX_GROUP];
    float* outs[MAX_GROUP];
    for (int g = 0; g < G; g++) {
        qs[g] = q + ((long)(kv * G + g) * s.rows + row) * s.head_dim;
        outs[g] = out + (long)g * s.head_dim;
    }
    const long at = ((long)kv * s.cache_len + first) * s.head_dim;
    attend_group(qs, G, k + at, v + at, keys, s.head_dim, 1.0f / std::sqrt((float)s.head_dim), scores.data(), outs);
}

template <int CH, typename T>
void attend_block(const float* q, const T* k, const T* v, const AttentionShape& s, int kv, int r0, int r1,
                  float* out) {
    constexpr int hd = 16 * CH;
    // the block's keys from its first row's first; 16 zero keys more, as a row's last 16-key chunk
    // may start anywhere in them
    const long first = first_key(s, s.start + r0 + 1), span = s.start + r1 - first;
    const int G = s.heads / s.kv_heads, padded = (int)((span + 15) / 16 * 16 + 16);
    thread_local std::vector<float> kf, vf, p;
    kf.resize((size_t)padded * hd);
    vf.resize((size_t)padded * hd);
    p.resize(padded);
    const long at = ((long)kv * s.cache_len + first) * hd;
    widen(k + at, kf.data(), span, padded, hd);
    widen(v + at, vf.data(), span, padded, hd);
    const float scale = 1.0f / std::sqrt((float)hd);
    for (int row = r0; row < r1; row++) {
        const long end = s.start + row + 1, own = first_key(s, end) - first;
        const int keys = (int)(end - first - own);
        for (int g = 0; g < G; g++) {
            scores<CH>(q + ((long)(kv * G + g) * s.rows + row) * hd, kf.data() + own * hd, keys, scale, p.data());
            const float inv = softmax(p.data(), keys);
            values<CH>(p.data(), vf.data() + own * hd, keys, inv, out + ((long)(row - r0) * G + g) * hd);
        }
    }
}

template <int CH>
void attend_block(const float* q, const void* k, const void* v, bool bf16_cache, const AttentionShape& s, int kv,
                  int r0, int r1, float* out) {
    if (bf16_cache)
        attend_block<CH>(q, (const uint16_t*)k, (const uint16_t*)v, s, kv, r0, r1, out);
    else
        attend_block<CH>(q, (const float*)k, (const float*)v, s, kv, r0, r1, out);
}

}  // namespace

bool attention_fits(int heads, int kv_heads, int head_dim) {
    return heads % kv_heads == 0 && heads / kv_heads <= MAX_GROUP && head_dim % 16 == 0 && head_dim <= MAX_DIM;
}

void attend_rows_avx512(const float* q, const void* k, const void* v, bool bf16_cache, const AttentionShape& s,
                        int kv, int r0, int r1, float* out) {
    if (s.start + r1 < ATTENTION_BLOCK_KEYS) {
        const long G = s.heads / s.kv_heads;
        for (int row = r0; row < r1; row++) {
            float* o = out + (row - r0) * G * s.head_dim;
            if (bf16_cache)
                attend(q, (const uint16_t*)k, (const uint16_t*)v, s, row, kv, o);
            else
                attend(q, (const float*)k, (const float*)v, s, row, kv, o);
        }
        return;
    }
    switch (s.head_dim / 16) {
        case 1: return attend_block<1>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 2: return attend_block<2>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 3: return attend_block<3>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 4: return attend_block<4>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 5: return attend_block<5>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 6: return attend_block<6>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 7: return attend_block<7>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 8: return attend_block<8>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 9: return attend_block<9>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 10: return attend_block<10>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 11: return attend_block<11>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 12: return attend_block<12>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 13: return attend_block<13>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 14: return attend_block<14>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        case 15: return attend_block<15>(q, k, v, bf16_cache, s, kv, r0, r1, out);
        default: return attend_block<16>(q, k, v, bf16_cache, s, kv, r0, r1, out);
    }
}

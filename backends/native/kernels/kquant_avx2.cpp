// kquant.h's blocks on AVX2: a tile as two halves of 8 columns; the exact int32 dot from vpmaddubsw
// (u8 x s8, pairs summed into int16) and vpmaddwd. Pairs of Q4_K / Q5_K / Q6_K weights (u <= 63) stay
// below int16's limit (2 * 63 * 127); Q8_0's (u <= 255) would not, so its u is split into the low 7
// bits and the top bit, each dot exact, the top one shifted by 7.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "kquant.h"

namespace {

constexpr long PREFETCH_BYTES = 8192;

struct Unpacked {
    __m256i w[8];  // k = 4 i .. 4 i + 3 of the half's 8 columns
    __m256 scale[2];
    __m256 offset;
};

inline __m256 widen_u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline __m256 widen_s8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline __m256 halves_of(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 negate(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }
inline __m256i load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }

template <int shift>
inline __m256i bits_to_4(__m256i v, __m256i mask) {
    if (shift < 4) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - shift), mask);
    if (shift > 4) return _mm256_and_si256(_mm256_srli_epi16(v, shift - 4), mask);
    return _mm256_and_si256(v, mask);
}

inline void nibbles(const uint8_t* p, int half, __m256i w[8]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < 4; g++) {
        __m256i packed = load(p + 64 * g + 32 * half);
        w[g] = _mm256_and_si256(packed, low);
        w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    }
}

struct Q8_0 {
    static constexpr int halves = 1, zero = 128;
    static constexpr bool has_min = false, wide = true, signed_values = false;
    static constexpr long bytes = sizeof(q8_0_tile);  // a block's share of the tiles
    static void load_block(const uint8_t* tiles, int b, int half, Unpacked& u) {
        const q8_0_tile& t = reinterpret_cast<const q8_0_tile*>(tiles)[b];
        for (int i = 0; i < 8; i++) u.w[i] = load(t.u + 64 * i + 32 * half);
        u.scale[0] = halves_of(t.d + 8 * half);
    }
};

struct Q4_K {
    static constexpr int halves = 1, zero = 0;
    static constexpr bool has_min = true, wide = false, signed_values = false;
    static constexpr long bytes = sizeof(q4_k_tile) / KQ_BLOCKS;
    static void load_low(const q4_k_tile& t, int j, int half, Unpacked& u) {
        nibbles(t.nibbles[j], half, u.w);
        u.scale[0] = _mm256_mul_ps(halves_of(t.d + 8 * half), widen_u8(t.sc[j] + 8 * half));
        u.offset = negate(_mm256_mul_ps(halves_of(t.dmin + 8 * half), widen_u8(t.m[j] + 8 * half)));
    }
    static void load_block(const uint8_t* tiles, int b, int half, Unpacked& u) {
        load_low(reinterpret_cast<const q4_k_tile*>(tiles)[b / KQ_BLOCKS], b % KQ_BLOCKS, half, u);
    }
};

// bit i of each byte of `high` as bit 4 of operand i (Q5_K, Q5_0, Q5_1)
template <int i>
inline void add_bit(__m256i high, Unpacked& u) {
    u.w[i] = _mm256_or_si256(u.w[i], bits_to_4<i>(high, _mm256_set1_epi8(0x10)));
}

inline void add_high_bits(const uint8_t* p, int half, Unpacked& u) {
    const __m256i high = load(p + 32 * half);
    add_bit<0>(high, u), add_bit<1>(high, u), add_bit<2>(high, u), add_bit<3>(high, u);
    add_bit<4>(high, u), add_bit<5>(high, u), add_bit<6>(high, u), add_bit<7>(high, u);
}

struct Q5_K : Q4_K {
    static constexpr long bytes = sizeof(q5_k_tile) / KQ_BLOCKS;
    static void load_block(const uint8_t* tiles, int b, int half, Unpacked& u) {
        const q5_k_tile& t = reinterpret_cast<const q5_k_tile*>(tiles)[b / KQ_BLOCKS];
        load_low(t.low, b % KQ_BLOCKS, half, u);
        add_high_bits(t.high[b % KQ_BLOCKS], half, u);
    }
};

struct Q6_K {
    static constexpr int halves = 2, zero = 32;
    static constexpr bool has_min = false, wide = false, signed_values = false;
    static constexpr long bytes = sizeof(q6_k_tile) / KQ_BLOCKS;
    template <int i>
    static void add_bits(__m256i high, Unpacked& u) {
        u.w[i] = _mm256_or_si256(u.w[i], bits_to_4<2 * (i % 4)>(high, _mm256_set1_epi8(0x30)));
    }
    static void load_block(const uint8_t* tiles, int b, int half, Unpacked& u) {
        const q6_k_tile& t = reinterpret_cast<const q6_k_tile*>(tiles)[b / KQ_BLOCKS];
        const int j = b % KQ_BLOCKS;
        nibbles(t.nibbles[j], half, u.w);
        const __m256i lo = load(t.high[j][0] + 32 * half), hi = load(t.high[j][1] + 32 * half);
        add_bits<0>(lo, u), add_bits<1>(lo, u), add_bits<2>(lo, u), add_bits<3>(lo, u);
        add_bits<4>(hi, u), add_bits<5>(hi, u), add_bits<6>(hi, u), add_bits<7>(hi, u);
        const __m256 d = halves_of(t.d + 8 * half);
        u.scale[0] = _mm256_mul_ps(d, widen_s8(t.sc[2 * j] + 8 * half));
        u.scale[1] = _mm256_mul_ps(d, widen_s8(t.sc[2 * j + 1] + 8 * half));
    }
};

struct Q5_0 {
    static constexpr int halves = 1, zero = 16;
    static constexpr bool has_min = false, wide = false, signed_values = false;
    static constexpr long bytes = sizeof(q5_0_tile);
    static void load_low(const q5_0_tile& t, int half, Unpacked& u) {
        nibbles(t.nibbles, half, u.w);
        add_high_bits(t.high, half, u);
        u.scale[0] = halves_of(t.d + 8 * half);
    }
    static void load_block(const uint8_t* tiles, int b, int half, Unpacked& u) {
        load_low(reinterpret_cast<const q5_0_tile*>(tiles)[b], half, u);
    }
};

struct Q5_1 : Q5_0 {
    static constexpr int zero = 0;
    static constexpr bool has_min = true;
    static constexpr long bytes = sizeof(q5_1_tile);
    static void load_block(const uint8_t* tiles, int b, int half, Unpacked& u) {
        const q5_1_tile& t = reinterpret_cast<const q5_1_tile*>(tiles)[b];
        load_low(t.low, half, u);
        u.offset = halves_of(t.m + 8 * half);
    }
};

// IQ4's 16 values themselves, signed (-127..113, never -128): here the dot is taken on them directly,
// |x| times the values with x's signs (vpsignb), which is exact, so no zero point is taken off; its
// int32 result is the reference's sum(u q) - 128 sum(q) exactly, at half the wide path's work
constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// the 16 values for each index nibble: a byte shuffle within each 128-bit lane
inline void iq4_values(Unpacked& u) {
    const auto table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)IQ4_VALUES));
    for (int i = 0; i < 8; i++) u.w[i] = _mm256_shuffle_epi8(table, u.w[i]);
}

struct IQ4_NL {
    static constexpr int halves = 1, zero = 0;  // signed values (above)
    static constexpr bool has_min = false, wide = false, signed_values = true;
    static constexpr long bytes = sizeof(iq4_nl_tile);
    static void load_block(const uint8_t* tiles, int b, int half, Unpacked& u) {
        const iq4_nl_tile& t = reinterpret_cast<const iq4_nl_tile*>(tiles)[b];
        nibbles(t.nibbles, half, u.w);
        iq4_values(u);
        u.scale[0] = halves_of(t.d + 8 * half);
    }
};

struct IQ4_XS {
    static constexpr int halves = 1, zero = 0;  // signed values (above)
    static constexpr bool has_min = false, wide = false, signed_values = true;
    static constexpr long bytes = sizeof(iq4_xs_tile) / KQ_BLOCKS;
    static void load_block(const uint8_t* tiles, int b, int half, Unpacked& u) {
        const iq4_xs_tile& t = reinterpret_cast<const iq4_xs_tile*>(tiles)[b / KQ_BLOCKS];
        nibbles(t.nibbles[b % KQ_BLOCKS], half, u.w);
        iq4_values(u);
        u.scale[0] = _mm256_mul_ps(halves_of(t.d + 8 * half), widen_s8(t.sc[b % KQ_BLOCKS] + 8 * half));
    }
};

// sum over operands i0 .. i0 + n - 1 of w[i] . x (4 products a lane), exact in int32
template <bool wide, bool signed_values, int i0, int n>
inline __m256i dot(const Unpacked& u, const int8_t* q) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    for (int i = i0; i < i0 + n; i++) {
        const __m256i x = _mm256_set1_epi32(*(const int32_t*)(q + 4 * i));
        if (signed_values) {  // |x| (x is -127..127) times w with x's sign: pairs at most 2 * 127 * 127
            const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(u.w[i], x));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
        } else if (wide) {
            const __m256i low7 = _mm256_and_si256(u.w[i], _mm256_set1_epi8(0x7F));
            const __m256i top = _mm256_and_si256(_mm256_srli_epi16(u.w[i], 7), _mm256_set1_epi8(1));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(low7, x), ones));
            s = _mm256_add_epi32(s, _mm256_slli_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(top, x), ones), 7));
        } else {
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u.w[i], x), ones));
        }
    }
    return s;
}

template <class T, int M>
void rows_avx2(const uint8_t* tiles, int kb, const q8_row* rows, int half, float* y, long ldy) {
    __m256 acc[M];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < kb; b++) {
        if (half == 0)  // the tiles ahead into the cache (kquant_avx512vnni.cpp); the second half finds them there
            for (long at = 0; at < T::bytes; at += 64) _mm_prefetch((const char*)tiles + b * T::bytes + PREFETCH_BYTES + at, _MM_HINT_T0);
        Unpacked u;
        T::load_block(tiles, b, half, u);
        for (int m = 0; m < M; m++) {
            const q8_row& x = rows[m];
            const int8_t* q = x.q + b * Q4_BLOCK;
            const __m256 d = _mm256_set1_ps(x.d[b]);
            if (T::halves == 1) {
                __m256i s = dot<T::wide, T::signed_values, 0, 8>(u, q);
                if (T::zero) s = _mm256_sub_epi32(s, _mm256_set1_epi32(T::zero * x.sum[b]));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(u.scale[0], d), acc[m]);
            } else {
                const __m256i lo = _mm256_sub_epi32(dot<T::wide, T::signed_values, 0, 4>(u, q), _mm256_set1_epi32(T::zero * x.sum16[2 * b]));
                const __m256i hi = _mm256_sub_epi32(dot<T::wide, T::signed_values, 4, 4>(u, q), _mm256_set1_epi32(T::zero * x.sum16[2 * b + 1]));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(u.scale[0], d), acc[m]);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(u.scale[1], d), acc[m]);
            }
            if (T::has_min) acc[m] = _mm256_fmadd_ps(u.offset, _mm256_set1_ps(x.s[b]), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) _mm256_storeu_ps(y + m * ldy + 8 * half, acc[m]);
}

template <class T>
void block_avx2(const uint8_t* tiles, int kb, const q8_row* rows, int M, float* y, long ldy) {
    for (int half = 0; half < 2; half++)
        for (int m0 = 0; m0 < M; m0 += 4) {  // 4 rows at a time: 16 ymm registers
            const q8_row* r = rows + m0;
            float* out = y + m0 * ldy;
            switch (M - m0 < 4 ? M - m0 : 4) {
                case 1: rows_avx2<T, 1>(tiles, kb, r, half, out, ldy); break;
                case 2: rows_avx2<T, 2>(tiles, kb, r, half, out, ldy); break;
                case 3: rows_avx2<T, 3>(tiles, kb, r, half, out, ldy); break;
                default: rows_avx2<T, 4>(tiles, kb, r, half, out, ldy); break;
            }
        }
}

}  // namespace

const kq_kernels kq_avx2 = {block_avx2<Q8_0>, block_avx2<Q4_K>, block_avx2<Q5_K>, block_avx2<Q6_K>,
                                  block_avx2<Q5_0>, block_avx2<Q5_1>, block_avx2<IQ4_NL>, block_avx2<IQ4_XS>};

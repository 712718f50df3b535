// kquant.h's blocks on AVX512 with VNNI: one 32-bit lane per output column; each type unpacks a
// block's weights into 8 VNNI operands (4 consecutive k of 16 columns, unsigned) and its float32
// factors once, then vpdpbusd (u8 weights x s8 activations) gives every row's exact int32 dot.
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx512vl,fma,f16c")
#include <immintrin.h>

#include "kquant.h"

namespace {

constexpr long PREFETCH_BYTES = 8192;  // how far ahead in the tiles (tuned: scripts/kquant_rows_bench.py)

// A block's unpacked weights and factors (kquant.h): w[i] holds k = 4 i .. 4 i + 3 of each column.
struct Unpacked {
    __m512i w[8];
    __m512 scale[2];  // of each half (Q6_K), else scale[0]
    __m512 offset;    // Q4_K, Q5_K
};

inline __m512 widen_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline __m512 widen_s8(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline __m512 halves_of(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 negate(__m512 v) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))); }

// bits `shift` .. of each byte moved to bit 4 .. and masked (a compile-time shift: no cross-byte bits kept)
template <int shift>
inline __m512i bits_to_4(__m512i v, __m512i mask) {
    if (shift < 4) return _mm512_and_si512(_mm512_slli_epi16(v, 4 - shift), mask);
    if (shift > 4) return _mm512_and_si512(_mm512_srli_epi16(v, shift - 4), mask);
    return _mm512_and_si512(v, mask);
}

inline void nibbles(const uint8_t* p, __m512i w[8]) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; g++) {
        __m512i packed = _mm512_loadu_si512(p + 64 * g);
        w[g] = _mm512_and_si512(packed, low);
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
}

struct Q8_0 {
    static constexpr int halves = 1, zero = 128;
    static constexpr bool has_min = false;
    static constexpr long bytes = sizeof(q8_0_tile);  // a block's share of the tiles
    static void load(const uint8_t* tiles, int b, Unpacked& u) {
        const q8_0_tile& t = reinterpret_cast<const q8_0_tile*>(tiles)[b];
        for (int i = 0; i < 8; i++) u.w[i] = _mm512_loadu_si512(t.u + 64 * i);
        u.scale[0] = halves_of(t.d);
    }
};

struct Q4_K {
    static constexpr int halves = 1, zero = 0;
    static constexpr bool has_min = true;
    static constexpr long bytes = sizeof(q4_k_tile) / KQ_BLOCKS;
    static void load_low(const q4_k_tile& t, int j, Unpacked& u) {
        nibbles(t.nibbles[j], u.w);
        u.scale[0] = _mm512_mul_ps(halves_of(t.d), widen_u8(t.sc[j]));
        u.offset = negate(_mm512_mul_ps(halves_of(t.dmin), widen_u8(t.m[j])));
    }
    static void load(const uint8_t* tiles, int b, Unpacked& u) {
        load_low(reinterpret_cast<const q4_k_tile*>(tiles)[b / KQ_BLOCKS], b % KQ_BLOCKS, u);
    }
};

// bit i of each byte of `high` as bit 4 of operand i (Q5_K, Q5_0, Q5_1)
template <int i>
inline void add_bit(__m512i high, Unpacked& u) {
    u.w[i] = _mm512_or_si512(u.w[i], bits_to_4<i>(high, _mm512_set1_epi8(0x10)));
}

inline void add_high_bits(const uint8_t* p, Unpacked& u) {
    const __m512i high = _mm512_loadu_si512(p);
    add_bit<0>(high, u), add_bit<1>(high, u), add_bit<2>(high, u), add_bit<3>(high, u);
    add_bit<4>(high, u), add_bit<5>(high, u), add_bit<6>(high, u), add_bit<7>(high, u);
}

struct Q5_K : Q4_K {
    static constexpr long bytes = sizeof(q5_k_tile) / KQ_BLOCKS;
    static void load(const uint8_t* tiles, int b, Unpacked& u) {
        const q5_k_tile& t = reinterpret_cast<const q5_k_tile*>(tiles)[b / KQ_BLOCKS];
        load_low(t.low, b % KQ_BLOCKS, u);
        add_high_bits(t.high[b % KQ_BLOCKS], u);
    }
};

struct Q6_K {
    static constexpr int halves = 2, zero = 32;
    static constexpr bool has_min = false;
    static constexpr long bytes = sizeof(q6_k_tile) / KQ_BLOCKS;
    template <int i>
    static void add_bits(__m512i high, Unpacked& u) {
        u.w[i] = _mm512_or_si512(u.w[i], bits_to_4<2 * (i % 4)>(high, _mm512_set1_epi8(0x30)));
    }
    static void load(const uint8_t* tiles, int b, Unpacked& u) {
        const q6_k_tile& t = reinterpret_cast<const q6_k_tile*>(tiles)[b / KQ_BLOCKS];
        const int j = b % KQ_BLOCKS;
        nibbles(t.nibbles[j], u.w);
        const __m512i lo = _mm512_loadu_si512(t.high[j][0]), hi = _mm512_loadu_si512(t.high[j][1]);
        add_bits<0>(lo, u), add_bits<1>(lo, u), add_bits<2>(lo, u), add_bits<3>(lo, u);
        add_bits<4>(hi, u), add_bits<5>(hi, u), add_bits<6>(hi, u), add_bits<7>(hi, u);
        const __m512 d = halves_of(t.d);
        u.scale[0] = _mm512_mul_ps(d, widen_s8(t.sc[2 * j]));
        u.scale[1] = _mm512_mul_ps(d, widen_s8(t.sc[2 * j + 1]));
    }
};

struct Q5_0 {
    static constexpr int halves = 1, zero = 16;
    static constexpr bool has_min = false;
    static constexpr long bytes = sizeof(q5_0_tile);
    static void load_low(const q5_0_tile& t, Unpacked& u) {
        nibbles(t.nibbles, u.w);
        add_high_bits(t.high, u);
        u.scale[0] = halves_of(t.d);
    }
    static void load(const uint8_t* tiles, int b, Unpacked& u) {
        load_low(reinterpret_cast<const q5_0_tile*>(tiles)[b], u);
    }
};

struct Q5_1 : Q5_0 {
    static constexpr int zero = 0;
    static constexpr bool has_min = true;
    static constexpr long bytes = sizeof(q5_1_tile);
    static void load(const uint8_t* tiles, int b, Unpacked& u) {
        const q5_1_tile& t = reinterpret_cast<const q5_1_tile*>(tiles)[b];
        load_low(t.low, u);
        u.offset = halves_of(t.m);
    }
};

constexpr uint8_t IQ4_U[16] = {KQ_IQ4_VALUES_U8};

// the 16 values' u for each index nibble: a byte shuffle within each 128-bit lane
inline void iq4_values(Unpacked& u) {
    const auto table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)IQ4_U));
    for (int i = 0; i < 8; i++) u.w[i] = _mm512_shuffle_epi8(table, u.w[i]);
}

struct IQ4_NL {
    static constexpr int halves = 1, zero = 128;
    static constexpr bool has_min = false;
    static constexpr long bytes = sizeof(iq4_nl_tile);
    static void load(const uint8_t* tiles, int b, Unpacked& u) {
        const iq4_nl_tile& t = reinterpret_cast<const iq4_nl_tile*>(tiles)[b];
        nibbles(t.nibbles, u.w);
        iq4_values(u);
        u.scale[0] = halves_of(t.d);
    }
};

struct IQ4_XS {
    static constexpr int halves = 1, zero = 128;
    static constexpr bool has_min = false;
    static constexpr long bytes = sizeof(iq4_xs_tile) / KQ_BLOCKS;
    static void load(const uint8_t* tiles, int b, Unpacked& u) {
        const iq4_xs_tile& t = reinterpret_cast<const iq4_xs_tile*>(tiles)[b / KQ_BLOCKS];
        nibbles(t.nibbles[b % KQ_BLOCKS], u.w);
        iq4_values(u);
        u.scale[0] = _mm512_mul_ps(halves_of(t.d), widen_s8(t.sc[b % KQ_BLOCKS]));
    }
};

inline __m512i x4(const int8_t* q, int i) { return _mm512_set1_epi32(*(const int32_t*)(q + 4 * i)); }

// The exact dot of operands i0 .. i0 + n - 1 with the row, in two independent chains.
template <int i0, int n>
inline __m512i dot(const Unpacked& u, const int8_t* q) {
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    for (int i = i0; i < i0 + n; i += 2) {
        a = _mm512_dpbusd_epi32(a, u.w[i], x4(q, i));
        b = _mm512_dpbusd_epi32(b, u.w[i + 1], x4(q, i + 1));
    }
    return _mm512_add_epi32(a, b);
}

template <class T, int M>
void rows_avx512(const uint8_t* tiles, int kb, const q8_row* rows, float* y, long ldy) {
    __m512 acc[M];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < kb; b++) {
        // the tiles ahead into the cache while this block computes: with several rows the work per
        // byte outgrows what the hardware prefetcher hides (scripts/kquant_rows_bench.py)
        for (long at = 0; at < T::bytes; at += 64) _mm_prefetch((const char*)tiles + b * T::bytes + PREFETCH_BYTES + at, _MM_HINT_T0);
        Unpacked u;
        T::load(tiles, b, u);
        for (int m = 0; m < M; m++) {
            const q8_row& x = rows[m];
            const int8_t* q = x.q + b * Q4_BLOCK;
            const __m512 d = _mm512_set1_ps(x.d[b]);
            if (T::halves == 1) {
                __m512i s = dot<0, 8>(u, q);
                if (T::zero) s = _mm512_sub_epi32(s, _mm512_set1_epi32(T::zero * x.sum[b]));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(u.scale[0], d), acc[m]);
            } else {
                const __m512i lo = _mm512_sub_epi32(dot<0, 4>(u, q), _mm512_set1_epi32(T::zero * x.sum16[2 * b]));
                const __m512i hi = _mm512_sub_epi32(dot<4, 4>(u, q), _mm512_set1_epi32(T::zero * x.sum16[2 * b + 1]));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(u.scale[0], d), acc[m]);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(u.scale[1], d), acc[m]);
            }
            if (T::has_min) acc[m] = _mm512_fmadd_ps(u.offset, _mm512_set1_ps(x.s[b]), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) _mm512_storeu_ps(y + m * ldy, acc[m]);
}

template <class T>
void block_avx512(const uint8_t* tiles, int kb, const q8_row* rows, int M, float* y, long ldy) {
    for (int m0 = 0; m0 < M; m0 += 8) {  // 8 rows at a time: accumulators and weights fit the registers
        const q8_row* r = rows + m0;
        float* out = y + m0 * ldy;
        switch (M - m0 < 8 ? M - m0 : 8) {
            case 1: rows_avx512<T, 1>(tiles, kb, r, out, ldy); break;
            case 2: rows_avx512<T, 2>(tiles, kb, r, out, ldy); break;
            case 3: rows_avx512<T, 3>(tiles, kb, r, out, ldy); break;
            case 4: rows_avx512<T, 4>(tiles, kb, r, out, ldy); break;
            case 5: rows_avx512<T, 5>(tiles, kb, r, out, ldy); break;
            case 6: rows_avx512<T, 6>(tiles, kb, r, out, ldy); break;
            case 7: rows_avx512<T, 7>(tiles, kb, r, out, ldy); break;
            default: rows_avx512<T, 8>(tiles, kb, r, out, ldy); break;
        }
    }
}

}  // namespace

const kq_kernels kq_avx512vnni = {block_avx512<Q8_0>, block_avx512<Q4_K>, block_avx512<Q5_K>, block_avx512<Q6_K>,
                                  block_avx512<Q5_0>, block_avx512<Q5_1>, block_avx512<IQ4_NL>, block_avx512<IQ4_XS>};

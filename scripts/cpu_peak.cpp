// Peak multiply-accumulate rate of one core for the arithmetic a decode kernel can use: int8
// VNNI (vpdpbusd), bfloat16 (vdpbf16ps) and float32 FMA, 512-bit, 12 independent chains (no
// latency bound). Where a verify row stops being nearly free: a row's MACs over this rate.
//
//     g++ -O2 scripts/cpu_peak.cpp -o /tmp/cpu_peak && /tmp/cpu_peak
//
// Needs AVX512 with VNNI and BF16 (it says so and stops otherwise).
#include <immintrin.h>

#include <chrono>
#include <cstdio>

#define CHAINS(OP) OP(a0) OP(a1) OP(a2) OP(a3) OP(a4) OP(a5) OP(a6) OP(a7) OP(a8) OP(a9) OP(a10) OP(a11)
static const long N = 100000000;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")
template <typename F>
static double rate(F body, int macs_per_op) {
    auto t0 = std::chrono::steady_clock::now();
    body();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return 12.0 * N * macs_per_op / s / 1e9;
}

static void run() {
    double vnni = rate([] {
        __m512i a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11;
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = _mm512_set1_epi32(1);
        const __m512i w = _mm512_set1_epi32(0x01020304), x = _mm512_set1_epi32(0x01010101);
        for (long n = 0; n < N; n++) {
#define OP(v) v = _mm512_dpbusd_epi32(v, w, x); __asm__ volatile("" : "+v"(v));
            CHAINS(OP)
#undef OP
        }
    }, 64);
    double bf16 = rate([] {
        __m512 a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11;
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = _mm512_set1_ps(1);
        const __m512bh p = (__m512bh)_mm512_set1_epi32(0x3f803f80);
        for (long n = 0; n < N; n++) {
#define OP(v) v = _mm512_dpbf16_ps(v, p, p); __asm__ volatile("" : "+v"(v));
            CHAINS(OP)
#undef OP
        }
    }, 32);
    double fp32 = rate([] {
        __m512 a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11;
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = _mm512_set1_ps(1);
        const __m512 p = _mm512_set1_ps(1.0f);
        for (long n = 0; n < N; n++) {
#define OP(v) v = _mm512_fmadd_ps(v, p, p); __asm__ volatile("" : "+v"(v));
            CHAINS(OP)
#undef OP
        }
    }, 16);
    std::printf("one core, GMAC/s: int8 VNNI %.0f, bfloat16 %.0f, float32 FMA %.0f\n", vnni, bf16, fp32);
}
#pragma GCC pop_options

int main() {
    if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bf16")) {
        std::printf("this CPU has no AVX512-VNNI / AVX512-BF16\n");
        return 1;
    }
    run();
}

// torch's side of the 4-bit matmul: the op's schema and CPU kernel, and the choice of ISA made
// once at load. q4.h says what is computed; the ISA files compute it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "q4.h"

namespace {

struct Isa {
    const char* name;
    q4_block_fn block;
    q8_quantize_fn quantize;
    bool (*available)();
};

bool always() { return true; }
bool has_avx2() {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
// __builtin_cpu_supports checks that the OS saves the AVX512 registers too (XGETBV)
bool has_avx512vnni() {
    return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// best first
const Isa ISAS[] = {{"avx512vnni", q4_block_avx512vnni, q8_quantize_avx512vnni, has_avx512vnni},
                    {"avx2", q4_block_avx2, q8_quantize_avx2, has_avx2},
                    {"ref", q4_block_ref, q8_quantize_ref, always}};

const Isa* find(const std::string& name) {
    for (const Isa& isa : ISAS)
        if (name == isa.name && isa.available()) return &isa;
    return nullptr;
}

// The best ISA this CPU runs, or the one SPECCHAT_Q4_ISA names (if it runs here).
const Isa& chosen() {
    static const Isa* isa = [] {
        const char* forced = std::getenv("SPECCHAT_Q4_ISA");
        if (forced && *forced) {
            const Isa* f = find(forced);
            TORCH_CHECK(f, "SPECCHAT_Q4_ISA=", forced, ": not an ISA this CPU runs (", "avx512vnni, avx2, ref)");
            return f;
        }
        for (const Isa& i : ISAS)
            if (i.available()) return &i;
        return &ISAS[2];
    }();
    return *isa;
}

float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

uint16_t to_bf16(float f) {  // round to nearest, ties to even (as c10::BFloat16)
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // nan
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1)) >> 16);
}

// x [..., K] (float32 or bfloat16) times the tiles of W [n, K] -> [..., n] in x's dtype.
at::Tensor linear_on(const at::Tensor& x_in, const at::Tensor& tiles, int64_t n, const Isa& isa) {
    TORCH_CHECK(x_in.device().is_cpu() && tiles.device().is_cpu(), "q4_linear runs on CPU");
    TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous(), "q4_linear: tiles must be contiguous uint8");
    const bool bf16 = x_in.scalar_type() == at::kBFloat16;
    TORCH_CHECK(bf16 || x_in.scalar_type() == at::kFloat, "q4_linear: x must be float32 or bfloat16");
    const int64_t K = x_in.size(-1);
    TORCH_CHECK(K % Q4_BLOCK == 0 && n % Q4_COLS == 0, "q4_linear: K % 32 and n % 16 must be 0");
    const int64_t kb = K / Q4_BLOCK, nb = n / Q4_COLS;
    TORCH_CHECK(tiles.numel() == nb * kb * (int64_t)sizeof(q4_tile), "q4_linear: tiles do not match [n, K]");
    const at::Tensor x = x_in.contiguous();
    const int64_t M = x.numel() / K;

    // each row quantized once, before any column is computed
    thread_local std::vector<float> row;
    thread_local std::vector<int8_t> q;
    thread_local std::vector<float> d, s;
    thread_local std::vector<q8_row> rows;
    row.resize(K), q.resize(M * K), d.resize(M * kb), s.resize(M * kb), rows.resize(M);
    for (int64_t m = 0; m < M; m++) {
        const float* xm = row.data();
        if (bf16) {
            const uint16_t* h = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + m * K;
            for (int64_t k = 0; k < K; k++) row[k] = from_bf16(h[k]);
        } else {
            xm = x.data_ptr<float>() + m * K;
        }
        isa.quantize(xm, (int)K, q.data() + m * K, d.data() + m * kb, s.data() + m * kb);
        rows[m] = {q.data() + m * K, d.data() + m * kb, s.data() + m * kb};
    }

    std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
    shape.back() = n;
    at::Tensor y = at::empty(shape, x_in.options());
    void* out = y.data_ptr();
    const q4_tile* w = reinterpret_cast<const q4_tile*>(tiles.data_ptr<uint8_t>());
    const q8_row* r = rows.data();
    // over column blocks only: a column's arithmetic is the same whichever thread runs it
    at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
        float acc[16 * Q4_COLS];
        for (int64_t b = b0; b < b1; b++)
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                const int rows_here = (int)std::min<int64_t>(16, M - m0);
                isa.block(w + b * kb, (int)kb, r + m0, rows_here, acc, Q4_COLS);
                for (int m = 0; m < rows_here; m++) {
                    const int64_t at = (m0 + m) * n + b * Q4_COLS;
                    if (bf16)
                        for (int c = 0; c < Q4_COLS; c++) static_cast<uint16_t*>(out)[at + c] = to_bf16(acc[m * Q4_COLS + c]);
                    else
                        std::memcpy(static_cast<float*>(out) + at, acc + m * Q4_COLS, sizeof(float) * Q4_COLS);
                }
            }
    });
    return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t n) {
    return linear_on(x, tiles, n, chosen());
}

at::Tensor q4_linear_on(const at::Tensor& x, const at::Tensor& tiles, int64_t n, c10::string_view isa) {
    const Isa* f = find(std::string(isa));
    TORCH_CHECK(f, "q4_linear_on: ISA ", std::string(isa), " does not run on this CPU");
    return linear_on(x, tiles, n, *f);
}

std::string q4_isa() { return chosen().name; }

std::vector<std::string> q4_isas() {
    std::vector<std::string> out;
    for (const Isa& isa : ISAS)
        if (isa.available()) out.push_back(isa.name);
    return out;
}

}  // namespace

TORCH_LIBRARY(specchat, m) {
    m.def("q4_linear(Tensor x, Tensor tiles, int n) -> Tensor");
    m.def("q4_linear_on(Tensor x, Tensor tiles, int n, str isa) -> Tensor");
    m.def("q4_isa() -> str", q4_isa);
    m.def("q4_isas() -> str[]", q4_isas);
}

TORCH_LIBRARY_IMPL(specchat, CPU, m) {
    m.impl("q4_linear", q4_linear);
    m.impl("q4_linear_on", q4_linear_on);
}

// torch's side of the kernels: the ops' schemas and CPU kernels, and the choice of ISA made once
// at load. q4.h says what is computed; the ISA files compute it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "attention.h"
#include "f16.h"
#include "kquant.h"
#include "q4.h"

namespace {

struct Isa {
    const char* name;
    q4_block_fn block;
    q8_head_fn head;
    q8_quantize_fn quantize;
    head_dot_fn dot;
    head_range_fn range;
    head_pick_fn pick;
    const kq_kernels* kq;
    fx_block_fn fx;
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
const Isa ISAS[] = {
    {"avx512vnni", q4_block_avx512vnni, q8_head_avx512vnni, q8_quantize_avx512vnni, head_dot_avx512vnni,
     head_range_avx512vnni, head_pick_avx512vnni, &kq_avx512vnni, fx_block_avx512, has_avx512vnni},
    {"avx2", q4_block_avx2, q8_head_avx2, q8_quantize_avx2, head_dot_ref, head_range_ref, head_pick_ref, &kq_avx2,
     fx_block_avx2, has_avx2},
    {"ref", q4_block_ref, q8_head_ref, q8_quantize_ref, head_dot_ref, head_range_ref, head_pick_ref, &kq_ref,
     fx_block_ref, always}};

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
            TORCH_CHECK(f, "SPECCHAT_Q4_ISA=", forced, ": not an ISA this CPU runs (avx512vnni, avx2, ref)");
            return f;
        }
        for (const Isa& i : ISAS)
            if (i.available()) return &i;
        return &ISAS[2];
    }();
    return *isa;
}

const Isa& named(c10::string_view name) {
    const Isa* f = find(std::string(name));
    TORCH_CHECK(f, "ISA ", std::string(name), " does not run on this CPU");
    return *f;
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

// The rows of x [..., K] (float32 or bfloat16, contiguous), each quantized on its own (q4.h).
struct QuantizedRows {
    std::vector<int8_t> q;
    std::vector<float> d, s;
    std::vector<int32_t> sum, sum16;
    std::vector<q8_row> rows;

    // halves: also the integer sums of each half block (kquant.h's Q6_K). Rows are independent, so
    // many (a prefill) are quantized in parallel with the same bits.
    void fill(const at::Tensor& x, int64_t K, const Isa& isa, bool halves = false) {
        const int64_t M = x.numel() / K, kb = K / Q4_BLOCK;
        q.resize(M * K), d.resize(M * kb), s.resize(M * kb), sum.resize(M * kb), rows.resize(M);
        if (halves) sum16.resize(2 * M * kb);
        at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
            std::vector<float> row;  // a bfloat16 row widened
            for (int64_t m = m0; m < m1; m++) {
                isa.quantize(as_float(x, m, K, row), (int)K, q.data() + m * K, d.data() + m * kb, s.data() + m * kb,
                             sum.data() + m * kb);
                rows[m] = {q.data() + m * K, d.data() + m * kb, s.data() + m * kb, sum.data() + m * kb, nullptr};
                if (!halves) continue;
                for (int64_t h = 0; h < 2 * kb; h++) {
                    int32_t t = 0;
                    for (int k = 0; k < Q4_BLOCK / 2; k++) t += q[m * K + h * (Q4_BLOCK / 2) + k];
                    sum16[2 * m * kb + h] = t;
                }
                rows[m].sum16 = sum16.data() + 2 * m * kb;
            }
        });
    }

    static const float* as_float(const at::Tensor& x, int64_t m, int64_t K, std::vector<float>& row) {
        if (x.scalar_type() == at::kFloat) return x.data_ptr<float>() + m * K;
        const uint16_t* h = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + m * K;
        row.resize(K);
        for (int64_t k = 0; k < K; k++) row[k] = from_bf16(h[k]);
        return row.data();
    }
};

void check_input(const at::Tensor& x, const at::Tensor& tiles, int64_t K, const char* op) {
    TORCH_CHECK(x.device().is_cpu() && tiles.device().is_cpu(), op, " runs on CPU");
    TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous(), op, ": tiles must be contiguous uint8");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
                ": x must be float32 or bfloat16");
    TORCH_CHECK(K % Q4_BLOCK == 0, op, ": K % 32 must be 0");
}

// `rows` rows of a column block's 16 results (acc, 16 apart) into y (x's dtype, `n` columns a row) at `at`.
void store_columns(const float* acc, int rows, void* out, bool bf16, int64_t at, int64_t n) {
    for (int m = 0; m < rows; m++, at += n) {
        if (bf16)
            for (int c = 0; c < Q4_COLS; c++) static_cast<uint16_t*>(out)[at + c] = to_bf16(acc[m * Q4_COLS + c]);
        else
            std::memcpy(static_cast<float*>(out) + at, acc + m * Q4_COLS, sizeof(float) * Q4_COLS);
    }
}

// y = x [..., K] W^T for W [n, K] held as tiles of 16 columns, `block_bytes` apart: each row of x
// quantized once (QuantizedRows), then `block` (q4_block_fn's or kq_block_fn's signature, over a
// column block's tiles) for rows 16 at a time -> [..., n] in x's dtype. Split over column blocks
// only: a column's arithmetic is the same whichever thread runs it.
template <class Block>
at::Tensor run_columns(const at::Tensor& x_in, const uint8_t* tiles, int64_t n, int64_t block_bytes, Block block,
                       const Isa& isa, bool halves) {
    const int64_t K = x_in.size(-1), kb = K / Q4_BLOCK, nb = n / Q4_COLS;
    const at::Tensor x = x_in.contiguous();
    const int64_t M = x.numel() / K;
    thread_local QuantizedRows quantized;  // each row quantized once, before any column is computed
    quantized.fill(x, K, isa, halves);
    std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
    shape.back() = n;
    at::Tensor y = at::empty(shape, x_in.options());
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    void* out = y.data_ptr();
    const q8_row* rows = quantized.rows.data();
    at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
        float acc[16 * Q4_COLS];
        for (int64_t b = b0; b < b1; b++)
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                const int here = (int)std::min<int64_t>(16, M - m0);
                block(tiles + b * block_bytes, (int)kb, rows + m0, here, acc, Q4_COLS);
                store_columns(acc, here, out, bf16, m0 * n + b * Q4_COLS, n);
            }
    });
    return y;
}

// x [..., K] times the 4-bit tiles of W [n, K] -> [..., n] in x's dtype.
at::Tensor linear_on(const at::Tensor& x_in, const at::Tensor& tiles, int64_t n, const Isa& isa) {
    const int64_t K = x_in.size(-1);
    check_input(x_in, tiles, K, "q4_linear");
    TORCH_CHECK(n % Q4_COLS == 0, "q4_linear: n % 16 must be 0");
    const int64_t kb = K / Q4_BLOCK, nb = n / Q4_COLS, per_block = kb * (int64_t)sizeof(q4_tile);
    TORCH_CHECK(tiles.numel() == nb * per_block, "q4_linear: tiles do not match [n, K]");
    auto block = [&](const uint8_t* t, int kb, const q8_row* rows, int M, float* y, long ldy) {
        isa.block(reinterpret_cast<const q4_tile*>(t), kb, rows, M, y, ldy);
    };
    return run_columns(x_in, tiles.data_ptr<uint8_t>(), n, per_block, block, isa, false);
}

kq_block_fn kq_kernel(const Isa& isa, int64_t type) {
    switch (type) {
        case KQ_Q8_0: return isa.kq->q8_0;
        case KQ_Q4_K: return isa.kq->q4_k;
        case KQ_Q5_K: return isa.kq->q5_k;
        case KQ_Q6_K: return isa.kq->q6_k;
        case KQ_Q5_0: return isa.kq->q5_0;
        case KQ_Q5_1: return isa.kq->q5_1;
        case KQ_IQ4_NL: return isa.kq->iq4_nl;
        case KQ_IQ4_XS: return isa.kq->iq4_xs;
        default:
            TORCH_CHECK(false, "kq_linear: GGUF type ", type,
                        " has no kernel (Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)");
    }
}

// x [..., K] times the 16-bit tiles (f16.h) of W [n, K] in GGUF type F16 or BF16 -> [..., n] in x's
// dtype. A bfloat16 x is widened once; split over column blocks only, as run_columns.
at::Tensor fx_linear_on(const at::Tensor& x_in, const at::Tensor& tiles, int64_t type, int64_t n, const Isa& isa) {
    const int64_t K = x_in.size(-1);
    check_input(x_in, tiles, K, "kq_linear");
    TORCH_CHECK(n % FX_COLS == 0, "kq_linear: n % 16 must be 0");
    TORCH_CHECK(tiles.numel() == n * K * 2, "kq_linear: tiles do not match [n, K] in a 16-bit type");
    const at::Tensor x = x_in.contiguous();
    const int64_t M = x.numel() / K, nb = n / FX_COLS;
    const float* xf = x.scalar_type() == at::kFloat ? x.data_ptr<float>() : nullptr;
    thread_local std::vector<float> widened;
    if (!xf) {
        widened.resize(M * K);
        const uint16_t* h = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
        for (int64_t i = 0; i < M * K; i++) widened[i] = from_bf16(h[i]);
        xf = widened.data();
    }
    std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
    shape.back() = n;
    at::Tensor y = at::empty(shape, x_in.options());
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    void* out = y.data_ptr();
    const uint16_t* w = reinterpret_cast<const uint16_t*>(tiles.data_ptr<uint8_t>());
    at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
        float acc[16 * FX_COLS];
        for (int64_t b = b0; b < b1; b++)
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                const int here = (int)std::min<int64_t>(16, M - m0);
                isa.fx(w + b * K * FX_COLS, (int)type, (int)K, xf + m0 * K, K, here, acc, FX_COLS);
                store_columns(acc, here, out, bf16, m0 * n + b * FX_COLS, n);
            }
    });
    return y;
}

// x [..., K] times the tiles of W [n, K] in GGUF type `type` (kquant.h) -> [..., n] in x's dtype.
at::Tensor kq_linear_on(const at::Tensor& x_in, const at::Tensor& tiles, int64_t type, int64_t n, const Isa& isa) {
    if (fx_is(type)) return fx_linear_on(x_in, tiles, type, n, isa);
    const int64_t K = x_in.size(-1);
    check_input(x_in, tiles, K, "kq_linear");
    const kq_block_fn block = kq_kernel(isa, type);
    TORCH_CHECK(n % KQ_COLS == 0, "kq_linear: n % 16 must be 0");
    TORCH_CHECK(K % kq_block_inputs((int)type) == 0,
                "kq_linear: K must be whole blocks of the type (32, or 256 for K-quants and IQ4_XS)");
    const int64_t kb = K / Q4_BLOCK, nb = n / KQ_COLS, per_block = kb * kq_block_bytes((int)type);
    TORCH_CHECK(tiles.numel() == nb * per_block, "kq_linear: tiles do not match [n, K] in this type");
    return run_columns(x_in, tiles.data_ptr<uint8_t>(), n, per_block, block, isa, type == KQ_Q6_K);
}

// Rows `ids` of W [n, K] from its tiles (q4.h's for type 3, f16.h's for F16 / BF16, kquant.h's for the others)
// -> float32 [len(ids), K]: embedding rows looked up in the tiles the head multiplies with.
at::Tensor kq_rows(const at::Tensor& tiles, int64_t type, int64_t K, const at::Tensor& ids_in) {
    TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.dim() == 2, "kq_rows: tiles");
    const int64_t kb = K / Q4_BLOCK, per_block = tiles.size(1), n = tiles.size(0) * KQ_COLS;
    const bool q4 = type == 3;
    const int64_t block_bytes = q4 ? (int64_t)sizeof(q4_tile) : fx_is(type) ? 2 * Q4_BLOCK * FX_COLS
                                                                            : kq_block_bytes((int)type);
    TORCH_CHECK(K % Q4_BLOCK == 0 && per_block == kb * block_bytes,
                "kq_rows: tiles do not match K in this type");
    const at::Tensor ids = ids_in.to(at::kLong).contiguous();
    at::Tensor y = at::empty({ids.numel(), K}, at::TensorOptions().dtype(at::kFloat));
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); i++) {
        TORCH_CHECK(id[i] >= 0 && id[i] < n, "kq_rows: id ", id[i], " out of range [0, ", n, ")");
        const uint8_t* block = tiles.data_ptr<uint8_t>() + (id[i] / KQ_COLS) * per_block;
        float* out = y.data_ptr<float>() + i * K;
        if (fx_is(type))
            fx_row_ref(reinterpret_cast<const uint16_t*>(block), (int)type, (int)K, (int)(id[i] % KQ_COLS), out);
        else if (q4)
            q4_row_ref(reinterpret_cast<const q4_tile*>(block), (int)kb, (int)(id[i] % KQ_COLS), out);
        else
            kq_row_ref(block, (int)type, (int)kb, (int)(id[i] % KQ_COLS), out);
    }
    return y;
}

// x [M, K] float32 times the int8 tiles of the head [V, K] (scales [V]) -> float32 logits [M, V],
// and for each row [||x8||, ||x - x8||] (x8: the row as quantized), rounded up: the terms of
// argmax_head.py's bound that the activations' quantization adds.
std::tuple<at::Tensor, at::Tensor> head_on(const at::Tensor& x_in, const at::Tensor& tiles, const at::Tensor& scale,
                                           const Isa& isa) {
    const int64_t K = x_in.size(-1), V = scale.numel();
    check_input(x_in, tiles, K, "q8_head");
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && V % 16 == 0,
                "q8_head: scale must be contiguous float32 [V], V % 16 == 0");
    const int64_t kb = K / Q4_BLOCK, vb = V / 16;
    TORCH_CHECK(tiles.numel() == vb * kb * (int64_t)sizeof(q8_tile), "q8_head: tiles do not match [V, K]");
    const at::Tensor x = x_in.to(at::kFloat).contiguous().view({-1, K});
    const int64_t M = x.size(0);
    thread_local QuantizedRows quantized;
    quantized.fill(x, K, isa);

    at::Tensor norms = at::empty({M, 2}, x.options());
    float* np = norms.data_ptr<float>();
    for (int64_t m = 0; m < M; m++) {
        const float* xm = x.data_ptr<float>() + m * K;
        double q2 = 0, e2 = 0;
        for (int64_t k = 0; k < K; k++) {
            const double x8 = (double)quantized.q[m * K + k] * quantized.d[m * kb + k / Q4_BLOCK];
            q2 += x8 * x8, e2 += (xm[k] - x8) * (xm[k] - x8);
        }
        np[2 * m] = std::nextafter((float)std::sqrt(q2), INFINITY);
        np[2 * m + 1] = std::nextafter((float)std::sqrt(e2), INFINITY);
    }
    at::Tensor y = at::empty({M, V}, x.options());
    float* out = y.data_ptr<float>();
    const q8_tile* w = reinterpret_cast<const q8_tile*>(tiles.data_ptr<uint8_t>());
    const float* sc = scale.data_ptr<float>();
    const q8_row* rows = quantized.rows.data();
    at::parallel_for(0, vb, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; b++)
            for (int64_t m0 = 0; m0 < M; m0 += 16)
                isa.head(w + b * kb, (int)kb, sc + b * 16, rows + m0, (int)std::min<int64_t>(16, M - m0),
                         out + m0 * V + b * 16, V);
    });
    return {y, norms};
}

// q [H, n, hd] (float32 or bfloat16) over the cache k, v [1, Hkv, L, hd], row i of q at position
// start + i, over its last `window` keys where window > 0 (attention_avx512.cpp) -> [1, H, n, hd] in
// q's dtype.
at::Tensor attend_rows(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, int64_t start,
                       int64_t window) {
    TORCH_CHECK(has_avx512vnni(), "attend_rows: needs AVX512");
    TORCH_CHECK(q_in.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == 1, "attend_rows: shapes");
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.scalar_type() == v.scalar_type() &&
                    (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
                "attend_rows: the cache must be contiguous float32 or bfloat16");
    const int64_t H = q_in.size(0), n = q_in.size(1), hd = q_in.size(2), Hkv = k.size(1), L = k.size(2);
    TORCH_CHECK(k.size(3) == hd && attention_fits((int)H, (int)Hkv, (int)hd) && start >= 0 && start + n <= L &&
                    window >= 0, "attend_rows: shapes or positions do not fit");
    const at::Tensor q = q_in.to(at::kFloat).contiguous();
    const AttentionShape s{(int)H, (int)Hkv, (int)n, (int)hd, L, start, window};
    at::Tensor y = at::empty({1, H, n, hd}, q_in.options());
    const bool bf16_out = q_in.scalar_type() == at::kBFloat16, bf16_cache = k.scalar_type() == at::kBFloat16;
    const int64_t G = H / Hkv;
    const float* qp = q.data_ptr<float>();
    const void *kp = k.data_ptr(), *vp = v.data_ptr();
    void* yp = y.data_ptr();
    // over (kv head, block of rows): past ATTENTION_BLOCK_KEYS a block widens its keys and values
    // once for all its rows, in blocks small enough that each thread gets about two; each row's
    // arithmetic is its own, whichever block and thread run it
    const int64_t threads = at::get_num_threads();
    const int64_t parts = start + n < ATTENTION_BLOCK_KEYS ? n  // short: a row per call, the cache read in place
                          : std::min<int64_t>(n, std::max<int64_t>(1, (2 * threads + Hkv - 1) / Hkv));
    const int64_t per = (n + parts - 1) / parts;
    at::parallel_for(0, Hkv * parts, 1, [&](int64_t p0, int64_t p1) {
        std::vector<float> out(per * G * hd);
        for (int64_t p = p0; p < p1; p++) {
            const int kv = (int)(p / parts), r0 = (int)(p % parts * per), r1 = (int)std::min<int64_t>(n, r0 + per);
            if (r0 >= r1) continue;
            attend_rows_avx512(qp, kp, vp, bf16_cache, s, kv, r0, r1, out.data());
            for (int row = r0; row < r1; row++)
                for (int64_t g = 0; g < G; g++) {
                    const int64_t at = ((kv * G + g) * n + row) * hd;
                    const float* o = out.data() + ((row - r0) * G + g) * hd;
                    for (int64_t d = 0; d < hd; d++) {
                        if (bf16_out)
                            static_cast<uint16_t*>(yp)[at + d] = to_bf16(o[d]);
                        else
                            static_cast<float*>(yp)[at + d] = o[d];
                    }
                }
        }
    });
    return y;
}

// The tokens that could be a row's argmax (argmax_head.py's `choose`): from the int8 head's logits
// A of x [M, K] and, per token, the bound c0 norms[0] + c1 norms[1] on their distance from the float32
// logits, with c0 = max(||x8||, ||x|| slack) slack and c1 = (||x - x8|| + gamma ||x|| slack +
// own_gamma ||x8||) slack: every token whose upper end reaches the best lower end (less a margin),
// as (row, id) pairs, ascending. Each row on its own.
void head_candidates(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale, const at::Tensor& norms,
                     double gamma, double own_gamma, double slack, double score_slack, std::vector<int64_t>& rows,
                     std::vector<int64_t>& ids) {
    const Isa& isa = chosen();
    auto [logits, act] = head_on(x, tiles, scale, isa);
    const int64_t M = x.size(0), K = x.size(1), V = scale.numel();
    TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == 2 * V,
                "head_choose: norms must be contiguous float32 [2, V]");
    const float *w0 = norms.data_ptr<float>(), *w1 = w0 + V, *A = logits.data_ptr<float>(), *a = act.data_ptr<float>();
    thread_local std::vector<int32_t> found;
    for (int64_t m = 0; m < M; m++) {  // one thread: a row's scan takes microseconds on AVX512
        double x2 = 0;
        for (int64_t k = 0; k < K; k++) x2 += (double)x.data_ptr<float>()[m * K + k] * x.data_ptr<float>()[m * K + k];
        const float x_norm = std::nextafter((float)std::sqrt(x2), INFINITY) * (float)slack;
        const float c0 = std::max(a[2 * m], x_norm) * (float)slack;
        const float c1 = (a[2 * m + 1] + (float)gamma * x_norm + (float)own_gamma * a[2 * m]) * (float)slack;
        const float* Am = A + m * V;
        float best_low, best_high;
        isa.range(Am, w0, w1, c0, c1, V, &best_low, &best_high);
        const float margin = (std::fabs(best_low) + std::fabs(best_high) + 1.0f) * (float)score_slack;
        found.resize(V);
        found.resize(isa.pick(Am, w0, w1, c0, c1, V, best_low - 2.0f * margin, found.data()));
        for (int32_t id : found) rows.push_back(m), ids.push_back(id);
    }
}

const float* head_weight(const at::Tensor& weight, int64_t K, const char* op) {
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
                    weight.size(1) == K && K % HEAD_DOT_LANES == 0,
                op, ": the head must be contiguous float32 [V, K], K % 16 == 0");
    return weight.data_ptr<float>();
}

// The greedy choice of each row of x [M, K]: the argmax of the float32 logits (head_dot, weight
// [V, K]) over the candidates the int8 head leaves, the first of equal logits -> int64 [M].
at::Tensor head_choose(const at::Tensor& x_in, const at::Tensor& tiles, const at::Tensor& scale,
                       const at::Tensor& norms, const at::Tensor& weight, double gamma, double own_gamma,
                       double slack, double score_slack) {
    const at::Tensor x = x_in.to(at::kFloat).contiguous().view({-1, x_in.size(-1)});
    const int64_t M = x.size(0), K = x.size(1);
    const float* w = head_weight(weight, K, "head_choose");
    TORCH_CHECK(weight.size(0) == scale.numel(), "head_choose: the head and its int8 copy differ in size");
    std::vector<int64_t> rows, ids;
    head_candidates(x, tiles, scale, norms, gamma, own_gamma, slack, score_slack, rows, ids);
    const head_dot_fn dot = chosen().dot;
    at::Tensor choice = at::zeros({M}, at::TensorOptions().dtype(at::kLong));
    int64_t* out = choice.data_ptr<int64_t>();
    std::vector<float> best(M, -INFINITY);
    std::vector<bool> seen(M, false);
    for (size_t i = 0; i < rows.size(); i++) {
        const int64_t m = rows[i];
        const float logit = dot(w + ids[i] * K, x.data_ptr<float>() + m * K, K);
        if (!seen[m] || logit > best[m]) best[m] = logit, out[m] = ids[i], seen[m] = true;
    }
    return choice;
}

// The float32 logits (head_dot) of x's row rows[i] for token ids[i] -> float32 [n].
at::Tensor head_dots(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& rows_in,
                     const at::Tensor& ids_in) {
    const at::Tensor x = x_in.to(at::kFloat).contiguous().view({-1, x_in.size(-1)});
    const int64_t M = x.size(0), K = x.size(1), V = weight.size(0);
    const float* w = head_weight(weight, K, "head_dots");
    const at::Tensor rows = rows_in.to(at::kLong).contiguous(), ids = ids_in.to(at::kLong).contiguous();
    TORCH_CHECK(rows.numel() == ids.numel(), "head_dots: rows and ids differ in length");
    at::Tensor y = at::empty({ids.numel()}, x.options());
    const int64_t *r = rows.data_ptr<int64_t>(), *t = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); i++) {
        TORCH_CHECK(r[i] >= 0 && r[i] < M && t[i] >= 0 && t[i] < V, "head_dots: a row or id out of range");
        y.data_ptr<float>()[i] = chosen().dot(w + t[i] * K, x.data_ptr<float>() + r[i] * K, K);
    }
    return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t n) {
    return linear_on(x, tiles, n, chosen());
}

at::Tensor q4_linear_on(const at::Tensor& x, const at::Tensor& tiles, int64_t n, c10::string_view isa) {
    return linear_on(x, tiles, n, named(isa));
}

at::Tensor kq_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t type, int64_t n) {
    return kq_linear_on(x, tiles, type, n, chosen());
}

at::Tensor kq_linear_named(const at::Tensor& x, const at::Tensor& tiles, int64_t type, int64_t n,
                           c10::string_view isa) {
    return kq_linear_on(x, tiles, type, n, named(isa));
}

std::tuple<at::Tensor, at::Tensor> q8_head(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale) {
    return head_on(x, tiles, scale, chosen());
}

std::tuple<at::Tensor, at::Tensor> q8_head_on(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale,
                                              c10::string_view isa) {
    return head_on(x, tiles, scale, named(isa));
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
    m.def("kq_linear(Tensor x, Tensor tiles, int type, int n) -> Tensor");
    m.def("kq_linear_on(Tensor x, Tensor tiles, int type, int n, str isa) -> Tensor");
    m.def("kq_rows(Tensor tiles, int type, int K, Tensor ids) -> Tensor");
    m.def("q8_head(Tensor x, Tensor tiles, Tensor scale) -> (Tensor, Tensor)");
    m.def("q8_head_on(Tensor x, Tensor tiles, Tensor scale, str isa) -> (Tensor, Tensor)");
    m.def("head_choose(Tensor x, Tensor tiles, Tensor scale, Tensor norms, Tensor weight, float gamma, "
          "float own_gamma, float slack, float score_slack) -> Tensor");
    m.def("head_dots(Tensor x, Tensor weight, Tensor rows, Tensor ids) -> Tensor");
    m.def("attend_rows(Tensor q, Tensor k, Tensor v, SymInt start, int window=0) -> Tensor");
    m.def("q4_isa() -> str", q4_isa);
    m.def("q4_isas() -> str[]", q4_isas);
}

TORCH_LIBRARY_IMPL(specchat, CPU, m) {
    m.impl("q4_linear", q4_linear);
    m.impl("q4_linear_on", q4_linear_on);
    m.impl("kq_linear", kq_linear);
    m.impl("kq_linear_on", kq_linear_named);
    m.impl("kq_rows", kq_rows);
    m.impl("q8_head", q8_head);
    m.impl("q8_head_on", q8_head_on);
    m.impl("attend_rows", attend_rows);
    m.impl("head_choose", head_choose);
    m.impl("head_dots", head_dots);
}

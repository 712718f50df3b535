// Attention of query rows over a KV cache, each row on its own (attention_avx512.cpp says how).
#pragma once
#include <cstdint>

struct AttentionShape {
    int heads, kv_heads;  // query heads, key/value heads (query head h reads kv head h / (heads / kv_heads))
    int rows;             // query rows; row i attends over keys [first_key(start + i + 1), start + i + 1)
    int head_dim;
    long cache_len;       // positions the cache holds room for
    long start;
    long window;          // a sliding-window layer's keys a row sees (its own included); 0: all before it
};

// The first key a row whose keys end at `end` sees.
inline long first_key(const AttentionShape& s, long end) { return s.window > 0 && end > s.window ? end - s.window : 0; }

// Keys from which a block of rows widens its keys and values once (attention_avx512.cpp); below,
// each row reads the cache in place. The same bits either way; re-measure the crossover with
// `python scripts/attention_bench.py` (at 128 keys reading in place was faster, at 512 widening).
constexpr long ATTENTION_BLOCK_KEYS = 256;

// Whether attend_rows_avx512 takes these heads (at most 16 query heads a kv head, head_dim a
// multiple of 16 up to 256).
bool attention_fits(int heads, int kv_heads, int head_dim);

// q [heads, rows, head_dim] float32; k, v [kv_heads, cache_len, head_dim] (bfloat16 bits or
// float32); out [r1 - r0, heads / kv_heads, head_dim] float32: rows r0..r1-1 of the query heads of
// kv head `kv` (any split of the rows gives each row the same bits).
void attend_rows_avx512(const float* q, const void* k, const void* v, bool bf16_cache, const AttentionShape& s,
                        int kv, int r0, int r1, float* out);

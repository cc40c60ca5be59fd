// One decode-attention call of paged_decode_attention.cpp, as its callers fill it in: the
// Python wrapper (a ctypes mirror, `_DecodeProblem`) and decode_layers.cpp, which sets the
// per-layer fields of a problem Python prepared for the step.
#pragma once

#include <cstdint>

namespace edgeinfer {

struct DecodeProblem {
  const void* q;  // [B, H, D], rows strided, D contiguous
  int64_t q_stride_b, q_stride_h;
  const void* k_cache;  // [num_blocks, page, Hkv, D] contiguous
  const void* v_cache;
  const int32_t* tables;  // [B, table_stride]
  int64_t table_stride;
  const int32_t* lens;  // [B]: keys to attend (0: the output row is zero)
  int64_t batch, heads, kv_heads, dim, page;
  int64_t min_split;  // fewest keys per work unit (a multiple of page)
  float scale;
  void* out;  // [B, H, D] contiguous
};

}  // namespace edgeinfer

// A small decode step's decoder layers in one call: no Python between a layer's ops.
//
// At one to eight rows a Llama layer is eleven short ops (two norms, four projections, the
// rotation, the KV write, attention, SiLU x up, the residual adds). Called one by one from
// Python, each paid ~3-5 us of interpreter and wrapper time, ~1.5-2 ms of a SmolLM2 step at
// batch 1. This file only sequences them: every op is one of the other compiled kernels
// (skinny GEMM, the pointwise ops, decode attention), reached through the function pointers
// Python hands in, so each kernel keeps one copy and this file knows only their C signatures.
// What this file computes itself (the KV write, the last residual add) rounds as torch does, so
// a step's tokens equal the op-by-op path's bit for bit.
#include <cstdint>
#include <cstring>

#include "cpu_dtypes.h"
#include "decode_problem.h"

namespace {

using edgeinfer::DecodeProblem;
using edgeinfer::narrow;
using edgeinfer::widen;

using GemmFn = int (*)(const void* x, int64_t x_stride, const void* panels, const void* bias,
                       int64_t rows, int64_t in, int64_t out, void* y, int threads);
using RmsFn = void (*)(const void* x, int64_t x_stride, const void* weight, float eps,
                       int64_t rows, int64_t cols, void* out, int threads);
using AddRmsFn = void (*)(const void* x, int64_t x_stride, const void* delta,
                          int64_t delta_stride, const void* weight, float eps, int64_t rows,
                          int64_t cols, void* sum, void* out, int threads);
using RotateFn = void (*)(void* x, int64_t stride_t, int64_t stride_h, int64_t tokens,
                          int64_t heads, int64_t dim, const void* cos, const void* signed_sin,
                          int threads);
using SiluMulFn = void (*)(const void* gate_up, int64_t stride, int64_t tokens, int64_t inter,
                           void* out, int threads);
using AttentionFn = int (*)(const DecodeProblem* p, int threads);

// The kernels of one dtype.
struct Ops {
  GemmFn gemm;
  RmsFn rms_norm;
  AddRmsFn add_rms_norm;
  RotateFn rotate;
  SiluMulFn silu_mul;
  AttentionFn attention;
};

// One layer's weights (skinny GEMM panels, norm weights, optional biases) and KV caches.
struct Layer {
  const void* input_norm;  // [hidden]
  const void* post_norm;   // [hidden]
  const void* qkv;         // panels of [(H + 2 Hkv) D, hidden]
  const void* qkv_bias;    // [(H + 2 Hkv) D] or null
  const void* o;           // panels of [hidden, H D]
  const void* o_bias;
  const void* gate_up;  // panels of [2 I, hidden]
  const void* gate_up_bias;
  const void* down;  // panels of [hidden, I]
  const void* down_bias;
  void* k_cache;  // [num_blocks, page, Hkv, D] contiguous
  void* v_cache;
};

struct Dims {
  int64_t hidden, heads, kv_heads, head_dim, inter, elem_size;
  float eps;
  float scale;  // attention's, 1 / sqrt(head_dim) for Llama
};

// One step: the residual stream, the rotation and KV slots of its rows, the attention problem
// Python prepared (block tables, lengths), and scratch rows for every intermediate.
struct Step {
  int64_t rows;
  void* x;              // [rows, hidden]: the layers' input, overwritten with their output
  const int64_t* slots;  // [rows]: each row's slot in the flattened caches
  const void* cos;       // [rows, D]
  const void* signed_sin;
  DecodeProblem* attention;
  void* normed;   // [rows, hidden]
  void* qkv;      // [rows, (H + 2 Hkv) D]
  void* attn;     // [rows, H D]
  void* o;        // [rows, hidden]
  void* total;    // [rows, hidden]
  void* gate_up;  // [rows, 2 I]
  void* act;      // [rows, I]
  void* down;     // [rows, hidden]
};

template <typename T>
void add_rows(const void* a, const void* b, void* out, int64_t n) {
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  T* o = static_cast<T*>(out);
  for (int64_t i = 0; i < n; ++i) narrow(widen(x[i]) + widen(y[i]), o + i);  // torch's add
}

template <typename T>
int run(const Ops& ops, const Layer* layers, int64_t num_layers, const Dims& d, const Step& s,
        int threads) {
  const int64_t h = d.heads, hkv = d.kv_heads, dim = d.head_dim, n = s.rows;
  const int64_t width = (h + 2 * hkv) * dim;  // one row of q, k and v heads
  const int64_t kv_row = hkv * dim * d.elem_size;
  char* qkv = static_cast<char*>(s.qkv);
  DecodeProblem& p = *s.attention;
  for (int64_t i = 0; i < num_layers; ++i) {
    const Layer& l = layers[i];
    ops.rms_norm(s.x, d.hidden, l.input_norm, d.eps, n, d.hidden, s.normed, threads);
    if (ops.gemm(s.normed, d.hidden, l.qkv, l.qkv_bias, n, d.hidden, width, s.qkv, threads))
      return 1;
    ops.rotate(s.qkv, width, dim, n, h + hkv, dim, s.cos, s.signed_sin, threads);  // q and k
    for (int64_t t = 0; t < n; ++t) {
      const char* row = qkv + t * width * d.elem_size;
      std::memcpy(static_cast<char*>(l.k_cache) + s.slots[t] * kv_row, row + h * dim * d.elem_size,
                  kv_row);
      std::memcpy(static_cast<char*>(l.v_cache) + s.slots[t] * kv_row,
                  row + (h + hkv) * dim * d.elem_size, kv_row);
    }
    p.q = s.qkv;
    p.q_stride_b = width;
    p.q_stride_h = dim;
    p.k_cache = l.k_cache;
    p.v_cache = l.v_cache;
    p.scale = d.scale;
    p.out = s.attn;
    if (ops.attention(&p, threads)) return 2;
    if (ops.gemm(s.attn, h * dim, l.o, l.o_bias, n, h * dim, d.hidden, s.o, threads)) return 1;
    ops.add_rms_norm(s.x, d.hidden, s.o, d.hidden, l.post_norm, d.eps, n, d.hidden, s.total,
                     s.normed, threads);
    if (ops.gemm(s.normed, d.hidden, l.gate_up, l.gate_up_bias, n, d.hidden, 2 * d.inter,
                 s.gate_up, threads))
      return 1;
    ops.silu_mul(s.gate_up, 2 * d.inter, n, d.inter, s.act, threads);
    if (ops.gemm(s.act, d.inter, l.down, l.down_bias, n, d.inter, d.hidden, s.down, threads))
      return 1;
    add_rows<T>(s.total, s.down, s.x, n * d.hidden);
  }
  return 0;
}

}  // namespace

extern "C" {

// Returns 0, 1 when a projection refused its sizes, 2 when attention could not allocate its
// scratch (the step's output is then not defined).
int edgeinfer_decode_layers_f32(const Ops* ops, const Layer* layers, int64_t num_layers,
                                const Dims* dims, const Step* step, int threads) {
  return run<float>(*ops, layers, num_layers, *dims, *step, threads);
}
int edgeinfer_decode_layers_bf16(const Ops* ops, const Layer* layers, int64_t num_layers,
                                 const Dims* dims, const Step* step, int threads) {
  return run<uint16_t>(*ops, layers, num_layers, *dims, *step, threads);
}
}

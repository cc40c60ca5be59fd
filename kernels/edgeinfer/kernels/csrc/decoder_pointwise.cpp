// The pointwise work of a decoder layer on the CPU, each in one pass over its rows: RMSNorm
// (optionally after the residual add), the rotary rotation of q and k in place, and SiLU(gate)
// times up.
//
// Built and loaded by edgeinfer/kernels/native_build.py; called through ctypes by
// decoder_pointwise.py, which checks shapes and dtypes first. Why: in torch these are 2-5 ops
// each (add, rms_norm, weight mul; roll, mul, mul, add; silu, mul), and in a prefill chunk every
// op is another pass over activations that the matmul before it has just pushed out of cache.
//
// Rounding follows transformers': float32 throughout; bfloat16 computes each op in float32 and
// rounds where torch's bf16 ops round (the residual sum, the normalised row before the weight,
// each product of the rotation and their sum, SiLU's result before the product).

#include <cmath>
#include <cstdint>
#include <omp.h>
#include <vector>

#include "cpu_dtypes.h"

namespace {

using edgeinfer::narrow;
using edgeinfer::widen;

// Below this many elements a call runs on the calling thread: waking the pool costs more.
constexpr int64_t kParallelMin = 1 << 15;

template <typename T>
inline float rounded(float x) {  // x rounded to T's precision, kept as float
  T t;
  narrow(x, &t);
  return widen(t);
}

// One row: out = weight * narrow(row * rsqrt(mean(row^2) + eps)); row is float32.
template <typename T>
void norm_row(const float* row, const T* weight, float eps, int64_t cols, T* out) {
  float squares = 0.0f;
  for (int64_t c = 0; c < cols; ++c) squares += row[c] * row[c];
  const float inv = 1.0f / std::sqrt(squares / float(cols) + eps);
  for (int64_t c = 0; c < cols; ++c) narrow(widen(weight[c]) * rounded<T>(row[c] * inv), out + c);
}

// out = rms_norm(x), or with delta: sum = x + delta (rounded to T, as torch's add) and
// out = rms_norm(sum).
template <typename T>
void norm_rows(const T* x, int64_t x_stride, const T* delta, int64_t delta_stride,
               const T* weight, float eps, int64_t rows, int64_t cols, T* sum, T* out,
               int threads) {
  const int nt = rows * cols >= kParallelMin ? threads : 1;
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> row(cols);  // one row in float32, per thread
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * x_stride;
      if (delta) {
        T* s = sum + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          narrow(widen(xr[c]) + widen(delta[r * delta_stride + c]), s + c);
          row[c] = widen(s[c]);
        }
      } else {
        for (int64_t c = 0; c < cols; ++c) row[c] = widen(xr[c]);
      }
      norm_row(row.data(), weight, eps, cols, out + r * cols);
    }
  }
}

// x[t, h, :] = x * cos[t] + roll(x, dim / 2) * signed_sin[t], in place; cos and signed_sin
// are [tokens, dim] rows in T (signed_sin's first half negated: rotate_half as a roll).
template <typename T>
void rotate(T* x, int64_t stride_t, int64_t stride_h, int64_t tokens, int64_t heads, int64_t dim,
            const T* cos, const T* signed_sin, int threads) {
  const int64_t half = dim / 2;
  const int nt = tokens * heads * dim >= kParallelMin ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < tokens * heads; ++i) {
    const int64_t t = i / heads, h = i % heads;
    T* v = x + t * stride_t + h * stride_h;
    const T* c = cos + t * dim;
    const T* s = signed_sin + t * dim;
    for (int64_t d = 0; d < half; ++d) {
      const float lo = widen(v[d]), hi = widen(v[d + half]);
      narrow(rounded<T>(lo * widen(c[d])) + rounded<T>(hi * widen(s[d])), v + d);
      narrow(rounded<T>(hi * widen(c[d + half])) + rounded<T>(lo * widen(s[d + half])),
             v + d + half);
    }
  }
}

// out[t, :] = silu(gate_up[t, :inter]) * gate_up[t, inter:].
template <typename T>
void silu_mul(const T* gate_up, int64_t stride, int64_t tokens, int64_t inter, T* out,
              int threads) {
  const int nt = tokens * inter >= kParallelMin ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* g = gate_up + t * stride;
    const T* u = g + inter;
    T* o = out + t * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float x = widen(g[i]);
      narrow(rounded<T>(x / (1.0f + std::exp(-x))) * widen(u[i]), o + i);
    }
  }
}

}  // namespace

#define EDGEINFER_POINTWISE(SUFFIX, T)                                                        \
  void edgeinfer_rms_norm_##SUFFIX(const T* x, int64_t x_stride, const T* weight, float eps,  \
                                   int64_t rows, int64_t cols, T* out, int threads) {         \
    norm_rows<T>(x, x_stride, nullptr, 0, weight, eps, rows, cols, nullptr, out, threads);    \
  }                                                                                           \
  void edgeinfer_add_rms_norm_##SUFFIX(const T* x, int64_t x_stride, const T* delta,          \
                                       int64_t delta_stride, const T* weight, float eps,      \
                                       int64_t rows, int64_t cols, T* sum, T* out,            \
                                       int threads) {                                         \
    norm_rows(x, x_stride, delta, delta_stride, weight, eps, rows, cols, sum, out, threads);  \
  }                                                                                           \
  void edgeinfer_rotate_##SUFFIX(T* x, int64_t stride_t, int64_t stride_h, int64_t tokens,    \
                                 int64_t heads, int64_t dim, const T* cos,                    \
                                 const T* signed_sin, int threads) {                          \
    rotate(x, stride_t, stride_h, tokens, heads, dim, cos, signed_sin, threads);              \
  }                                                                                           \
  void edgeinfer_silu_mul_##SUFFIX(const T* gate_up, int64_t stride, int64_t tokens,          \
                                   int64_t inter, T* out, int threads) {                      \
    silu_mul(gate_up, stride, tokens, inter, out, threads);                                   \
  }

extern "C" {
EDGEINFER_POINTWISE(f32, float)
EDGEINFER_POINTWISE(bf16, uint16_t)
}

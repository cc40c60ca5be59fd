// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for a handful of rows M: the projections of a decode
// step of one or two sequences, which stream every weight byte once for a few dot products.
//
// Built and loaded by edgeinfer/kernels/native_build.py; called through ctypes by
// skinny_gemm.py, which checks shapes and dtypes first. Runs on torch's own OpenMP threads
// (see paged_decode_attention.cpp for why that works).
//
// Why not oneDNN: at one row its matmul reads SmolLM2's weights at ~30 GB/s on 2 EPYC cores
// where a plain read reaches ~40-46. Here a thread owns a contiguous range of output rows and
// streams R weight rows at once (eight independent streams keep enough loads in flight), each
// multiplied into M accumulators. Past ~2 rows the dot products themselves become the limit
// (one 16-wide FMA per cycle per core on Zen 4) and oneDNN's blocked kernels win, so callers
// stop using this at a few rows.
//
// Vectors are GCC vector extensions of 16 floats: AVX-512 registers where the CPU has them,
// pairs of AVX2 registers otherwise, the same source either way.

#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>

#include "cpu_dtypes.h"

namespace {

using edgeinfer::narrow;
using edgeinfer::widen;

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxRows = 4;
constexpr int64_t kMaxIn = 1 << 20;  // longest input row

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t vhalf __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vfloat load(const uint16_t* p) {  // bfloat16 bits widened exactly, as widen() does
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  vuint u = __builtin_convertvector(h, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline float lane_sum(vfloat v) {
  float s = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Output rows [n0, n0 + R) for all M input rows; xs is [M, K] float32.
template <typename T, int64_t M, int64_t R>
void tile(const float* xs, const T* w, const T* bias, int64_t K, int64_t N, int64_t n0, T* y) {
  vfloat acc[R][M];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) acc[r][m] = vfloat{};
  const int64_t body = K - K % kLanes;
  for (int64_t k = 0; k < body; k += kLanes) {
    vfloat xv[M];
    for (int64_t m = 0; m < M; ++m) xv[m] = load(xs + m * K + k);
    for (int64_t r = 0; r < R; ++r) {
      const vfloat wv = load(w + (n0 + r) * K + k);
      for (int64_t m = 0; m < M; ++m) acc[r][m] += wv * xv[m];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const T* row = w + (n0 + r) * K;
    for (int64_t m = 0; m < M; ++m) {
      float s = lane_sum(acc[r][m]);
      for (int64_t k = body; k < K; ++k) s += widen(row[k]) * xs[m * K + k];
      if (bias) s += widen(bias[n0 + r]);
      narrow(s, y + m * N + n0 + r);
    }
  }
}

template <typename T, int64_t M>
void rows_of(const float* xs, const T* w, const T* bias, int64_t K, int64_t N, T* y,
             int threads) {
  // Eight weight streams per thread at one or two rows; four at three or four rows, where
  // eight would need more accumulators than there are registers.
  constexpr int64_t R = M <= 2 ? 8 : 4;
  const int64_t tiles = N / R;
#pragma omp parallel num_threads(threads)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = tiles * t / nt, last = tiles * (t + 1) / nt;
    for (int64_t i = first; i < last; ++i) tile<T, M, R>(xs, w, bias, K, N, i * R, y);
    if (t == nt - 1)
      for (int64_t n = tiles * R; n < N; ++n) tile<T, M, 1>(xs, w, bias, K, N, n, y);
  }
}

template <typename T>
int run(const T* x, int64_t x_stride, const T* w, const T* bias, int64_t M, int64_t K, int64_t N,
        T* y, int threads) {
  if (M < 1 || M > kMaxRows || K < 1 || K > kMaxIn || N < 1) return 1;
  // The input rows, widened once: every tile reads them again from L1.
  static thread_local std::vector<float> staged;
  if (staged.size() < size_t(M * K)) staged.resize(M * K);
  float* xs = staged.data();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xs[m * K + k] = widen(x[m * x_stride + k]);
  switch (M) {
    case 1: rows_of<T, 1>(xs, w, bias, K, N, y, threads); break;
    case 2: rows_of<T, 2>(xs, w, bias, K, N, y, threads); break;
    case 3: rows_of<T, 3>(xs, w, bias, K, N, y, threads); break;
    default: rows_of<T, 4>(xs, w, bias, K, N, y, threads); break;
  }
  return 0;
}

}  // namespace

extern "C" {

int64_t edgeinfer_skinny_max_rows() { return kMaxRows; }
int64_t edgeinfer_skinny_max_in() { return kMaxIn; }

// Returns 0, or 1 when the sizes are out of range (nothing written).
int edgeinfer_skinny_gemm_f32(const float* x, int64_t x_stride, const float* w, const float* bias,
                              int64_t rows, int64_t in, int64_t out, float* y, int threads) {
  return run(x, x_stride, w, bias, rows, in, out, y, threads);
}

int edgeinfer_skinny_gemm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                               const uint16_t* bias, int64_t rows, int64_t in, int64_t out,
                               uint16_t* y, int threads) {
  return run(x, x_stride, w, bias, rows, in, out, y, threads);
}

}  // extern "C"

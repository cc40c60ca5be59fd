// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float32 for a handful of rows M: the projections
// of a decode step, which stream every weight byte once for a few dot products each.
//
// Built and loaded by edgeinfer/kernels/native_build.py; called through ctypes by
// skinny_gemm.py, which checks shapes first and lays the weight out in panels (below). Runs on
// torch's own OpenMP threads (see paged_decode_attention.cpp for why that works).
//
// The weight is held in panels of 16 output rows, each panel [K, 16]: row k of a panel is the
// 16 outputs' weights for input k, one vector. A tile keeps NB panels' worth of outputs for MB
// input rows in registers (MB x NB accumulators) and, for each k, loads NB weight vectors and
// broadcasts MB inputs: outer products, no horizontal sums, each weight byte read once per
// call. A thread owns a contiguous range of panels, so it streams NB separate regions at once.
//
// Why not oneDNN: at 1-8 rows its packed matmul read SmolLM2's projections at 20-30 GB/s on 2
// EPYC cores (small weights worst: ~40 us of fixed cost per call), where this reaches ~35-45.
//
// Vectors are GCC vector extensions of 16 floats: AVX-512 registers where the CPU has them,
// pairs of AVX2 registers otherwise, the same source either way.

#include <cstdint>
#include <cstring>
#include <omp.h>

namespace {

constexpr int64_t kPanel = 16;   // outputs per panel: one vector
constexpr int64_t kMaxRows = 8;  // rows per call (more: callers use oneDNN)

typedef float vfloat __attribute__((vector_size(kPanel * sizeof(float))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Outputs of panels [p0, p0 + NB) for MB rows of x. x rows are x_stride apart.
template <int64_t MB, int64_t NB>
void tile(const float* x, int64_t x_stride, const float* panels, const float* bias, int64_t K,
          int64_t N, int64_t p0, float* y) {
  vfloat acc[MB][NB];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t b = 0; b < NB; ++b) acc[m][b] = vfloat{};
  const float* w = panels + p0 * K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    vfloat wv[NB];
    for (int64_t b = 0; b < NB; ++b) wv[b] = load(w + (b * K + k) * kPanel);
    for (int64_t m = 0; m < MB; ++m) {
      const float xm = x[m * x_stride + k];
      for (int64_t b = 0; b < NB; ++b) acc[m][b] += xm * wv[b];
    }
  }
  for (int64_t b = 0; b < NB; ++b) {
    const int64_t n0 = (p0 + b) * kPanel;
    const int64_t width = N - n0 < kPanel ? N - n0 : kPanel;  // the last panel may be partial
    for (int64_t m = 0; m < MB; ++m)
      for (int64_t i = 0; i < width; ++i)
        y[m * N + n0 + i] = acc[m][b][i] + (bias ? bias[n0 + i] : 0.0f);
  }
}

// NB panels per tile: as many weight streams as the registers allow beside MB x NB
// accumulators (32 vector registers with AVX-512).
template <int64_t MB>
constexpr int64_t streams() {
  return MB <= 2 ? 8 : MB <= 4 ? 6 : 3;
}

template <int64_t MB>
void rows_of(const float* x, int64_t x_stride, const float* panels, const float* bias, int64_t K,
             int64_t N, float* y, int threads) {
  constexpr int64_t NB = streams<MB>();
  const int64_t count = (N + kPanel - 1) / kPanel;
#pragma omp parallel num_threads(threads)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = count * t / nt, last = count * (t + 1) / nt;
    int64_t p = first;
    for (; p + NB <= last; p += NB) tile<MB, NB>(x, x_stride, panels, bias, K, N, p, y);
    for (; p < last; ++p) tile<MB, 1>(x, x_stride, panels, bias, K, N, p, y);
  }
}

}  // namespace

extern "C" {

int64_t edgeinfer_skinny_max_rows() { return kMaxRows; }
int64_t edgeinfer_skinny_panel() { return kPanel; }

// panels: [ceil(out / 16), in, 16] (outputs past `out` zero). Returns 0, or 1 when the sizes
// are out of range (nothing written).
int edgeinfer_skinny_gemm_f32(const float* x, int64_t x_stride, const float* panels,
                              const float* bias, int64_t rows, int64_t in, int64_t out, float* y,
                              int threads) {
  if (rows < 0 || rows > kMaxRows || in < 1 || out < 1) return 1;
  switch (rows) {
    case 0: break;
    case 1: rows_of<1>(x, x_stride, panels, bias, in, out, y, threads); break;
    case 2: rows_of<2>(x, x_stride, panels, bias, in, out, y, threads); break;
    case 3: rows_of<3>(x, x_stride, panels, bias, in, out, y, threads); break;
    case 4: rows_of<4>(x, x_stride, panels, bias, in, out, y, threads); break;
    case 5: rows_of<5>(x, x_stride, panels, bias, in, out, y, threads); break;
    case 6: rows_of<6>(x, x_stride, panels, bias, in, out, y, threads); break;
    case 7: rows_of<7>(x, x_stride, panels, bias, in, out, y, threads); break;
    default: rows_of<8>(x, x_stride, panels, bias, in, out, y, threads); break;
  }
  return 0;
}

}  // extern "C"

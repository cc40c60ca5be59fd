// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float32, or bfloat16 where the target has
// AVX512-BF16, for a handful of rows M: the projections of a decode step, which stream every
// weight byte once for a few dot products each.
//
// Built and loaded by edgeinfer/kernels/native_build.py; called through ctypes by
// skinny_gemm.py, which checks shapes first and lays the weight out in panels (below). Runs on
// torch's own OpenMP threads (see paged_decode_attention.cpp for why that works).
//
// The weight is held in panels of one vector register's worth of output rows, each panel
// [K, width]: row k of a panel is those outputs' weights for input k, one vector. A tile keeps
// NB panels' worth of outputs for MB input rows in registers (MB x NB accumulators) and, for
// each k, loads NB weight vectors and broadcasts MB inputs: outer products, no horizontal sums,
// each weight byte read once per call. A thread owns a contiguous range of panels, so it
// streams NB separate regions at once.
//
// The panel width and NB follow the target's registers: 16 floats and 32 registers with
// AVX-512, 8 and 16 with AVX2, 4 and 16 with SSE. (Panels of 16 on AVX2, as pairs of 8-float
// registers, needed 2 x MB x NB registers for the accumulators alone: from 2 rows on they
// spilled, and the kernel ran at 0.1-0.7x oneDNN on an AVX2 EPYC.) The Python side asks the
// library for its width, so a panel layout always matches the build that reads it.
//
// Why not oneDNN: at 1-8 rows its packed matmul read SmolLM2's projections at 20-30 GB/s on 2
// EPYC cores (small weights worst: ~40 us of fixed cost per call), where this reaches ~35-45.
// Which one runs is measured per shape and row count at load (kernel_choice.py).
//
// float32 with weights held in bfloat16 ("w16": a float32 model loaded from a bf16 checkpoint,
// whose weights are bf16 values exactly) uses the float32 tiles on panels of 16-bit weights,
// each widened to float32 in registers (a zero-extend and a shift) as it is loaded: the same
// products and sums as the float32 kernel, bit for bit, from half the bytes. A decode step is a
// stream through the weights, so on a CPU without bf16 dot products this is where a float32
// model gets bf16's memory traffic without bf16's arithmetic.
//
// bfloat16 (below the float32 kernel) uses the same tiles with vdpbf16ps; a target without
// AVX512-BF16 (x86-64-v2, v3, most AVX-512 CPUs before Cooper Lake and Zen 4) builds without it
// and reports a panel width of 0, and bfloat16 weights stay on oneDNN there. On SmolLM2's whole
// decode step (2 Xeon cores with AMX, bf16) it read 26 GB/s at one row where oneDNN's bf16
// matmul read 17.7.

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <omp.h>

#include "cpu_dtypes.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int64_t kPanel = 16;      // outputs per panel: one vector
constexpr int64_t kRegisters = 32;  // vector registers
#elif defined(__AVX__)
constexpr int64_t kPanel = 8;
constexpr int64_t kRegisters = 16;
#else
constexpr int64_t kPanel = 4;
constexpr int64_t kRegisters = 16;
#endif
constexpr int64_t kMaxRows = 8;  // rows per call (more: callers use oneDNN)
// Bytes ahead that each panel's stream is prefetched. A tile reads NB streams at once, each
// crossing a 4 KiB page every few dozen steps, where the hardware prefetcher stops: on
// SmolLM2's whole decode step (2 Xeon cores with AVX-512) this took bfloat16 at one row from
// 22 to 26 GB/s (the host's copy bandwidth), float32 at 4 and 8 rows from 24 and 21 to 28 and 24.
constexpr int64_t kPrefetch = 1024;

typedef float vfloat __attribute__((vector_size(kPanel * sizeof(float))));
typedef uint16_t vhalf __attribute__((vector_size(kPanel * sizeof(uint16_t))));
typedef uint32_t vword __attribute__((vector_size(kPanel * sizeof(uint32_t))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// kPanel bfloat16 weights as float32: a bf16 value is a float32's upper 16 bits.
inline vfloat load(const uint16_t* p) {
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  const vword wide = __builtin_convertvector(h, vword) << 16;
  vfloat v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// Weight rows (one vector of a panel) ahead that a stream is prefetched.
template <typename W>
constexpr int64_t prefetch_rows() {
  return kPrefetch / (kPanel * int64_t(sizeof(W)));
}

// W: the panels' element, float or uint16_t (bfloat16 bits, widened as loaded).
template <int64_t MB, int64_t NB, typename W>
void tile(const float* x, int64_t x_stride, const W* panels, const float* bias, int64_t K,
          int64_t N, int64_t p0, float* y) {
  vfloat acc[MB][NB];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t b = 0; b < NB; ++b) acc[m][b] = vfloat{};
  const W* w = panels + p0 * K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    vfloat wv[NB];
    for (int64_t b = 0; b < NB; ++b) {
      __builtin_prefetch(w + (b * K + k + prefetch_rows<W>()) * kPanel);
      wv[b] = load(w + (b * K + k) * kPanel);
    }
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

// NB panels per tile: as many weight streams as the registers hold beside MB x NB accumulators,
// NB weight vectors and a broadcast input (MB * NB + NB + 1 <= registers), at most 8.
template <int64_t MB>
constexpr int64_t streams() {
  constexpr int64_t fit = (kRegisters - 1) / (MB + 1);
  return fit < 1 ? 1 : fit > 8 ? 8 : fit;
}

// Inputs per block of a split tile: NB = 3 panels of them (3 x 128 x 8 floats, 12 KiB with
// AVX2) stay in L1 while the second group of rows reads them again.
constexpr int64_t kBlockK = 128;

// sum[m][b] += the products of inputs [k0, k1) for MB rows and NB panels (starting at w), the
// accumulators in registers for the block.
template <int64_t MB, int64_t NB, typename W>
inline void accumulate(const float* x, int64_t x_stride, const W* w, int64_t K, int64_t k0,
                       int64_t k1, vfloat (*sum)[NB]) {
  vfloat acc[MB][NB];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t b = 0; b < NB; ++b) acc[m][b] = sum[m][b];
  for (int64_t k = k0; k < k1; ++k) {
    vfloat wv[NB];
    for (int64_t b = 0; b < NB; ++b) wv[b] = load(w + (b * K + k) * kPanel);
    for (int64_t m = 0; m < MB; ++m) {
      const float xm = x[m * x_stride + k];
      for (int64_t b = 0; b < NB; ++b) acc[m][b] += xm * wv[b];
    }
  }
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t b = 0; b < NB; ++b) sum[m][b] = acc[m][b];
}

// tile() for more rows than leave the registers room for 3 weight streams (AVX2 from 5 rows:
// 8 rows would keep one stream, and lost to oneDNN): the rows in two groups, G then MB - G,
// that take turns over blocks of kBlockK inputs. Each weight byte still comes from memory once.
template <int64_t MB, int64_t NB, int64_t G, typename W>
void split_tile(const float* x, int64_t x_stride, const W* panels, const float* bias,
                int64_t K, int64_t N, int64_t p0, float* y) {
  vfloat sum[MB][NB];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t b = 0; b < NB; ++b) sum[m][b] = vfloat{};
  const W* w = panels + p0 * K * kPanel;
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t k1 = K - k0 < kBlockK ? K : k0 + kBlockK;
    accumulate<G, NB>(x, x_stride, w, K, k0, k1, sum);
    accumulate<MB - G, NB>(x + G * x_stride, x_stride, w, K, k0, k1, sum + G);
  }
  for (int64_t b = 0; b < NB; ++b) {
    const int64_t n0 = (p0 + b) * kPanel;
    const int64_t width = N - n0 < kPanel ? N - n0 : kPanel;
    for (int64_t m = 0; m < MB; ++m)
      for (int64_t i = 0; i < width; ++i)
        y[m * N + n0 + i] = sum[m][b][i] + (bias ? bias[n0 + i] : 0.0f);
  }
}

template <int64_t MB, typename W>
void rows_of(const float* x, int64_t x_stride, const W* panels, const float* bias, int64_t K,
             int64_t N, float* y, int threads) {
  constexpr bool split = streams<MB>() < 3;
  constexpr int64_t G = split ? (MB + 1) / 2 : MB;  // rows of the first group
  constexpr int64_t NB = streams<G>();
  const int64_t count = (N + kPanel - 1) / kPanel;
#pragma omp parallel num_threads(threads)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = count * t / nt, last = count * (t + 1) / nt;
    int64_t p = first;
    for (; p + NB <= last; p += NB) {
      if constexpr (split)
        split_tile<MB, NB, G>(x, x_stride, panels, bias, K, N, p, y);
      else
        tile<MB, NB>(x, x_stride, panels, bias, K, N, p, y);
    }
    for (; p < last; ++p) tile<MB, 1>(x, x_stride, panels, bias, K, N, p, y);
  }
}

// Checks the sizes and calls run(std::integral_constant<int64_t, rows>{}) for rows 1-8 (rows
// is a template argument of every tile). Returns 0, or 1 when the sizes are out of range.
template <typename Run>
int by_rows(int64_t rows, int64_t in, int64_t out, Run run) {
  if (rows < 0 || rows > kMaxRows || in < 1 || out < 1) return 1;
  switch (rows) {
    case 0: break;
    case 1: run(std::integral_constant<int64_t, 1>{}); break;
    case 2: run(std::integral_constant<int64_t, 2>{}); break;
    case 3: run(std::integral_constant<int64_t, 3>{}); break;
    case 4: run(std::integral_constant<int64_t, 4>{}); break;
    case 5: run(std::integral_constant<int64_t, 5>{}); break;
    case 6: run(std::integral_constant<int64_t, 6>{}); break;
    case 7: run(std::integral_constant<int64_t, 7>{}); break;
    default: run(std::integral_constant<int64_t, 8>{}); break;
  }
  return 0;
}

template <typename W>
int f32_gemm(const float* x, int64_t x_stride, const W* panels, const float* bias, int64_t rows,
             int64_t in, int64_t out, float* y, int threads) {
  return by_rows(rows, in, out, [&](auto mb) {
    rows_of<decltype(mb)::value>(x, x_stride, panels, bias, in, out, y, threads);
  });
}

#if defined(__AVX512BF16__)
// bfloat16: weights in panels of 16 outputs by pairs of inputs, [ceil(out / 16), ceil(in / 2),
// 16, 2] (16 bits each, an odd input count padded with a zero weight): a panel's row k holds its
// outputs' weights for inputs 2k and 2k + 1, side by side, so one vdpbf16ps multiplies it by the
// broadcast pair (x[2k], x[2k + 1]) and adds both products into 16 float32 sums. The same
// outer-product tiles as above, MB rows x NB panels of accumulators, each weight vector loaded
// once for all rows; the result is rounded to bfloat16 (to nearest even, as torch casts).
constexpr int64_t kBf16Panel = 16;

// Panels per tile: one, so a thread reads its weights as one sequential stream. On 2 AMD EPYC
// (Zen 4) cores, SmolLM2's whole bf16 decode step read 31.6 GB/s at one row with tiles of 8
// panels (8 streams a thread) and 36.5 with one (the host's copy bandwidth: 36.7), 5-6% faster
// at 2-8 rows; tiles of 2 were in between. The accumulators' chains do not bind: one vdpbf16ps a
// 64-byte load is far below the core's rate. bench/skinny_tiles.py builds a variant with more
// (-DEDGEINFER_BF16_TILE_PANELS=8, as many as the registers hold up to that) and times both.
#ifndef EDGEINFER_BF16_TILE_PANELS
#define EDGEINFER_BF16_TILE_PANELS 1
#endif
template <int64_t MB>
constexpr int64_t bf16_streams() {
  constexpr int64_t fit = (32 - 1) / (MB + 1);
  return fit > EDGEINFER_BF16_TILE_PANELS ? EDGEINFER_BF16_TILE_PANELS : fit;
}

// acc[m][b] += the products of input pairs [k0, k1) (pair k: inputs 2k, 2k + 1) for MB rows of
// x and NB panels from w; `last` supplies the pair for k >= K / 2 (an odd K's last input and a
// zero), every other pair is one 32-bit load of x, broadcast.
template <int64_t MB, int64_t NB>
inline void bf16_pairs(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t pairs,
                       int64_t k0, int64_t k1, bool last, __m512 (*acc)[NB]) {
  for (int64_t k = k0; k < k1; ++k) {
    __m512bh wv[NB];
    for (int64_t b = 0; b < NB; ++b) {
      __builtin_prefetch(w + (b * pairs + k + kPrefetch / 64) * 2 * kBf16Panel);
      wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * pairs + k) * 2 * kBf16Panel);
    }
    for (int64_t m = 0; m < MB; ++m) {
      int32_t pair;
      if (last)
        pair = x[m * x_stride + 2 * k];
      else
        std::memcpy(&pair, x + m * x_stride + 2 * k, sizeof pair);
      const __m512bh xm = (__m512bh)_mm512_set1_epi32(pair);
      for (int64_t b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], wv[b], xm);
    }
  }
}

template <int64_t MB, int64_t NB>
void bf16_tile(const uint16_t* x, int64_t x_stride, const uint16_t* panels, const uint16_t* bias,
               int64_t K, int64_t N, int64_t p0, uint16_t* y) {
  const int64_t pairs = (K + 1) / 2;
  __m512 acc[MB][NB];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  const uint16_t* w = panels + p0 * pairs * 2 * kBf16Panel;
  bf16_pairs<MB, NB>(x, x_stride, w, pairs, 0, K / 2, false, acc);
  if (K % 2) bf16_pairs<MB, NB>(x, x_stride, w, pairs, K / 2, pairs, true, acc);
  for (int64_t b = 0; b < NB; ++b) {
    const int64_t n0 = (p0 + b) * kBf16Panel;
    const int64_t width = N - n0 < kBf16Panel ? N - n0 : kBf16Panel;
    const __mmask16 lanes = __mmask16((1u << width) - 1);
    float widened[kBf16Panel] = {};
    for (int64_t i = 0; bias && i < width; ++i) widened[i] = edgeinfer::widen(bias[n0 + i]);
    const __m512 add = _mm512_loadu_ps(widened);
    for (int64_t m = 0; m < MB; ++m) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][b], add));
      _mm256_mask_storeu_epi16(y + m * N + n0, lanes, (__m256i)out);
    }
  }
}

template <int64_t MB>
void bf16_rows_of(const uint16_t* x, int64_t x_stride, const uint16_t* panels,
                  const uint16_t* bias, int64_t K, int64_t N, uint16_t* y, int threads) {
  constexpr int64_t NB = bf16_streams<MB>();
  const int64_t count = (N + kBf16Panel - 1) / kBf16Panel;
#pragma omp parallel num_threads(threads)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = count * t / nt, last = count * (t + 1) / nt;
    int64_t p = first;
    for (; p + NB <= last; p += NB) bf16_tile<MB, NB>(x, x_stride, panels, bias, K, N, p, y);
    for (; p < last; ++p) bf16_tile<MB, 1>(x, x_stride, panels, bias, K, N, p, y);
  }
}
#else
constexpr int64_t kBf16Panel = 0;  // no bf16 dot products in this build: the caller uses oneDNN
#endif

}  // namespace

extern "C" {

int64_t edgeinfer_skinny_max_rows() { return kMaxRows; }
int64_t edgeinfer_skinny_panel() { return kPanel; }
int64_t edgeinfer_skinny_bf16_panel() { return kBf16Panel; }

// panels: [ceil(out / width), in, width], outputs past `out` zero (width: edgeinfer_skinny_panel).
// Returns 0, or 1 when the sizes are out of range (nothing written).
int edgeinfer_skinny_gemm_f32(const float* x, int64_t x_stride, const float* panels,
                              const float* bias, int64_t rows, int64_t in, int64_t out, float* y,
                              int threads) {
  return f32_gemm(x, x_stride, panels, bias, rows, in, out, y, threads);
}

// The same with the panels' weights as bfloat16 bits (w16, above): x, bias and y float32.
int edgeinfer_skinny_gemm_f32w16(const float* x, int64_t x_stride, const uint16_t* panels,
                                 const float* bias, int64_t rows, int64_t in, int64_t out,
                                 float* y, int threads) {
  return f32_gemm(x, x_stride, panels, bias, rows, in, out, y, threads);
}

// The same in bfloat16 (x, bias and y as their 16 bits), panels as above bf16_tile. Returns 0,
// 1 when the sizes are out of range, 2 where this build has no bf16 kernel (nothing written).
int edgeinfer_skinny_gemm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* panels,
                               const uint16_t* bias, int64_t rows, int64_t in, int64_t out,
                               uint16_t* y, int threads) {
#if defined(__AVX512BF16__)
  return by_rows(rows, in, out, [&](auto mb) {
    bf16_rows_of<decltype(mb)::value>(x, x_stride, panels, bias, in, out, y, threads);
  });
#else
  (void)x, (void)x_stride, (void)panels, (void)bias, (void)rows, (void)in, (void)out, (void)y;
  (void)threads;
  return 2;
#endif
}

}  // extern "C"

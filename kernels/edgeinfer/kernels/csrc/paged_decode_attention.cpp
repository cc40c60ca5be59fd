// Paged decode attention on the CPU: one query token per sequence, its keys and values read
// where they lie in the paged cache, on the OpenMP threads torch itself runs on.
//
// Built and loaded by edgeinfer/kernels/native_build.py (g++ -O3 -march=native -ffast-math
// -fopenmp); called through ctypes by paged_attention_native.py, which checks every shape and
// dtype first. The library's libgomp.so.1 resolves to the copy torch has already loaded, so a
// parallel region here reuses torch's thread pool (its workers are still spinning from the last
// matmul) instead of starting a second pool that would fight it for the cores.
//
// Work units are (sequence, range of its context): a unit streams through its tokens' K and V
// rows (every KV head of a token is adjacent in the page), each row read once for the H / Hkv
// query heads that share it, and long contexts split into ranges so that a small batch still
// keeps every thread busy. A unit leaves its partial softmax (running max, sum and
// unnormalised output); splits of a sequence merge afterwards (flash-decoding).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <omp.h>

#include "cpu_dtypes.h"
#include "decode_problem.h"

namespace {

using Problem = edgeinfer::DecodeProblem;
using edgeinfer::narrow;
using edgeinfer::widen;

constexpr int64_t kMaxDim = 256;  // head size (stack rows of one K or V head)
// Tokens ahead whose K or V row a unit prefetches. Pages lie in no particular order in the pool,
// so the hardware prefetcher loses the stream at every page boundary; asking for the row one
// page ahead halved the kernel's time (SmolLM2, 8 sequences of 310 tokens, float32: ~11 to
// ~5-6 ms per step of 30 layers; bf16 ~7.8 to ~3.3 ms).
constexpr int64_t kAhead = 16;

// One unit: every query head of sequence b over keys [t0, t1). A token's K (and V) rows of
// all KV heads are adjacent in its page, so the unit streams through contiguous memory.
// Leaves, per query head j, m[j] (max score), l[j] (sum of exp(score - m)) and acc[j][d]
// (unnormalised output).
// Token t's row of `row` elements (every KV head) in the paged cache.
template <typename T>
inline const T* token_row(const T* cache, const int32_t* table, int64_t page, int64_t row,
                          int64_t t) {
  return cache + (int64_t(table[t / page]) * page + t % page) * row;
}

template <typename T>
inline void prefetch_row(const T* cache, const int32_t* table, int64_t page, int64_t row,
                         int64_t t) {
  const char* bytes = reinterpret_cast<const char*>(token_row(cache, table, page, row, t));
  for (int64_t c = 0; c < int64_t(row * sizeof(T)); c += 64) __builtin_prefetch(bytes + c);
}

template <typename T, int64_t D>
void attend_range(const Problem& p, int64_t b, int64_t t0, int64_t t1, float* qs, float* scores,
                  float* m, float* l, float* acc) {
  const int64_t dim = D ? D : p.dim;
  const int64_t fold = p.heads / p.kv_heads;
  const int64_t row = p.kv_heads * dim;  // elements of one token in one page
  const int64_t n = t1 - t0;
  const int32_t* table = p.tables + b * p.table_stride;
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride_b;
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);

  for (int64_t j = 0; j < p.heads; ++j)
    for (int64_t d = 0; d < dim; ++d) qs[j * dim + d] = widen(q[j * p.q_stride_h + d]) * p.scale;

  float kf[kMaxDim];
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kAhead < t1) prefetch_row(k_cache, table, p.page, row, t + kAhead);
    const T* kr = token_row(k_cache, table, p.page, row, t);
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      for (int64_t d = 0; d < dim; ++d) kf[d] = widen(kr[h * dim + d]);
      for (int64_t f = 0; f < fold; ++f) {
        const float* qj = qs + (h * fold + f) * dim;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; ++d) s += qj[d] * kf[d];
        scores[(h * fold + f) * n + (t - t0)] = s;
      }
    }
  }
  for (int64_t j = 0; j < p.heads; ++j) {
    float* sj = scores + j * n;
    float top = sj[0];
    for (int64_t i = 1; i < n; ++i) top = std::max(top, sj[i]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) {
      sj[i] = std::exp(sj[i] - top);
      total += sj[i];
    }
    m[j] = top;
    l[j] = total;
  }
  std::fill(acc, acc + p.heads * dim, 0.f);
  float vf[kMaxDim];
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kAhead < t1) prefetch_row(v_cache, table, p.page, row, t + kAhead);
    const T* vr = token_row(v_cache, table, p.page, row, t);
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      for (int64_t d = 0; d < dim; ++d) vf[d] = widen(vr[h * dim + d]);
      for (int64_t f = 0; f < fold; ++f) {
        const float w = scores[(h * fold + f) * n + (t - t0)];
        float* aj = acc + (h * fold + f) * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) aj[d] += w * vf[d];
      }
    }
  }
}

template <typename T, int64_t D>
int run(const Problem& p, int threads) {
  const int64_t dim = D ? D : p.dim;
  // Units of sequence b are [first_unit[b], first_unit[b + 1]): prefix sums of split counts.
  int64_t* first_unit = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (p.batch + 1)));
  if (!first_unit) return 1;
  int64_t longest = 0, total = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    longest = std::max<int64_t>(longest, p.lens[b]);
    total += std::max<int64_t>(p.lens[b], 0);
  }
  // About four units per thread keep the dynamic schedule balanced; fewer keys per unit
  // than min_split would cost more in merging than they gain in balance.
  const int64_t want = (total + 4 * threads - 1) / (4 * threads);
  const int64_t split = (std::max(p.min_split, want) + p.page - 1) / p.page * p.page;
  first_unit[0] = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    first_unit[b + 1] = first_unit[b] + (std::max<int64_t>(p.lens[b], 0) + split - 1) / split;
  const int64_t units = first_unit[p.batch];
  const int64_t stride = p.heads * (dim + 2);  // one unit's partial state: m, l, acc
  float* partial =
      static_cast<float*>(std::malloc(sizeof(float) * std::max<int64_t>(units, 1) * stride));
  if (!partial) {
    std::free(first_unit);
    return 1;
  }
  const int64_t scratch = p.heads * (std::min(longest, split) + dim);  // scores, then queries
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    float* scores = static_cast<float*>(std::malloc(sizeof(float) * std::max<int64_t>(scratch, 1)));
    if (!scores) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      if (!scores) continue;
      // Binary search: the sequence whose range of units holds u.
      const int64_t b = std::upper_bound(first_unit, first_unit + p.batch + 1, u) - first_unit - 1;
      const int64_t t0 = (u - first_unit[b]) * split;
      const int64_t t1 = std::min<int64_t>(t0 + split, p.lens[b]);
      float* state = partial + u * stride;
      attend_range<T, D>(p, b, t0, t1, scores + p.heads * std::min(longest, split), scores, state,
                         state + p.heads, state + 2 * p.heads);
    }
    std::free(scores);
    // Merge each sequence's units into its output rows, one query head at a time.
#pragma omp for schedule(static)
    for (int64_t item = 0; item < p.batch * p.heads; ++item) {
      const int64_t b = item / p.heads;
      const int64_t j = item % p.heads;
      T* out = static_cast<T*>(p.out) + item * dim;
      const int64_t n = first_unit[b + 1] - first_unit[b];
      const float* first = partial + first_unit[b] * stride;
      float acc[kMaxDim] = {};
      float top = n ? first[j] : 0.f, total = 0.f;  // (no infinities: built with fast-math)
      for (int64_t s = 1; s < n; ++s) top = std::max(top, first[s * stride + j]);
      for (int64_t s = 0; s < n; ++s) {
        const float* state = first + s * stride;
        const float w = std::exp(state[j] - top);
        total += w * state[p.heads + j];
        const float* a = state + 2 * p.heads + j * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) acc[d] += w * a[d];
      }
      const float norm = n ? 1.f / total : 0.f;  // no keys: a zero row
      for (int64_t d = 0; d < dim; ++d) narrow(acc[d] * norm, out + d);
    }
  }
  std::free(partial);
  std::free(first_unit);
  return failed;
}

template <typename T>
int dispatch(const Problem& p, int threads) {
  switch (p.dim) {  // the common head sizes get loops the compiler unrolls fully
    case 64:
      return run<T, 64>(p, threads);
    case 128:
      return run<T, 128>(p, threads);
    default:
      return run<T, 0>(p, threads);
  }
}

}  // namespace

extern "C" {

// The largest head size (checked by the caller before any call).
int64_t edgeinfer_decode_max_dim() { return kMaxDim; }

// Returns 0 on success, 1 when scratch memory could not be allocated.
int edgeinfer_paged_decode_f32(const Problem* p, int threads) { return dispatch<float>(*p, threads); }
int edgeinfer_paged_decode_bf16(const Problem* p, int threads) { return dispatch<uint16_t>(*p, threads); }
}

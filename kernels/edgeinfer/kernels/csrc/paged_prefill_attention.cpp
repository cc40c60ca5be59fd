// Paged prefill attention on the CPU: a chunk of T query tokens at positions
// [start_pos, start_pos + T) attends causally to keys [0, start_pos + T) of its sequence, read
// where they lie in the paged cache (the chunk's own K/V are written there first). One kernel
// for a fresh prompt, a later chunk of a long one and a prefix-cache hit.
//
// Built like paged_decode_attention.cpp (see native_build.py) and run on torch's OpenMP threads.
// Each call first stages the sequence's keys and values once in float32, per KV head, keys
// transposed to [D, keys]. Work units are then (KV head, block of kRows query tokens), the
// latest blocks (the most keys) handed out first; a unit's H / Hkv query heads share every key
// it reads. Keys go kKeys at a time through an online softmax (flash attention): one query
// row's scores against a tile are D vector FMAs over the tile's keys, no horizontal sums, and
// four query rows share each load of the tile.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <omp.h>

#include "cpu_dtypes.h"

namespace {

using edgeinfer::narrow;
using edgeinfer::widen;

constexpr int64_t kMaxDim = 256;   // head size accepted (checked by the caller)
constexpr int64_t kRows = 32;      // query tokens per unit
constexpr int64_t kKeys = 64;      // keys per tile of the online softmax
constexpr float kMasked = -1e30f;  // the running max before any key (no infinities: fast-math)
constexpr float kMinExp = -80.f;   // exp(-80) ~ 2e-35: still a normal float, no slow path

struct Problem {
  const void* q;  // [T, H, D], rows strided, D contiguous
  int64_t q_stride_t, q_stride_h;
  const void* k_cache;  // [num_blocks, page, Hkv, D] contiguous
  const void* v_cache;
  const int32_t* table;  // [>= cdiv(start_pos + T, page)] block ids of the sequence
  int64_t tokens, start_pos, heads, kv_heads, dim, page;
  float scale;
  void* out;  // [T, H, D] contiguous
};

// Scratch of one thread: queries [R, D], output accumulators [R, D], scores [R, kKeys], and
// per row the running max, running sum, this tile's rescaling factor and visible keys.
struct Scratch {
  float* q;
  float* o;
  float* s;
  float* m;
  float* l;
  float* alpha;
  int64_t* limit;
  float* base;
  explicit Scratch(int64_t rows, int64_t dim) {
    const int64_t n = 2 * rows * dim + rows * kKeys + 5 * rows;  // limit: 2 floats' room each
    base = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * ((n + 15) / 16 * 16)));
    q = base;
    o = q + rows * dim;
    s = o + rows * dim;
    limit = reinterpret_cast<int64_t*>(s + rows * kKeys);  // 64-byte aligned: kKeys floats/row
    m = reinterpret_cast<float*>(limit + rows);
    l = m + rows;
    alpha = l + rows;
  }
  ~Scratch() { std::free(base); }
};

// The chunk's keys and values in float32, staged once per call for every unit to share: per KV
// head, K transposed [D, keys] (a query row's scores against a tile are then vector FMAs over
// keys) and V [keys, D], keys padded with zeros to a whole tile. Kept per calling thread and
// grown on demand: a fresh allocation every layer would page-fault its way in.
struct Staging {
  float* data = nullptr;
  size_t capacity = 0;
  float* reserve(size_t n) {
    if (n > capacity) {
      std::free(data);
      data = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * ((n + 15) / 16 * 16)));
      capacity = data ? n : 0;
    }
    return data;
  }
  ~Staging() { std::free(data); }
};
thread_local Staging staging;

// Scores of rows [r0, r0 + R) against the tile: R x kKeys accumulators stay in registers while
// each transposed key row is loaded once for all R queries.
template <int64_t R, int64_t D>
inline void tile_scores(const float* __restrict__ q, const float* __restrict__ kt, int64_t ld,
                        float* __restrict__ s, int64_t dim_rt) {
  const int64_t dim = D ? D : dim_rt;
  float acc[R][kKeys] = {};
  for (int64_t d = 0; d < dim; ++d) {
    const float* kd = kt + d * ld;
    for (int64_t i = 0; i < R; ++i) {
      const float qv = q[i * dim + d];
#pragma omp simd
      for (int64_t j = 0; j < kKeys; ++j) acc[i][j] += qv * kd[j];
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < kKeys; ++j) s[i * kKeys + j] = acc[i][j];
}

// o[i] = o[i] * alpha[i] + sum_j p[i][j] v[j] for rows [r0, r0 + R): R output rows held in
// registers (for a head size known at compile time) while each value row is loaded once.
template <int64_t R, int64_t D>
inline void tile_values(const float* __restrict__ p, const float* __restrict__ v,
                        const float* __restrict__ alpha, float* __restrict__ o, int64_t n,
                        int64_t dim_rt) {
  const int64_t dim = D ? D : dim_rt;
  float acc[R][D ? D : kMaxDim];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t d = 0; d < dim; ++d) acc[i][d] = o[i * dim + d] * alpha[i];
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * dim;
    for (int64_t i = 0; i < R; ++i) {
      const float pj = p[i * kKeys + j];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) acc[i][d] += pj * vj[d];
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t d = 0; d < dim; ++d) o[i * dim + d] = acc[i][d];
}

// Rows r of the unit are (query token i = r / fold, head f = r % fold). kt [D, ld] and v
// [ld, D] are this KV head's staged keys and values.
template <typename T, int64_t D>
void attend_unit(const Problem& p, int64_t h, int64_t first, int64_t count, const float* kt,
                 const float* v, int64_t ld, Scratch& w) {
  const int64_t dim = D ? D : p.dim;
  const int64_t fold = p.heads / p.kv_heads;
  const int64_t rows = count * fold;
  const T* q = static_cast<const T*>(p.q);

  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (first + r / fold) * p.q_stride_t + (h * fold + r % fold) * p.q_stride_h;
    for (int64_t d = 0; d < dim; ++d) w.q[r * dim + d] = widen(src[d]) * p.scale;
    std::fill(w.o + r * dim, w.o + (r + 1) * dim, 0.f);
    w.m[r] = kMasked;
    w.l[r] = 0.f;
  }
  const int64_t q_lo = p.start_pos + first;          // position of the unit's first query
  const int64_t keys = p.start_pos + first + count;  // keys the unit's last query sees
  for (int64_t k0 = 0; k0 < keys; k0 += kKeys) {
    const int64_t n = std::min(kKeys, keys - k0);
    int64_t r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4)
      tile_scores<4, D>(w.q + r0 * dim, kt + k0, ld, w.s + r0 * kKeys, dim);
    for (; r0 < rows; ++r0) tile_scores<1, D>(w.q + r0 * dim, kt + k0, ld, w.s + r0 * kKeys, dim);
    // The rows' new maxima over the keys they see (causal mask, the tile's padding) and their
    // rescaling factors. exp() only ever sees arguments >= kMinExp: glibc's vector expf sends
    // lanes that underflow to a scalar slow path, which took a quarter of the kernel's time
    // when masked scores went in as -1e30. Masked keys get probability 0 explicitly.
    for (int64_t r = 0; r < rows; ++r) {
      const float* s = w.s + r * kKeys;
      const int64_t limit = std::min(n, q_lo + r / fold + 1 - k0);  // keys this row sees
      float top = w.m[r];
      for (int64_t j = 0; j < limit; ++j) top = std::max(top, s[j]);
      w.alpha[r] = std::max(w.m[r] - top, kMinExp);
      w.m[r] = top;
      w.limit[r] = limit;
    }
#pragma omp simd
    for (int64_t r = 0; r < rows; ++r) w.alpha[r] = std::exp(w.alpha[r]);
    for (int64_t r = 0; r < rows; ++r) {
      float* s = w.s + r * kKeys;
      const float top = w.m[r];
      const int64_t limit = w.limit[r];
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < kKeys; ++j) {
        const float e = std::exp(std::max(s[j] - top, kMinExp));
        s[j] = j < limit ? e : 0.f;
        total += s[j];
      }
      w.l[r] = w.l[r] * w.alpha[r] + total;
    }
    const float* vt = v + k0 * dim;
    r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4)
      tile_values<4, D>(w.s + r0 * kKeys, vt, w.alpha + r0, w.o + r0 * dim, n, dim);
    for (; r0 < rows; ++r0)
      tile_values<1, D>(w.s + r0 * kKeys, vt, w.alpha + r0, w.o + r0 * dim, n, dim);
  }
  T* out = static_cast<T*>(p.out);
  for (int64_t r = 0; r < rows; ++r) {
    const float norm = 1.f / w.l[r];  // every query sees at least its own key
    T* dst = out + ((first + r / fold) * p.heads + h * fold + r % fold) * dim;
    for (int64_t d = 0; d < dim; ++d) narrow(w.o[r * dim + d] * norm, dst + d);
  }
}

// Stage keys [k0, k0 + kKeys) of KV head h: transposed K and plain V, zeros past `keys`.
template <typename T, int64_t D>
void stage_tile(const Problem& p, int64_t h, int64_t k0, int64_t keys, float* kt, float* v,
                int64_t ld) {
  const int64_t dim = D ? D : p.dim;
  const int64_t row = p.kv_heads * dim;  // elements of one token in one page
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int64_t n = std::min(kKeys, keys - k0);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = k0 + j;
    const int64_t at = (int64_t(p.table[t / p.page]) * p.page + t % p.page) * row + h * dim;
    for (int64_t d = 0; d < dim; ++d) {
      kt[d * ld + t] = widen(k_cache[at + d]);
      v[t * dim + d] = widen(v_cache[at + d]);
    }
  }
  for (int64_t j = n; j < kKeys; ++j)
    for (int64_t d = 0; d < dim; ++d) {
      kt[d * ld + k0 + j] = 0.f;
      v[(k0 + j) * dim + d] = 0.f;
    }
}

template <typename T, int64_t D>
int run(const Problem& p, int threads) {
  const int64_t dim = D ? D : p.dim;
  const int64_t fold = p.heads / p.kv_heads;
  const int64_t blocks = (p.tokens + kRows - 1) / kRows;
  const int64_t units = blocks * p.kv_heads;
  const int64_t keys = p.start_pos + p.tokens;
  const int64_t tiles = (keys + kKeys - 1) / kKeys;
  const int64_t ld = tiles * kKeys;  // staged keys per head, padded to whole tiles
  float* staged = staging.reserve(size_t(2 * p.kv_heads * dim * ld));
  if (!staged) return 1;
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t u = 0; u < p.kv_heads * tiles; ++u) {
      const int64_t h = u / tiles;
      float* head = staged + 2 * h * dim * ld;
      stage_tile<T, D>(p, h, (u % tiles) * kKeys, keys, head, head + dim * ld, ld);
    }
    Scratch w(kRows * fold, dim);
    if (!w.base) {
#pragma omp atomic write
      failed = 1;
    }
    // Later query blocks see more keys: handing them out first evens the threads' loads.
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      if (!w.base) continue;
      const int64_t h = u % p.kv_heads;
      const int64_t first = (blocks - 1 - u / p.kv_heads) * kRows;
      const float* head = staged + 2 * h * dim * ld;
      attend_unit<T, D>(p, h, first, std::min(kRows, p.tokens - first), head, head + dim * ld,
                        ld, w);
    }
  }
  return failed;
}

template <typename T>
int dispatch(const Problem& p, int threads) {
  switch (p.dim) {
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

// Limits the caller must respect (checked there, before any call).
int64_t edgeinfer_prefill_max_dim() { return kMaxDim; }

// Returns 0 on success, 1 when scratch memory could not be allocated.
int edgeinfer_paged_prefill_f32(const Problem* p, int threads) { return dispatch<float>(*p, threads); }
int edgeinfer_paged_prefill_bf16(const Problem* p, int threads) { return dispatch<uint16_t>(*p, threads); }
}

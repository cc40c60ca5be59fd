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
//
// bfloat16 with a head size of 64 or 128, where the target has AVX512-BF16: keys and values
// stay in bfloat16 (staged in pairs) and both products go through vdpbf16ps, which multiplies
// a pair of bfloat16 and adds both products into a float32 lane: the scores' D FMAs become
// D / 2, and so do the values'. The scores are exact products summed in float32 as before (the
// scale comes after the sum, not before it); the probabilities are rounded to bfloat16 for the
// values' products, as GPU flash attention rounds them, and summed in float32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <omp.h>

#include "cpu_dtypes.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstring>
#include <type_traits>
#endif

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

#if defined(__AVX512BF16__)
// The bfloat16 dot-product path (module comment). Staged per KV head: keys as [D / 2, ld, 2]
// (element (p, t, e) is k[t][2p + e]: a 64-byte load holds one pair of dimensions of 16 keys)
// and values as [ld / 2, D, 2] (element (u, d, e) is v[2u + e][d]: one load, 16 dimensions of a
// pair of keys).
template <typename T, int64_t D>
constexpr bool kDot = std::is_same_v<T, uint16_t> && (D == 64 || D == 128);

inline __m512bh pair_of(const uint16_t* at) {
  int32_t pair;
  std::memcpy(&pair, at, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// Scores of R query rows (bfloat16, [R, D]) against the tile's kKeys keys, times `scale`.
template <int64_t R, int64_t D>
inline void dot_scores(const uint16_t* __restrict__ q, const uint16_t* __restrict__ kp, int64_t ld,
                       float scale, float* __restrict__ s) {
  constexpr int64_t C = kKeys / 16;
  __m512 acc[R][C];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    __m512bh kv[C];
    for (int64_t c = 0; c < C; ++c)
      kv[c] = (__m512bh)_mm512_loadu_si512(kp + (d2 * ld + 16 * c) * 2);
    for (int64_t i = 0; i < R; ++i) {
      const __m512bh qv = pair_of(q + i * D + 2 * d2);
      for (int64_t c = 0; c < C; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], qv, kv[c]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < R; ++i)
    for (int64_t c = 0; c < C; ++c)
      _mm512_storeu_ps(s + i * kKeys + 16 * c, _mm512_mul_ps(acc[i][c], sc));
}

// o[i] = o[i] * alpha[i] + sum_j p[i][j] v[j] for R rows, p in bfloat16 (row i at
// p + 2 * kKeys * i: the front half of a float row of scores) and the
// first `n` keys of the tile (an odd n takes the next key too: its probability is 0).
template <int64_t R, int64_t D>
inline void dot_values(const uint16_t* __restrict__ p, const uint16_t* __restrict__ vp,
                       const float* __restrict__ alpha, float* __restrict__ o, int64_t n) {
  constexpr int64_t C = D / 16;
  __m512 acc[R][C];
  for (int64_t i = 0; i < R; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[i]);
    for (int64_t c = 0; c < C; ++c)
      acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + 16 * c), a);
  }
  for (int64_t j2 = 0; j2 < (n + 1) / 2; ++j2) {
    __m512bh vv[C];
    for (int64_t c = 0; c < C; ++c)
      vv[c] = (__m512bh)_mm512_loadu_si512(vp + (j2 * D + 16 * c) * 2);
    for (int64_t i = 0; i < R; ++i) {
      const __m512bh pv = pair_of(p + i * 2 * kKeys + 2 * j2);
      for (int64_t c = 0; c < C; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pv, vv[c]);
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(o + i * D + 16 * c, acc[i][c]);
}

// Keys [k0, k0 + kKeys) of KV head h into the pair layouts, zeros past `keys`.
template <typename T, int64_t D>
void stage_pairs(const Problem& p, int64_t h, int64_t k0, int64_t keys, uint16_t* kp,
                 uint16_t* vp, int64_t ld) {
  const int64_t row = p.kv_heads * D;
  const uint16_t* k_cache = static_cast<const uint16_t*>(p.k_cache);
  const uint16_t* v_cache = static_cast<const uint16_t*>(p.v_cache);
  for (int64_t t = k0; t < k0 + kKeys; ++t) {
    const bool real = t < keys;
    const int64_t at = real ? (int64_t(p.table[t / p.page]) * p.page + t % p.page) * row + h * D
                            : 0;
    for (int64_t d2 = 0; d2 < D / 2; ++d2) {
      uint16_t* dst = kp + (d2 * ld + t) * 2;
      dst[0] = real ? k_cache[at + 2 * d2] : 0;
      dst[1] = real ? k_cache[at + 2 * d2 + 1] : 0;
    }
    for (int64_t d = 0; d < D; ++d) vp[((t / 2) * D + d) * 2 + t % 2] = real ? v_cache[at + d] : 0;
  }
}
#else
template <typename T, int64_t D>
constexpr bool kDot = false;
#endif

// Rows r of the unit are (query token i = r / fold, head f = r % fold). kt [D, ld] and v
// [ld, D] are this KV head's staged keys and values (the pair layouts above with kDot).
template <typename T, int64_t D>
void attend_unit(const Problem& p, int64_t h, int64_t first, int64_t count, const float* kt,
                 const float* v, int64_t ld, Scratch& w) {
  const int64_t dim = D ? D : p.dim;
  const int64_t fold = p.heads / p.kv_heads;
  const int64_t rows = count * fold;
  const T* q = static_cast<const T*>(p.q);

  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (first + r / fold) * p.q_stride_t + (h * fold + r % fold) * p.q_stride_h;
    if constexpr (kDot<T, D>)  // as they are: the scale multiplies the sums
      std::copy(src, src + dim, reinterpret_cast<T*>(w.q) + r * dim);
    else
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
#if defined(__AVX512BF16__)
    if constexpr (kDot<T, D>) {
      const uint16_t* qb = reinterpret_cast<const uint16_t*>(w.q);
      const uint16_t* kp = reinterpret_cast<const uint16_t*>(kt) + k0 * 2;
      for (; r0 + 4 <= rows; r0 += 4)
        dot_scores<4, D>(qb + r0 * D, kp, ld, p.scale, w.s + r0 * kKeys);
      for (; r0 < rows; ++r0) dot_scores<1, D>(qb + r0 * D, kp, ld, p.scale, w.s + r0 * kKeys);
    }
#endif
    if constexpr (!kDot<T, D>) {
      for (; r0 + 4 <= rows; r0 += 4)
        tile_scores<4, D>(w.q + r0 * dim, kt + k0, ld, w.s + r0 * kKeys, dim);
      for (; r0 < rows; ++r0)
        tile_scores<1, D>(w.q + r0 * dim, kt + k0, ld, w.s + r0 * kKeys, dim);
    }
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
    r0 = 0;
#if defined(__AVX512BF16__)
    if constexpr (kDot<T, D>) {
      // The probabilities in bfloat16, in place over the front half of each row of w.s.
      uint16_t* pb = reinterpret_cast<uint16_t*>(w.s);
      for (int64_t r = 0; r < rows; ++r) {
        const float* s = w.s + r * kKeys;
        __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + 16), _mm512_loadu_ps(s));
        __m512bh hi = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + 48), _mm512_loadu_ps(s + 32));
        _mm512_storeu_si512(pb + r * 2 * kKeys, (__m512i)lo);
        _mm512_storeu_si512(pb + r * 2 * kKeys + 32, (__m512i)hi);
      }
      const uint16_t* vp = reinterpret_cast<const uint16_t*>(v) + k0 * D;
      constexpr int64_t R = D == 64 ? 4 : 2;  // R x D / 16 accumulators: 16 registers
      for (; r0 + R <= rows; r0 += R)
        dot_values<R, D>(pb + r0 * 2 * kKeys, vp, w.alpha + r0, w.o + r0 * D, n);
      for (; r0 < rows; ++r0)
        dot_values<1, D>(pb + r0 * 2 * kKeys, vp, w.alpha + r0, w.o + r0 * D, n);
    }
#endif
    if constexpr (!kDot<T, D>) {
      const float* vt = v + k0 * dim;
      for (; r0 + 4 <= rows; r0 += 4)
        tile_values<4, D>(w.s + r0 * kKeys, vt, w.alpha + r0, w.o + r0 * dim, n, dim);
      for (; r0 < rows; ++r0)
        tile_values<1, D>(w.s + r0 * kKeys, vt, w.alpha + r0, w.o + r0 * dim, n, dim);
    }
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
#if defined(__AVX512BF16__)
      if constexpr (kDot<T, D>)  // in the same places, half of each used
        stage_pairs<T, D>(p, h, (u % tiles) * kKeys, keys, reinterpret_cast<uint16_t*>(head),
                          reinterpret_cast<uint16_t*>(head + dim * ld), ld);
#endif
      if constexpr (!kDot<T, D>)
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

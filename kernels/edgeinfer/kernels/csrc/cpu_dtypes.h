// float32 and bfloat16 storage for the CPU kernels in this folder: both are computed in
// float32. A bfloat16 is handled as its 16 bits (uint16_t), so one template serves both.
#pragma once

#include <cstdint>
#include <cstring>

namespace edgeinfer {

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {  // bfloat16 bits: the high half of the float32, exactly
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void narrow(float x, float* dst) { *dst = x; }
inline void narrow(float x, uint16_t* dst) {  // round to nearest even, as torch casts
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  *dst = uint16_t(u >> 16);
}

}  // namespace edgeinfer

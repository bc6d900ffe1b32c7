// Register-level helpers shared by qerl's tensor-core kernels (sm_80+ mma.sync).
#pragma once

#include <cstdint>

namespace qerl {

// c += a * b for one m16n8k16 tile: bf16 inputs (a: four registers of the 16x16 row-major
// fragment, b: two of the 16x8 column-major one), fp32 accumulators.
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                  uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 32-bit word i (0..3) of a 16-byte vector (int4 or uint4); i is a constant after unrolling.
template <typename V>
__device__ __forceinline__ uint32_t word(const V& v, int i) {
  return static_cast<uint32_t>(i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w);
}

}  // namespace qerl

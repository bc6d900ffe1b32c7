// The NVFP4 kernels' weight stream and dequantization steps (nvfp4_gemm.cu's top gives the layout
// and the bit map), shared with benchmarks/read_patterns.cu, which times them without the rest.
#pragma once

#include <cstdint>

namespace qerl {

constexpr uint32_t kMask = 0x81C081C0u;  // bf16 sign bit 15 and bits 6..8, both halves

__device__ __forceinline__ uint32_t rotr(uint32_t x, int s) { return __funnelshift_r(x, x, s); }

// 8 codes -> 4 bf16x2 holding e2m1 * 2^-126 (exact). Four shifts and five LOP3 (no layout does it
// with fewer: the mask has no four shifts that tile the word); two of the shifts are left shifts,
// which ptxas may issue as IMAD.SHL on the FMA-heavy pipe, off the ALU pipe that the LOP3s and
// the other shifts share (the previous layout's four rotations all ran on the ALU pipe).
__device__ __forceinline__ void unpack8(uint32_t q, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
  r0 = q & kMask;
  r1 = (q << 4) & kMask;
  r2 = rotr(q, 6) & kMask;
  r3 = ((q << 6) & 0x80C080C0u) | ((q >> 2) & 0x01000100u);
}

__device__ __forceinline__ uint32_t bmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// 16 bytes of a weight stream, read once: not kept in L1.
__device__ __forceinline__ int4 ld_stream(const int4* p) {
  int4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

}  // namespace qerl

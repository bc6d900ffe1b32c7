// How fast one GPU streams weights in the NVFP4 small kernel's access pattern, with and without
// its per-chunk work, against a plain coalesced read of the same bytes: what bounds
// engine/kernels/nvfp4_gemm.cu's M = 1 launches (the pattern, or the work done per chunk).
//
// Each launch reads about 160 MB (32B gate_up is 159 MB in NVFP4), launches rotate through 1.6 GB
// so that L2 holds none of it; median of 7 timings of 20 launches (CUDA events). Rows:
// - coalesced: the grid reads the buffer with 16-byte loads, U loads in flight per thread.
// - seg: each warp streams its own tnw contiguous segments of 512-byte chunks (16 bytes a lane,
//   the small kernel's record stream: 32B gate_up has 20 records of 2304 bytes, 90 chunks, per
//   weight tile), D chunks in flight per segment; blocks per SM capped by dynamic shared memory
//   (the real kernel holds 3 at 80 registers). One wave: every SM holds its blocks/SM blocks and
//   every warp one group of tnw segments, as long as 160 MB allows (the row's chunk count), so no
//   SM idles in a partial last wave. il = 1: the segments interleaved, so that warps at the same
//   step read adjacent chunks.
// - mma: seg plus the small kernel's per-chunk work on the loaded words: per 32-bit word the
//   kernels' unpack (shift + and), four bf16x2 scale multiplies and one m16n8k16 MMA, two
//   accumulator chains (no activation, scale or epilogue loads). "mma imad": the same bits with
//   both left shifts as IMADs. "mma rot": the previous layout's unpack (four rotations + and, all
//   on the ALU pipe; timing only). Its mul1 / mul2 rows: its bits, with two / three of the four
//   rotations each done as a 64-bit multiply (q * 2^(32-k): high word q >> k, low word
//   q << (32 - k), one IMAD.WIDE on the FMA-heavy pipe) whose halves one LOP3 ORs and masks. Each
//   variant row checks its block sums against its layout's plain row, bit for bit. "no scale
//   multiplies", "no unpack" and "mma alone" take the work apart (the raw word stands in for what
//   is left out).
// Build and run on the GPU machine (no torch needed):
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/read_patterns benchmarks/read_patterns.cu && /tmp/read_patterns
// (`/tmp/read_patterns layouts`: only the kernels' unpack against the previous layout's, twice.)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../engine/kernels/mma.cuh"           // the kernels' MMA and word()
#include "../engine/kernels/nvfp4_unpack.cuh"  // their weight loads and unpack

#define CK(x)                                                             \
  do {                                                                    \
    cudaError_t e = (x);                                                  \
    if (e != cudaSuccess) {                                               \
      printf("%s: %s\n", #x, cudaGetErrorString(e));                      \
      exit(1);                                                            \
    }                                                                     \
  } while (0)

namespace {

using qerl::bmul2;
using qerl::kMask;
using qerl::ld_stream;
using qerl::mma_m16n8k16_bf16;
using qerl::rotr;
using qerl::word;

// (a | b) & c and (a & c) | b in one LOP3 each.
__device__ __forceinline__ uint32_t or_and(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xA8;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEC;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// rotr(q, k) & mask through one 64-bit multiply by p = 2^(32 - k) (a kernel argument, so that
// the compiler keeps the multiply): high word q >> k, low word q << (32 - k).
__device__ __forceinline__ uint32_t rot_and_mul(uint32_t q, uint32_t p, uint32_t mask) {
  const uint64_t w = (uint64_t)q * p;
  return or_and((uint32_t)(w >> 32), (uint32_t)w, mask);
}

// The previous layout's unpack (U = 5: four rotations, all on the ALU pipe; timing only against
// the kernels', whose layout decodes the same words to other weights), and the same bits with
// U = 1: rotr(q, 4) and the rotr(q, 6) part of r3 by multiplies (p4 = 2^28, p6 = 2^26); U = 2:
// rotr(q, 10) too (p10 = 2^22).
template <int U>
__device__ __forceinline__ void unpack8_rot(uint32_t q, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                            uint32_t p4, uint32_t p6, uint32_t p10) {
  r0 = q & kMask;
  r1 = U == 5 ? rotr(q, 4) & kMask : rot_and_mul(q, p4, kMask);
  r2 = U == 2 ? rot_and_mul(q, p10, kMask) : rotr(q, 10) & kMask;
  r3 = U == 5 ? (rotr(q, 14) & 0x00400040u) | (rotr(q, 6) & 0x81808180u)
              : and_or(rotr(q, 14), rot_and_mul(q, p6, 0x81808180u), 0x00400040u);
}

// The kernels' unpack (U = 0) with its two left shifts as multiplies by kernel arguments (U = 4:
// m16 = 16, m64 = 64), so that every one is an IMAD where ptxas leaves some as SHF: the same bits.
__device__ __forceinline__ void unpack8_imad(uint32_t q, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                             uint32_t m16, uint32_t m64) {
  r0 = q & kMask;
  r1 = (q * m16) & kMask;
  r2 = rotr(q, 6) & kMask;
  r3 = and_or(q * m64, (q >> 2) & 0x01000100u, 0x80C080C0u);
}

template <int U>
__global__ void __launch_bounds__(256) coalesced(const int4* __restrict__ p, size_t n, int* out) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  int acc = 0;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld_stream(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const int4 v = ld_stream(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345) out[0] = acc;  // keeps the loads
}

// Chunk c of segment w: (w * chunks + c), or interleaved (c * nseg + w); 512 bytes, 16 a lane.
__device__ __forceinline__ const int4* chunk_at(const int4* p, int w, int c, int nseg, int chunks, int il, int lane) {
  const size_t idx = il ? (size_t)c * nseg + w : (size_t)w * chunks + c;
  return p + idx * 32 + lane;
}

// seg (MMA = false) and mma (MMA = true) rows; MINB only names the variant (occupancy is set by
// the launch's dynamic shared memory, and the grid is MINB blocks per SM, each warp taking
// groups of TNW segments in turn: no partial last wave). U picks the per-word work: 0 the
// kernels' (unpack, four scale multiplies, MMA), 4 the same bits with IMADs for the left shifts,
// 5 the previous layout's unpack, 1 / 2 the mul1 / mul2 unpacks with its bits; 20 without the scale multiplies, 21 without the unpack (the multiplies take the raw
// word), 22 the MMA alone (the raw word as its operand); 30 the scales applied to fp32 sums
// once per scale group of a chunk instead of to the weights (timing only: the same products,
// summed in another order). Each block's sum of its first warp's
// accumulators goes to sums_out[block] (the check between unpack variants).
template <int TNW, int D, int MINB, bool MMA, int U = 0>
__global__ void __launch_bounds__(256, MINB) segments(const int4* __restrict__ p, int nseg, int chunks, int il,
                                                      int* out, float* sums_out, uint32_t scale, uint32_t xb,
                                                      uint32_t p4, uint32_t p6, uint32_t p10) {
  const int lane = threadIdx.x & 31;
  const uint32_t xm = ((lane >> 2) == (lane & 3)) ? xb : 0u;  // U = 30: lane (g, t) gives group t's inputs to column g
  int acc = 0;
  float sums[2][TNW][4] = {};
  for (int w0 = (blockIdx.x * 8 + (threadIdx.x >> 5)) * TNW; w0 < nseg; w0 += gridDim.x * 8 * TNW) {
    int4 ring[D][TNW];
#pragma unroll
    for (int d = 0; d < D; ++d)
#pragma unroll
      for (int t = 0; t < TNW; ++t)
        ring[d][t] = d < chunks ? ld_stream(chunk_at(p, w0 + t, d, nseg, chunks, il, lane)) : make_int4(0, 0, 0, 0);
    for (int c = 0; c < chunks; c += D) {
#pragma unroll
      for (int d = 0; d < D; ++d) {
#pragma unroll
        for (int t = 0; t < TNW; ++t) {
          if (c + d >= chunks) break;  // past the last chunk (chunks not a multiple of D)
          const int4 v = ring[d][t];
          if constexpr (MMA && U == 30) {
            // scales on the sums: the chunk's four k16 steps accumulate per scale group into the
            // MMA's columns (activations masked per group: only lanes g == t give theirs), then
            // each lane adds its four (row, group) sums times their fp32 scales, made from one
            // word of four scale bytes (the chunk's first word stands in for it here)
            float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              uint32_t r0, r1, r2, r3;
              qerl::unpack8(word(v, j), r0, r1, r2, r3);
              mma_m16n8k16_bf16(d, r0, r1, r2, r3, xm, xm ^ 0x1000u);
            }
            const uint32_t sw = word(v, 0);
            const float s0 = __uint_as_float(((sw << 20) & 0x07F00000u) | 0x40000000u);
            const float s1 = __uint_as_float(((sw << 12) & 0x07F00000u) | 0x40000000u);
            const float s2 = __uint_as_float(((sw << 4) & 0x07F00000u) | 0x40000000u);
            const float s3 = __uint_as_float(((sw >> 4) & 0x07F00000u) | 0x40000000u);
            sums[0][t][0] = fmaf(s0, d[0], sums[0][t][0]);
            sums[0][t][1] = fmaf(s1, d[1], sums[0][t][1]);
            sums[0][t][2] = fmaf(s2, d[2], sums[0][t][2]);
            sums[0][t][3] = fmaf(s3, d[3], sums[0][t][3]);
          } else if constexpr (MMA) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const uint32_t q = word(v, j);
              uint32_t r0, r1, r2, r3;
              if constexpr (U == 0 || U == 20) {
                qerl::unpack8(q, r0, r1, r2, r3);
              } else if constexpr (U == 4) {
                unpack8_imad(q, r0, r1, r2, r3, p4 >> 24, p6 >> 20);
              } else if constexpr (U < 20) {
                unpack8_rot<U>(q, r0, r1, r2, r3, p4, p6, p10);
              } else {
                r0 = r1 = r2 = r3 = q;
              }
              if constexpr (U == 20 || U == 22) {
                mma_m16n8k16_bf16(sums[j & 1][t], r0, r1, r2, r3, xb, xb ^ 0x1000u);
              } else if constexpr (U == 21) {  // four different multipliers: four multiplies
                mma_m16n8k16_bf16(sums[j & 1][t], bmul2(r0, scale), bmul2(r1, scale + 1), bmul2(r2, scale + 2),
                                  bmul2(r3, scale + 3), xb, xb ^ 0x1000u);
              } else {
                mma_m16n8k16_bf16(sums[j & 1][t], bmul2(r0, scale), bmul2(r1, scale), bmul2(r2, scale),
                                  bmul2(r3, scale), xb, xb ^ 0x1000u);
              }
            }
          } else {
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
          }
          if (c + d + D < chunks) ring[d][t] = ld_stream(chunk_at(p, w0 + t, c + d + D, nseg, chunks, il, lane));
        }
      }
    }
  }
  float s = 0.f;
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int t = 0; t < TNW; ++t) s += sums[a][t][0] + sums[a][t][1] + sums[a][t][2] + sums[a][t][3];
  if (acc == 0x12345) out[0] = 1;  // keeps the loads
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);  // every lane's unpack counts
  if (MMA && threadIdx.x == 0) sums_out[blockIdx.x] = s;
}

__global__ void fill(int4* p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t h = (uint32_t)(i * 2654435761u);
    p[i] = make_int4(h, h ^ 0x5bd1e995, h * 3, h + 7);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const size_t per = 160ull << 20;  // bytes per launch
  const int nbuf = 10;
  int4* buf;
  int* out;
  float* sums;
  CK(cudaMalloc(&buf, per * nbuf));
  CK(cudaMalloc(&out, 4));
  CK(cudaMalloc(&sums, 1 << 20));
  fill<<<1024, 256>>>(buf, per * nbuf / 16);
  CK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  double best = 0.0;  // the coalesced rows' best TB/s
  auto timeit = [&](auto launch, const char* name, size_t bytes, const char* note) {
    for (int i = 0; i < 3; ++i) launch(buf + (i % nbuf) * (per / 16));
    CK(cudaDeviceSynchronize());
    std::vector<float> ts;
    for (int r = 0; r < 7; ++r) {
      CK(cudaEventRecord(e0));
      for (int i = 0; i < 20; ++i) launch(buf + (i % nbuf) * (per / 16));
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      ts.push_back(ms / 20);
    }
    CK(cudaGetLastError());
    std::sort(ts.begin(), ts.end());
    const double ms = ts[ts.size() / 2], tbs = bytes / (ms * 1e-3) / 1e12;
    best = std::max(best, name[0] == 'c' ? tbs : 0.0);
    printf("%-62s %8.1f us  %6.2f TB/s  %5.2fx of coalesced  %s\n", name, ms * 1e3, tbs, tbs / best, note);
  };
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t n = per / 16;
  timeit([&](const int4* p) { coalesced<4><<<sms * 8, 256>>>(p, n, out); }, "coalesced U=4, 8 blocks/SM", per, "");
  timeit([&](const int4* p) { coalesced<8><<<sms * 8, 256>>>(p, n, out); }, "coalesced U=8, 8 blocks/SM", per, "");
  const uint32_t p4 = 1u << 28, p6 = 1u << 26, p10 = 1u << 22;
  std::vector<float> ref, ref_rot, got;  // block sums of the kernels' unpack, the previous one's, a variant's (buffer 0)
  char name[96];
  const char* note = "";
#define QERL_ROW(KIND, MMA, U, TNW, D, MINB)                                                                     \
  {                                                                                                               \
    const int smem = (227 * 1024) / MINB - 2048; /* at most MINB blocks per SM */                                \
    auto* fn = segments<TNW, D, MINB, MMA, U>;                                                                   \
    CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));                            \
    /* one wave: MINB blocks on every SM, each warp one group of TNW segments of equal length */                \
    const int blocks = sms * MINB, nseg = blocks * 8 * TNW, chunks = (int)(per / (512ull * nseg));              \
    auto launch = [&](const int4* p) {                                                                            \
      fn<<<blocks, 256, smem>>>(p, nseg, chunks, il, out, sums, 0x3f803f80u, 0x3c003c00u, p4, p6, p10);         \
    };                                                                                                            \
    note = "";                                                                                                    \
    if (MMA) {                                                                                                    \
      launch(buf);                                                                                                \
      CK(cudaDeviceSynchronize());                                                                                \
      got.assign(blocks, 0.f);                                                                                    \
      CK(cudaMemcpy(got.data(), sums, blocks * sizeof(float), cudaMemcpyDeviceToHost));                          \
      if (U == 0) ref = got;                                                                                      \
      else if (U == 5) ref_rot = got, note = "the previous layout: timing only";                                \
      else if (U == 4) note = ref == got ? "same bits as mma" : "BLOCK SUMS DIFFER FROM mma";                  \
      else if (U < 20) note = ref_rot == got ? "same bits as mma rot" : "BLOCK SUMS DIFFER FROM mma rot";      \
    }                                                                                                             \
    snprintf(name, sizeof name, "%s tnw=%d D=%d blocks/SM=%d il=%d (%d chunks)", KIND, TNW, D, MINB, il, chunks); \
    timeit(launch, name, (size_t)nseg * chunks * 512, note);                                                      \
  }
  if (argc > 1 && std::string(argv[1]) == "layouts") {  // the kernels' unpack against the previous layout's, twice
    const int il = 0;
    for (int rep = 0; rep < 2; ++rep) {
      QERL_ROW("mma", true, 0, 2, 2, 3) QERL_ROW("mma rot", true, 5, 2, 2, 3) QERL_ROW("mma imad", true, 4, 2, 2, 3)
      QERL_ROW("mma", true, 0, 1, 4, 4) QERL_ROW("mma rot", true, 5, 1, 4, 4) QERL_ROW("mma imad", true, 4, 1, 4, 4)
      QERL_ROW("mma", true, 0, 1, 4, 3) QERL_ROW("mma rot", true, 5, 1, 4, 3) QERL_ROW("mma imad", true, 4, 1, 4, 3)
    }
    return 0;
  }
  for (int il : {0, 1}) {
    QERL_ROW("mma", true, 0, 1, 4, 3) QERL_ROW("mma", true, 0, 1, 4, 4) QERL_ROW("mma", true, 0, 2, 2, 3)
    QERL_ROW("mma", true, 0, 2, 4, 3) QERL_ROW("mma", true, 0, 1, 8, 3) QERL_ROW("mma", true, 0, 1, 4, 2)
  }
  for (int il : {0}) {  // the unpack variants against the plain ones (same tnw, D, blocks/SM: ref, ref_rot)
    QERL_ROW("mma", true, 0, 1, 4, 3) QERL_ROW("mma imad", true, 4, 1, 4, 3) QERL_ROW("mma rot", true, 5, 1, 4, 3)
    QERL_ROW("mma rot mul1", true, 1, 1, 4, 3) QERL_ROW("mma rot mul2", true, 2, 1, 4, 3)
    QERL_ROW("mma", true, 0, 2, 2, 3) QERL_ROW("mma imad", true, 4, 2, 2, 3) QERL_ROW("mma rot", true, 5, 2, 2, 3)
    QERL_ROW("mma rot mul1", true, 1, 2, 2, 3) QERL_ROW("mma rot mul2", true, 2, 2, 2, 3)
  }
  for (int il : {0}) {  // the scales on the weights (the kernels') against the scales on the sums
    QERL_ROW("mma", true, 0, 2, 2, 3) QERL_ROW("mma, scales on the sums", true, 30, 2, 2, 3)
    QERL_ROW("mma", true, 0, 1, 4, 4) QERL_ROW("mma, scales on the sums", true, 30, 1, 4, 4)
  }
  for (int il : {0}) {  // the per-word work taken apart
    QERL_ROW("mma, no scale multiplies", true, 20, 1, 4, 3) QERL_ROW("mma, no unpack", true, 21, 1, 4, 3)
    QERL_ROW("mma alone", true, 22, 1, 4, 3) QERL_ROW("mma, no scale multiplies", true, 20, 2, 2, 3)
    QERL_ROW("mma, no unpack", true, 21, 2, 2, 3) QERL_ROW("mma alone", true, 22, 2, 2, 3)
  }
  for (int il : {0, 1}) {
    QERL_ROW("seg", false, 0, 1, 4, 3) QERL_ROW("seg", false, 0, 2, 2, 3) QERL_ROW("seg", false, 0, 1, 4, 4)
    QERL_ROW("seg", false, 0, 2, 4, 3)
  }
#undef QERL_ROW
  return 0;
}

// NVFP4 weights (e2m1 codes, one e4m3 scale per 16 inputs, one fp32 global scale) times bf16
// activations on Hopper (sm_90), which has no FP4 tensor cores: a weight-only GEMM.
//
// Layout (made once by engine/kernels/nvfp4_layout.py; see there for the bit map): one
// contiguous 2304-byte record per 16 rows x 256 inputs, i.e. 4 "chunks" of 64 inputs (512 bytes,
// 16 per lane of a warp) followed by every lane's 8 bytes of scales (2 per chunk).
// Lane (g = lane/4, t = lane%4) of a warp holds rows g and g+8 and the 16 inputs of block-scale
// group t of the chunk. The inputs of the m16n8k16 MMA are permuted inside each chunk (the same
// way for weights and activations), so each lane's activation fragments are 32 contiguous bytes
// of X and its 32 weights share two scales.
//
// Dequantization (nvfp4_unpack.cuh): 8 codes of a 32-bit word become 4 bf16x2 with a shift and an
// and each (one of them two); the three code bits land on bf16 bits 6..8, which is the e2m1 value
// times 2^-126 (e=0 codes become bf16 subnormals). One bf16x2 multiply by (scale * 2^119), built from a scale byte
// with one integer multiply-add, gives e2m1 * scale * 2^-7 exactly. The epilogue multiplies the
// fp32 sums by alpha = 2^7 / global_scale.
//
// Small M (<= 128 rows): weights are the MMA's A operand (register), activations its B operand,
// so the 16-row tile is the weight's and M only sets how many n=8 MMAs reuse one dequantized
// fragment. Each warp streams its own records with a ring of 16-byte loads in flight (plus an
// optional L2 prefetch further ahead); blocks of 8 warps share their K range, so activations are
// reused through L1 (M <= 16) or a cp.async shared-memory double buffer (M > 16). At M <= 16 the
// warps of a block may instead split each of its tiles' K range (wpt warps per tile), adding
// their sums through shared memory in slice order. When that still leaves too few warps, K is
// also split across blocks: partial sums go to an fp32 workspace and the last block of a column
// (an atomic ticket) adds them in a fixed order, so results are deterministic.
//
// Medium M (gemm_wg_kernel, below): the same weight stream and dequantization feed Hopper's
// warpgroup MMA (wgmma, register A operand) with the activations in a 4-stage shared-memory ring,
// so 64 weight rows share one MMA per k16 step for up to 256 activation rows. Its grid is one wave
// of resident blocks over the layer's columns x K groups laid end to end (stream K), so no wave
// is left partial whatever the layer's width.
//
// Large M: a dequantizing pass writes bf16 weights and cuBLAS does the product.
//
// Epilogue (small-M kernel): the output can get a bias and a LoRA delta on the way out, in the
// eager decoder's order: the product rounded to bf16, + bias in bf16, + delta in fp32
// (delta[row, col] = s[row, m*r .. m*r+r-1] . b[:, col], m the column's member), rounded once more.
//
// Programmatic dependent launch (PDL, pdl.cuh): the kernels are launched with programmatic stream
// serialization (unless QERL_PDL=0 at launch time), so their blocks may start while the previous
// kernel of the stream drains. A kernel reads only weights and scales (constant) before
// griddepcontrol.wait, which returns once the previous kernel has finished and its writes are
// visible: the first weight records stream in while the previous epilogue kernel ends (and the
// small kernel asks L2 for its epilogue's bias and LoRA B lines, also constant during a step).
// Activations, outputs, the split-K workspace and tickets are touched only after it, and
// launch_dependents is signalled only after it too, so when a kernel starts every kernel but its
// direct predecessor has finished.
#include <cuda.h>  // CUtensorMap; its encoder is found through the runtime (no -lcuda)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "mma.cuh"
#include "nvfp4_unpack.cuh"
#include "pdl.cuh"

namespace {

constexpr uint32_t kScaleBias = 0x76807680u;  // exponent 237 in both halves
constexpr int kWarps = 8;

using qerl::bmul2;
using qerl::ld_stream;
using qerl::pdl_wait_then_release;
using qerl::unpack8;
using qerl::word;

// A scale byte (e5m3, bias 9) broadcast to bf16x2 (scale * 2^119): byte * 16 + exponent 237.
__device__ __forceinline__ uint32_t scale_pair(uint32_t s16, uint32_t sel) {
  return __byte_perm(s16, 0u, sel) * 16u + kScaleBias;
}

// The bf16x2 scales of chunk c (rows g and g+8) from a lane's 8 scale bytes of a record.
__device__ __forceinline__ void chunk_scales(const int2& sc, int c, uint32_t& sg, uint32_t& sg8) {
  const uint32_t sw = (c < 2) ? (uint32_t)sc.x : (uint32_t)sc.y;
  const uint32_t sel = (c & 1) ? 0x4242u : 0x4040u;
  sg = scale_pair(sw, sel);
  sg8 = scale_pair(sw, sel + 0x0101u);
}

// One k16 step's m16n8k16 A fragment (bf16, times 2^-7) from a lane's 32-bit word of 8 codes and
// the chunk's scales of its rows g (sg) and g + 8 (sg8).
__device__ __forceinline__ void a_fragment(uint32_t q, uint32_t sg, uint32_t sg8, uint32_t (&a)[4]) {
  uint32_t r0, r1, r2, r3;
  unpack8(q, r0, r1, r2, r3);
  a[0] = bmul2(r0, sg);   // row g,   MMA inputs 2t, 2t+1
  a[1] = bmul2(r1, sg8);  // row g+8
  a[2] = bmul2(r2, sg);   // row g,   MMA inputs 2t+8, 2t+9
  a[3] = bmul2(r3, sg8);  // row g+8
}

__device__ __forceinline__ int4 ld_x(const uint16_t* p) {
  int4 r;
  asm volatile("ld.global.nc.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  qerl::mma_m16n8k16_bf16(c, a[0], a[1], a[2], a[3], b0, b1);
}

__device__ __forceinline__ uint16_t to_bf16(float v) {
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

// Bias and LoRA term of the output (see the top); bias == nullptr and s == nullptr: none.
// Two more modes join a projection to the RMSNorm between it and the next one without a kernel
// of their own (the decode step's residual add + RMSNorm + LoRA shrink):
// - residual (hw != nullptr): y is the residual stream x, updated in place to bf16(x + output),
//   and hw = bf16(x_new * w) is written beside it: the next projection's input before its
//   RMSNorm's row factor, which the next projection applies in its epilogue (norm mode).
// - norm (ntasks > 0): the activations are hw, and the output is multiplied by the row factor
//   r = rsqrt(mean(xn^2) + eps) of the residual rows xn before it is rounded. The factors and the
//   LoRA shrink s_out = r * (hw @ a^T) are computed inside this launch by "tasks": blocks
//   0 .. ntasks-1 of a 1-D grid each compute rank row j of the shrink (and the factors) right
//   after the PDL wait, then count themselves done in *sync (zero before the launch); the GEMM's
//   blocks come after them and wait for that count before their epilogue. Blocks are dispatched
//   in index order, so the tasks are running before any block can wait on them (the assumption
//   of serial split-K reductions that wait on the previous block of a column).
//   Without xn the factors are 1 and the tasks compute only the LoRA shrink of the launch's own
//   activations (o's, which come from attention), which saves the shrink's launch.
struct Epilogue {
  const uint16_t* bias;  // (N) bf16
  const float* s;        // (M, ld_s) fp32: the LoRA shrink x @ A^T, member m in columns m*r .. m*r+r-1
  const float* b;        // (r, ld_b) fp32: B^T with the scaling folded in
  int r, ld_s, ld_b, n1, n2;  // members: columns [0, n1), [n1, n2), [n2, N)
  uint16_t* hw;          // residual mode: (M, N) bf16 out
  const float* w;        // residual mode: (N) fp32, the next RMSNorm's weight
  const uint16_t* xn;    // norm mode: (M, K) bf16 residual rows, or null (shrink only)
  const float* a;        // norm mode: (ntasks, K) fp32 LoRA A rows, or null (one task: the factors)
  float* s_out;          // norm mode: (M, ntasks) fp32, r * hw @ a^T (null without a)
  float* r_out;          // norm mode: (M) fp32 row factors
  int* sync;             // norm mode: tasks done
  int ntasks;
  float eps;
};

__device__ __forceinline__ float bf16_value(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

// sum_t s[t] * b[t * ld_b] (r = 16: one round of loads); L2: read s through L2 only.
template <bool L2>
__device__ __forceinline__ float lora_dot(const float* sp, const float* bp, int ld_b, int r) {
  float d = 0.f;
#pragma unroll 16
  for (int t = 0; t < r; ++t) d = fmaf(L2 ? __ldcg(sp + t) : sp[t], bp[(size_t)t * ld_b], d);
  return d;
}

// The LoRA delta of output (tk, nn): s written by this launch's tasks (norm mode) is read from L2.
template <int EPI>
__device__ __forceinline__ float lora_delta(const Epilogue& e, int tk, int nn) {
  const int m = (nn >= e.n1) + (nn >= e.n2);
  const float* sp = e.s + (size_t)tk * e.ld_s + m * e.r;
  const float* bp = e.b + nn;
  return (EPI == 2 && e.ntasks) ? lora_dot<true>(sp, bp, e.ld_b, e.r) : lora_dot<false>(sp, bp, e.ld_b, e.r);
}

// The bf16 bits of output (tk, nn) whose fp32 product (times alpha) is v; pre: its LoRA delta
// (lora_delta) computed beforehand, or null.
template <int EPI>
__device__ __forceinline__ uint16_t epilogue(float v, const Epilogue& e, int tk, int nn, const float* pre = nullptr) {
  if constexpr (EPI == 2) {
    if (e.ntasks) v *= __ldcg(e.r_out + tk);  // written by this launch's tasks: read from L2
  }
  uint16_t o = to_bf16(v);
  if constexpr (EPI == 0) return o;
  if (e.bias) o = to_bf16(bf16_value(o) + bf16_value(e.bias[nn]));
  if (e.s) o = to_bf16(bf16_value(o) + (pre ? *pre : lora_delta<EPI>(e, tk, nn)));
  return o;
}

// Output (tk, nn) with product v: y = the epilogue's bf16, or in residual mode x += it (y is x)
// and hw = bf16(x_new * w).
template <int EPI>
__device__ __forceinline__ void store(uint16_t* y, int ldy, int tk, int nn, float v, const Epilogue& e,
                                      const float* pre = nullptr) {
  const uint16_t o = epilogue<EPI>(v, e, tk, nn, pre);
  uint16_t* p = y + (size_t)tk * ldy + nn;
  if constexpr (EPI == 2) {
    if (e.hw) {
      const uint16_t xn = to_bf16(bf16_value(*p) + bf16_value(o));
      *p = xn;
      e.hw[(size_t)tk * ldy + nn] = to_bf16(bf16_value(xn) * e.w[nn]);
      return;
    }
  }
  *p = o;
}

// Norm mode: wait until every task of this launch is done (their writes visible).
__device__ __forceinline__ void wait_tasks(const Epilogue& e) {
  if (e.ntasks == 0) return;
  int done;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(done) : "l"(e.sync) : "memory");
  } while (done < e.ntasks);
}

// Norm mode, task j for up to R rows: the row factors r = rsqrt(mean(xn^2) + eps) (task 0 writes
// them) and column j of s_out = r * (x @ a^T) over the M rows of the activations x (= hw), each
// block sum added warp by warp in a fixed order; then the task counts itself done. Without xn
// (shrink only) the factors are 1: the launch computes the LoRA shrink of its own activations.
// (Not inlined, its arguments by value: its registers stay out of the GEMM's.)
template <int R>
__device__ __noinline__ void norm_task(const uint16_t* __restrict__ xn, const float* __restrict__ a_rows,
                                       float* s_out, float* r_out, int* sync, int ntasks, float eps, int j,
                                       const uint16_t* __restrict__ x, int M, int K, int ldx) {
  constexpr int kThreads = kWarps * 32;
  float ss[R], u[R];
#pragma unroll
  for (int q = 0; q < R; ++q) ss[q] = u[q] = 0.f;
  const float* a = a_rows ? a_rows + (size_t)j * K : nullptr;
  pdl_wait_then_release();
  for (int i = threadIdx.x * 8; i < K; i += kThreads * 8) {  // K is a multiple of 16
    float av[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (a) {
      const float4 a0 = *reinterpret_cast<const float4*>(a + i), a1 = *reinterpret_cast<const float4*>(a + i + 4);
      av[0] = a0.x, av[1] = a0.y, av[2] = a0.z, av[3] = a0.w, av[4] = a1.x, av[5] = a1.y, av[6] = a1.z, av[7] = a1.w;
    }
#pragma unroll
    for (int q = 0; q < R; ++q) {
      if (q < M) {
        const int4 xv = xn ? __ldcg(reinterpret_cast<const int4*>(xn + (size_t)q * K + i)) : make_int4(0, 0, 0, 0);
        const int4 hv = __ldcg(reinterpret_cast<const int4*>(x + (size_t)q * ldx + i));
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const uint32_t xw = word(xv, c / 2), hw = word(hv, c / 2);
          const float xf = __uint_as_float((c & 1) ? (xw & 0xffff0000u) : (xw << 16));
          const float hf = __uint_as_float((c & 1) ? (hw & 0xffff0000u) : (hw << 16));
          ss[q] = fmaf(xf, xf, ss[q]);
          u[q] = fmaf(hf, av[c], u[q]);
        }
      }
    }
  }
  __shared__ float part[2 * R][kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int q = 0; q < R; ++q) {
    float v = ss[q], w = u[q];
    for (int o = 16; o > 0; o >>= 1) {
      v += __shfl_xor_sync(0xffffffffu, v, o);
      w += __shfl_xor_sync(0xffffffffu, w, o);
    }
    if (lane == 0) part[q][warp] = v, part[R + q][warp] = w;
  }
  __syncthreads();
  if (threadIdx.x < M) {
    const int q = threadIdx.x;
    float v = 0.f, w = 0.f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) v += part[q][k], w += part[R + q][k];
    const float r = xn ? rsqrtf(v / (float)K + eps) : 1.f;
    if (j == 0) r_out[q] = r;
    if (a) s_out[(size_t)q * ntasks + j] = r * w;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(sync, 1);
}

// Before the PDL wait (bias and B are constant during a decode step; s is the previous kernel's
// output): the L2 lines of the bias and of B's rows at the columns of tiles nt0 .. nt0 + tnw - 1,
// one line per lane, so that the epilogue's loads (in this block, or in the last block of a
// split-K column) wait on L2 rather than DRAM.
__device__ __forceinline__ void prefetch_epilogue(const Epilogue& e, int nt0, int tnw, bool who, int lane) {
  if (!who) return;
  for (int tn = 0; tn < tnw; ++tn) {
    const int col = (nt0 + tn) * 16;
    if (e.s)
      for (int t = lane; t < e.r; t += 32)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(e.b + (size_t)t * e.ld_b + col));
    if (e.bias && lane == 31) asm volatile("prefetch.global.L2 [%0];" ::"l"(e.bias + col));
    if (e.w && lane == 30) asm volatile("prefetch.global.L2 [%0];" ::"l"(e.w + col));
  }
}

// sum_{sp < splits} p[sp * stride] in split order (the bits of the plain loop), eight loads in
// flight at a time rather than a chain of dependent ones: the split-K partial sums of one output.
__device__ __forceinline__ float sum_splits(const float* p, size_t stride, int splits) {
  float sum = 0.f;
  for (int sp = 0; sp < splits; sp += 8) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = sp + j < splits ? __ldcg(p + (size_t)(sp + j) * stride) : 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (sp + j < splits) sum += v[j];
  }
  return sum;
}

// MMAs of half a chunk (k16 steps j = 2h, 2h+1); xh[mt] holds 16 bytes of activations.
template <int MT, int TNW>
__device__ __forceinline__ void half_mma(float (&acc)[TNW][MT][4], const int4 (&w)[TNW],
                                         const uint32_t (&sg)[TNW], const uint32_t (&sg8)[TNW],
                                         const int4* xh, int xstride, int h) {
#pragma unroll
  for (int jj = 0; jj < 2; ++jj) {
    const int j = 2 * h + jj;
    uint32_t a[TNW][4];
#pragma unroll
    for (int tn = 0; tn < TNW; ++tn) a_fragment(word(w[tn], j), sg[tn], sg8[tn], a[tn]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int4 xv = xh[mt * xstride];
      const uint32_t b0 = word(xv, 2 * jj), b1 = word(xv, 2 * jj + 1);
#pragma unroll
      for (int tn = 0; tn < TNW; ++tn) mma16816(acc[tn][mt], a[tn], b0, b1);
    }
  }
}

// Activation rows of one 64-input chunk staged in shared memory: row stride 144 bytes keeps a
// warp's 16-byte reads (rows g, offsets 32t) free of bank conflicts.
constexpr int kXRowBytes = 144;

// 16 bytes from global memory to the shared address dst through L2 alone (zeros where !valid).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;  // 0: fill with zeros
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem, valid);
}

template <int MT, int TNW>
__device__ __forceinline__ void chunk_mma_smem(float (&acc)[1][TNW][MT][4], const int4 (&w)[TNW],
                                               const uint32_t (&sg)[TNW], const uint32_t (&sg8)[TNW],
                                               const char* xs, int g, int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int4 xh[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      xh[mt] = *reinterpret_cast<const int4*>(xs + (mt * 8 + g) * kXRowBytes + 32 * t + 16 * h);
    half_mma<MT, TNW>(acc[0], w, sg, sg8, xh, 1, h);
  }
}

// One warp: TNW weight tiles over groups [g0, g1) of 4 chunks (256 inputs). Weights stream
// through a ring of D chunks per tile (chunk c+D is requested once chunk c is used), scales a
// group ahead; all addresses are a running pointer plus constant offsets. Activations: registers
// a chunk ahead (MT <= 2) or a per-block shared-memory double buffer filled by cp.async (MT >= 4).
template <int MT, int TNW, int D, bool SMEM, int EPI>
__global__ void __launch_bounds__(kWarps * 32, MT * TNW == 1 ? 4 : (MT * TNW <= 2 ? 3 : (MT * TNW <= 4 ? 2 : 1)))
    gemm_small_kernel(const int4* __restrict__ wq, const uint16_t* __restrict__ x,
                      uint16_t* __restrict__ y, float* __restrict__ ws, int* __restrict__ counters,
                      const float* __restrict__ alpha_p, int M, int N, int K, int ldx, int ldy,
                      int ntiles, int kg, int splits, int gps, int pf, int wpt, const Epilogue ep) {
  constexpr int NACC = (MT * TNW == 1 && !SMEM) ? 2 : 1;  // two MMA chains when there is one
  constexpr int kGroup = 144;                              // int4s per record: 4 x 512 B + 256 B
  constexpr int kStage = MT * 8 * kXRowBytes;              // bytes of one shared-memory stage
  constexpr int kPieces = SMEM ? MT * 8 * 8 / (kWarps * 32) : 1;  // 16-byte copies per thread
  extern __shared__ __align__(16) char xsmem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // wpt warps per tile slot split its K range inside the block (slice ks of wpt); the block's
  // kWarps / wpt slots hold consecutive weight tiles of its column block, and K is also split
  // across blocks. A block's column block and K split are its grid position (x, y), or in norm
  // mode (a 1-D grid whose first ntasks blocks are the tasks, see Epilogue) its place after them.
  const int tpb = kWarps / wpt, ks = warp % wpt;
  const bool tasked = EPI == 2 && ep.ntasks > 0;
  const int cols = (ntiles + tpb * TNW - 1) / (tpb * TNW);
  if (tasked && (int)blockIdx.x < ep.ntasks) {
    if constexpr (EPI == 2 && MT <= 2)
      norm_task<MT * 8>(ep.xn, ep.a, ep.s_out, ep.r_out, ep.sync, ep.ntasks, ep.eps, blockIdx.x, x, M, K, ldx);
    return;
  }
  auto bx = [&]() { return tasked ? ((int)blockIdx.x - ep.ntasks) % cols : (int)blockIdx.x; };
  const int nt0 = (bx() * tpb + warp / wpt) * TNW;
  const int split = tasked ? ((int)blockIdx.x - ep.ntasks) / cols : (int)blockIdx.y;
  const int g0 = (split * wpt + ks) * gps;
  const int g1 = min(kg, g0 + gps);
  const int npad = ntiles * 16;
  const bool active = nt0 < ntiles;

  float acc[NACC][TNW][MT][4];
#pragma unroll
  for (int a = 0; a < NACC; ++a)
#pragma unroll
    for (int tn = 0; tn < TNW; ++tn)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[a][tn][mt][i] = 0.f;

  if (g0 < g1 && (active || SMEM)) {
    const int4* wptr[TNW];
#pragma unroll
    for (int tn = 0; tn < TNW; ++tn)
      wptr[tn] = wq + ((size_t)(active ? nt0 + tn : 0) * kg + g0) * kGroup + lane;
    // this lane's scales: the record's last 256 bytes, 8 per lane
    auto sload = [&](int tn, int grp) {
      int2 r;
      const int2* p = reinterpret_cast<const int2*>(wptr[tn] - lane + grp * kGroup + 128) + lane;
      asm volatile("ld.global.nc.L1::no_allocate.v2.s32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
      return r;
    };
    int4 wb[D][TNW];
    int2 sc[TNW], sn[TNW];
    if (active) {
#pragma unroll
      for (int tn = 0; tn < TNW; ++tn) {
#pragma unroll
        for (int d = 0; d < D; ++d) wb[d][tn] = ld_stream(wptr[tn] + d * 32);
        sc[tn] = sload(tn, 0);
      }
    }
    if constexpr (EPI > 0) prefetch_epilogue(ep, nt0, TNW, active && ks == 0 && split == 0, lane);
    pdl_wait_then_release();  // activations are the previous kernel's output
    // activations: register path, lane (g, t) reads 32 bytes of row mt*8+g per chunk
    const uint16_t* xptr[MT];
    bool xok[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int tok = mt * 8 + g;
      xok[mt] = tok < M && !SMEM;
      xptr[mt] = x + (size_t)(xok[mt] ? tok : 0) * ldx + 16 * t + (size_t)g0 * 256;
    }
    int krem = K - 16 * t - g0 * 256;  // inputs left for this lane's first chunk
    int4 xb[SMEM ? 1 : 2][SMEM ? 1 : MT][2];
    auto xload = [&](int buf, int off_chunks, int kleft) {
      if constexpr (!SMEM) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          xb[buf][mt][0] = make_int4(0, 0, 0, 0);
          xb[buf][mt][1] = make_int4(0, 0, 0, 0);
          if (xok[mt] && off_chunks * 64 < kleft) {
            xb[buf][mt][0] = ld_x(xptr[mt] + off_chunks * 64);
            xb[buf][mt][1] = ld_x(xptr[mt] + off_chunks * 64 + 8);
          }
        }
      }
    };
    // shared-memory path: thread i copies pieces i, i+256, ... (row = piece/8, 16 bytes each)
    const uint16_t* sptr[kPieces];
    int srow_ok[kPieces], spiece[kPieces];
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int pc = threadIdx.x + i * kWarps * 32, row = pc >> 3;
      spiece[i] = pc;
      srow_ok[i] = SMEM && row < M;
      sptr[i] = x + (size_t)(srow_ok[i] ? row : 0) * ldx + (pc & 7) * 8 + (size_t)g0 * 256;
    }
    int skrem = K - g0 * 256;
    auto stage = [&](int off_chunks, int kleft, int buf) {
      if constexpr (SMEM) {
#pragma unroll
        for (int i = 0; i < kPieces; ++i) {
          const bool ok = srow_ok[i] && off_chunks * 64 + (spiece[i] & 7) * 8 < kleft;
          const int row = spiece[i] >> 3;
          cp_async16(xsmem + buf * kStage + row * kXRowBytes + (spiece[i] & 7) * 16,
                     ok ? sptr[i] + off_chunks * 64 : x, ok);
        }
        asm volatile("cp.async.commit_group;");
      }
    };
    if constexpr (SMEM) stage(0, skrem, 0);
    else xload(0, 0, krem);

    for (int gi = g0; gi < g1; ++gi) {
      const bool more = gi + 1 < g1;
      // L2 prefetch of the record pf groups ahead: 18 lines of 128 bytes, one per lane
      if (pf > 0 && active && lane < 18 && gi + pf < g1) {
#pragma unroll
        for (int tn = 0; tn < TNW; ++tn)
          asm volatile("prefetch.global.L2 [%0];" ::"l"(wptr[tn] - lane + pf * kGroup + lane * 8));
      }
      if (active && more) {
#pragma unroll
        for (int tn = 0; tn < TNW; ++tn) sn[tn] = sload(tn, 1);
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint32_t sg[TNW], sg8[TNW];
#pragma unroll
        for (int tn = 0; tn < TNW; ++tn) chunk_scales(sc[tn], c, sg[tn], sg8[tn]);
        if constexpr (SMEM) {
          if (c < 3 || more) {
            stage(c + 1, skrem, (c + 1) & 1);  // chunk c+1 (the next group's chunk 0 at c = 3)
            asm volatile("cp.async.wait_group 1;");
          } else {
            asm volatile("cp.async.wait_group 0;");
          }
          __syncthreads();
          if (active) {
            const char* xs = xsmem + (c & 1) * kStage;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              int4 xh[MT];
#pragma unroll
              for (int mt = 0; mt < MT; ++mt)
                xh[mt] = *reinterpret_cast<const int4*>(xs + (mt * 8 + g) * kXRowBytes + 32 * t + 16 * h);
              half_mma<MT, TNW>(acc[0], wb[c % D], sg, sg8, xh, 1, h);
            }
          }
          __syncthreads();
        } else {
          if (c < 3 || more) xload((c + 1) & 1, c + 1, krem);
#pragma unroll
          for (int h = 0; h < 2; ++h)
            half_mma<MT, TNW>(acc[h % NACC], wb[c % D], sg, sg8, &xb[c & 1][0][h], 2, h);
        }
        // refill this ring slot with chunk c + D (of this group or the next)
        if (active) {
          if (c + D < 4) {
#pragma unroll
            for (int tn = 0; tn < TNW; ++tn) wb[c % D][tn] = ld_stream(wptr[tn] + (c + D) * 32);
          } else if (more) {
#pragma unroll
            for (int tn = 0; tn < TNW; ++tn) wb[c % D][tn] = ld_stream(wptr[tn] + kGroup + (c + D - 4) * 32);
          }
        }
      }
#pragma unroll
      for (int tn = 0; tn < TNW; ++tn) {
        sc[tn] = sn[tn];
        wptr[tn] += kGroup;
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) xptr[mt] += 256;
#pragma unroll
      for (int i = 0; i < kPieces; ++i) sptr[i] += 256;
      krem -= 256;
      skrem -= 256;
    }
  }
  pdl_wait_then_release();  // blocks without a K range: before the workspace and tickets
  if constexpr (NACC == 2) {
#pragma unroll
    for (int tn = 0; tn < TNW; ++tn)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[0][tn][mt][i] += acc[NACC - 1][tn][mt][i];
  }
  // In-block K slices (register path only): slices 1..wpt-1 leave their sums in shared memory,
  // slice 0 adds them in slice order (fixed, so the bits do not depend on timing).
  if (!SMEM && wpt > 1) {
    constexpr int kVals = TNW * MT * 4;
    float* red = reinterpret_cast<float*>(xsmem);
    if (ks != 0) {
#pragma unroll
      for (int tn = 0; tn < TNW; ++tn)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int i = 0; i < 4; ++i) red[(warp * kVals + (tn * MT + mt) * 4 + i) * 32 + lane] = acc[0][tn][mt][i];
    }
    __syncthreads();
    if (ks == 0) {
      for (int j = 1; j < wpt; ++j) {
#pragma unroll
        for (int tn = 0; tn < TNW; ++tn)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              acc[0][tn][mt][i] += red[((warp + j) * kVals + (tn * MT + mt) * 4 + i) * 32 + lane];
      }
    }
  }
  const bool owner = active && ks == 0;  // this warp writes its tiles' sums

  const float alpha = __ldg(alpha_p);
  if (splits == 1) {
    if (!owner) return;
    if constexpr (EPI == 2) wait_tasks(ep);
    // the LoRA deltas of all this lane's outputs first (up to 16 rows; beyond, registers are
    // short): their loads go out in one round rather than one round per output behind the
    // previous output's store
    constexpr bool kEarly = EPI > 0 && MT <= 2;
    float dl[TNW][MT][4];
    if constexpr (kEarly) {
#pragma unroll
      for (int tn = 0; tn < TNW; ++tn)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int tk = mt * 8 + 2 * t + (i & 1), nn = (nt0 + tn) * 16 + g + 8 * (i >> 1);
            dl[tn][mt][i] = ep.s && tk < M && nn < N ? lora_delta<EPI>(ep, tk, nn) : 0.f;
          }
    }
#pragma unroll
    for (int tn = 0; tn < TNW; ++tn)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int n = (nt0 + tn) * 16 + g, tok = mt * 8 + 2 * t;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tk = tok + (i & 1), nn = n + 8 * (i >> 1);
          if (tk < M && nn < N)
            store<EPI>(y, ldy, tk, nn, acc[0][tn][mt][i] * alpha, ep, kEarly ? &dl[tn][mt][i] : nullptr);
        }
      }
    return;
  }

  // Split K: write this block's partial sums, then the last block of the column adds them.
  if (owner) {
    float* part = ws + (size_t)split * M * npad;
#pragma unroll
    for (int tn = 0; tn < TNW; ++tn)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int n = (nt0 + tn) * 16 + g, tok = mt * 8 + 2 * t;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tk = tok + (i & 1), nn = n + 8 * (i >> 1);
          if (tk < M) part[(size_t)tk * npad + nn] = acc[0][tn][mt][i];
        }
      }
  }
  __threadfence();
  __syncthreads();
  __shared__ int is_last;
  if (threadIdx.x == 0) is_last = atomicAdd(&counters[bx()], 1) == splits - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if constexpr (EPI == 2) wait_tasks(ep);
  const int kWidth = tpb * TNW * 16;
  const int nb = bx() * kWidth;
  for (int i = threadIdx.x; i < M * kWidth; i += kWarps * 32) {
    const int tk = i / kWidth, nn = nb + i % kWidth;
    if (nn >= N) continue;
    const float sum = sum_splits(ws + (size_t)tk * npad + nn, (size_t)M * npad, splits);
    store<EPI>(y, ldy, tk, nn, sum * alpha, ep);
  }
  if (threadIdx.x == 0) counters[bx()] = 0;
}

// ---- Medium M (16..256 rows per block): warpgroup MMA (wgmma) --------------------------------
// A block is WG warpgroups; warpgroup w owns 4 weight tiles (64 rows, the wgmma's M) and all BN
// activation rows of the block (the wgmma's N). Each warp streams its own tile's records into
// registers as the small kernel does (a ring of one group ahead, optional L2 prefetch) and
// dequantizes them straight into the register A operand of wgmma, whose per-warp fragment is
// the m16n8k16 A fragment the layout was made for. A is double-buffered per k16 step: the
// dequantization of step j+1 runs while the tensor cores work on step j.
//
// Activations (the B operand, read by wgmma from shared memory): a ring of 4 chunk stages (64
// inputs x BN rows). The MMA's input permutation inside a chunk moves 2-input (4-byte) pieces, so
// the ring is filled by 4-byte cp.async (rows past M copy the tile's first row, whose sums are
// never written; pieces past K are zero-filled, checked only in the chunk where K ends). Each k16
// step is stored as wgmma's K-major "core matrices" (8 rows x 16 bytes): core (row block nb, k half p) at
// nb * 288 + p * 144 bytes, step j at j * (36 BN + 32). The paddings make the 32 lanes of one
// copy instruction (rows n and n+4, halves p, steps j and j+1, lane quads t) hit 32 different
// banks. One barrier per chunk: it publishes chunk c and frees the stage of chunk c-1, which
// the chunk c+3 copies then overwrite (16-row blocks); from 32 rows the copies run two chunks
// ahead and overwrite chunk c-2's stage, so chunk c-1's last wgmma may still be in flight.
// Blocks of kPermutedRows rows or more (their copies cost the most instructions) read instead a
// copy of the activations that permute_x_kernel writes first in the MMA's input order (zeros past
// M, to the row tile's end, and past K, to whole groups): one 16-byte cp.async per core-matrix row,
// through L1 (.ca) like the 4-byte copies (through L2 alone, .cg, it read twice the L2 sectors).
constexpr int kPermutedRows = 128;
constexpr int kCoreLbo = 144;  // bytes between the two k halves of a step (wgmma "leading" offset)
constexpr int kCoreSbo = 288;  // bytes between 8-row blocks (wgmma "stride" offset)

template <int BN>
struct WgTile {
  static constexpr int kStep = 36 * BN + 32;  // bytes of one k16 step (all BN rows)
  static constexpr int kStage = 4 * kStep;    // one chunk
  static constexpr int kSmem = 4 * kStage;    // the ring
};

// D[64 x N] += A[64 x 16] (registers, bf16) * B[16 x N] (shared memory, K-major), fp32 D.
template <int N>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc);

// One wrapper per N (generated: the operand lists are spelled out).
template <>
__device__ __forceinline__ void wgmma_bf16<16>(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7}, "
      "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_bf16<32>(float (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_bf16<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_bf16<96>(float (&d)[48], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "
      "{%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_bf16<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_bf16<192>(float (&d)[96], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
      "{%96, %97, %98, %99}, %100, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_bf16<256>(float (&d)[128], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ void wg_fence(uint32_t (&a)[4]) {
  asm volatile("wgmma.fence.sync.aligned;" : "+r"(a[0]), "+r"(a[1]), "+r"(a[2]), "+r"(a[3])::"memory");
}
// The same for a chunk's four A fragments.
__device__ __forceinline__ void wg_fence4(uint32_t (&a)[4][4]) {
  asm volatile("wgmma.fence.sync.aligned;"
               : "+r"(a[0][0]), "+r"(a[0][1]), "+r"(a[0][2]), "+r"(a[0][3]), "+r"(a[1][0]), "+r"(a[1][1]),
                 "+r"(a[1][2]), "+r"(a[1][3]), "+r"(a[2][0]), "+r"(a[2][1]), "+r"(a[2][2]), "+r"(a[2][3]),
                 "+r"(a[3][0]), "+r"(a[3][1]), "+r"(a[3][2]), "+r"(a[3][3])::"memory");
}
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
template <int R>
__device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}

// The block's K work: columns of kTiles weight tiles (4 * WG), each kg groups of 256 inputs, laid
// end to end as ncols * kg units and cut into gridDim.x equal ranges ("stream K"): block b takes
// units [b U / B, (b + 1) U / B) and with them one or more segments, each a column's groups
// [g0, g1). A segment that is a whole column writes its output; the segments of a column that
// several blocks share write fp32 partial sums to slot (block + column) of the workspace (the
// slots of one column are consecutive, in block order), and the column's last block to finish
// (an atomic ticket) adds them in that order, so results are deterministic for a given grid.
// With B = ncols every block is one whole column; rows past BN go to further blocks along z,
// which then must take whole columns.
__device__ __forceinline__ int sk_owner(long long u, long long units, int blocks) {
  return (int)(((u + 1) * blocks - 1) / units);  // the block whose range holds unit u
}

// A block's stream-K segment that starts at unit u (units are the columns' K groups laid end to
// end, the block's run ends at u_end): column col, groups [g0, g1); whole: the column's full K range.
struct WgSegment {
  // gcol: the launch's column (row tile z x ncols + the layer's column block col; units are the gcols'
  // K groups: several row tiles in one run of stream K in the warp-specialized kernel)
  int gcol, z, col, g0, g1;
  bool whole;
  int tile;     // the warp's weight tile (warp w of the block's kTiles)
  bool active;  // the warp's warpgroup has weight rows in the layer (uniform per warpgroup)
  int w, ntiles;  // the warp, the layer's weight tiles
  __device__ WgSegment(long long u, long long u_end, int kg, int kTiles, int w, int ntiles, int ncols = 1 << 30)
      : gcol((int)(u / kg)),
        z(gcol / ncols),
        col(gcol - z * ncols),
        g0((int)(u - (long long)gcol * kg)),
        g1((int)min((long long)kg, g0 + (u_end - u))),
        whole(g0 == 0 && g1 == kg),
        tile(col * kTiles + w),
        active(col * kTiles + (w & ~3) < ntiles),
        w(w),
        ntiles(ntiles) {}
  // the same for half h of a column of 16 tiles (the warp's tile tile + 8 h); half 0 is `active`
  __device__ bool active_half(int h) const { return tile - w + 8 * h + (w & ~3) < ntiles; }
};

// The end of a K segment in the wgmma kernels: a whole column writes its outputs; a shared one writes
// its partial sums, and the column's last block (a ticket) adds them in segment order and writes
// them. acc[4i + e]: weight row g + 8 (e >> 1) of the warp's tile (wl of the column block, whose
// kWidth / 16 tiles start at tile - wl), activation row m0 + 8i + 2t + (e & 1). kThreads threads
// take part (all of the block, or the compute warpgroups through named barrier 1).
// A ticket: atomic add of 1 with release (the block's writes, ordered before it by a block barrier,
// are visible to whoever acquires a later value) and acquire (the writes released by earlier
// tickets are visible after it, to the block once it meets a barrier); returns the old value.
__device__ __forceinline__ int ticket_acq_rel(int* p) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  return old;
}

// Blocks of up to this many rows store stream-K partial sums as each thread's accumulators lie in its
// registers (a slot of BN rows; _WG_REGISTER_SUMS_BN in nvfp4_gemm.py), larger ones in the outputs' order.
constexpr int kRegisterSumsRows = 64;

// A shared segment's partial sums into slot (b + column) of the workspace. Blocks of up to kRegisterSumsRows rows:
// every thread's accumulators as they lie in its registers (float4 q of thread tid at q * kThreads +
// tid of the slot: coalesced 16-byte stores); more rows: in the outputs' order (M x kWidth floats).
template <int BN, int kWidth, int kThreads, int H>
__device__ __forceinline__ void sk_store_partial(const float (&acc)[H][BN / 2], const WgSegment& seg, int wl,
                                                 int tid, int lane, int b, int M, float* ws) {
  const int g = lane >> 2, t = lane & 3, col = seg.gcol;
  if constexpr (BN <= kRegisterSumsRows) {
    constexpr size_t kSlot4 = (size_t)(H * BN / 8) * kThreads;
    float4* part = reinterpret_cast<float4*>(ws) + (size_t)(b + col) * kSlot4 + tid;
#pragma unroll
    for (int h = 0; h < H; ++h)
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
        __stcg(part + (h * (BN / 8) + i) * kThreads,
               make_float4(acc[h][4 * i], acc[h][4 * i + 1], acc[h][4 * i + 2], acc[h][4 * i + 3]));
  } else {
    const size_t slot = (size_t)min(M, BN) * kWidth;
    const int rows = M - seg.z * BN;  // of the row tile
#pragma unroll
    for (int h = 0; h < H; ++h) {
      if (!seg.active_half(h)) continue;
      float* part = ws + (size_t)(b + col) * slot + (wl + 8 * h) * 16 + g;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tk = 8 * i + 2 * t + (e & 1);
          if (tk < rows) part[(size_t)tk * kWidth + 8 * (e >> 1)] = acc[h][4 * i + e];
        }
    }
  }
}

// Threads hid = 0 .. nh - 1 add the nseg partial sums of a shared column (slots b0 + col on, in
// segment order, as sk_store_partial<BN, kWidth, kThreads, H> wrote them) and write its outputs,
// float4 of R positions in JB slots in flight at a time.
template <int BN, int kWidth, int kThreads, int H, int R, int JB>
__device__ __forceinline__ void sk_add_slots(int hid, int nh, int gcol, int col, int b0, int nseg, int M, int N,
                                             int m0, int ldy, float alpha, uint16_t* y, const float* ws) {
  constexpr bool kRegs = BN <= kRegisterSumsRows;
  const int n4 = kRegs ? (H * BN / 8) * kThreads : min(M, BN) * kWidth / 4;  // float4 of a slot
  const float4* s0 = reinterpret_cast<const float4*>(ws) + (size_t)(b0 + gcol) * n4;
  for (int i0 = hid; i0 < n4; i0 += R * nh) {
    float4 v[R];
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j0 = 0; j0 < nseg; j0 += JB) {
      float4 w[JB][R];
#pragma unroll
      for (int jj = 0; jj < JB; ++jj)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int i = i0 + r * nh;
          w[jj][r] = j0 + jj < nseg && i < n4 ? __ldcg(s0 + (size_t)(j0 + jj) * n4 + i)
                                              : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
      for (int jj = 0; jj < JB; ++jj)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (j0 + jj >= nseg) continue;
          if (kRegs && j0 + jj == 0) {  // as wg_segment_out_h adds them (the outputs' order: from 0)
            v[r] = w[jj][r];
          } else {
            v[r].x += w[jj][r].x, v[r].y += w[jj][r].y, v[r].z += w[jj][r].z, v[r].w += w[jj][r].w;
          }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int i = i0 + r * nh;
      if (i >= n4) continue;
      const float e4[4] = {v[r].x, v[r].y, v[r].z, v[r].w};
      if constexpr (kRegs) {
        // float4 q of compute thread tid: acc[h][4 i + e] of warp wl, lane (g, t)
        const int q = i / kThreads, tid = i % kThreads, wl = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
        const int h = q / (BN / 8), ii = q % (BN / 8), nn0 = (col * (kWidth / 16) + wl + 8 * h) * 16 + g;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tk = m0 + 8 * ii + 2 * t + (e & 1), nn = nn0 + 8 * (e >> 1);
          if (tk < M && nn < N) y[(size_t)tk * ldy + nn] = to_bf16(e4[e] * alpha);
        }
      } else {
        const int tk = m0 + 4 * i / kWidth, nn = col * kWidth + 4 * i % kWidth;
        if (tk >= M) continue;
        uint16_t* yr = y + (size_t)tk * ldy + nn;
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (nn + e < N) yr[e] = to_bf16(e4[e] * alpha);
      }
    }
  }
}

// H: weight tiles per warp, acc[h] that of tile wl + 8 h of the column (H = 2: columns of 16 tiles).
// kLoads: float4 loads in flight per thread when the column's last block adds register-order slots.
template <int BN, int kWidth, int kThreads, bool kNamedBarrier, int H, int kLoads = 4>
__device__ __forceinline__ void wg_segment_out_h(float (&acc)[H][BN / 2], const WgSegment& seg, int wl,
                                                 int tid, int lane, int b, int blocks, long long units, int kg, int M,
                                                 int N, int m0, int ldy, float alpha, uint16_t* y, float* ws,
                                                 int* counters, int& is_last) {
  const int g = lane >> 2, t = lane & 3, col = seg.gcol;  // the tickets' and slots' column
  auto sync = [] {
    if constexpr (kNamedBarrier) asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory");
    else __syncthreads();
  };
  auto write_y = [&](const float (&v)[H][BN / 2]) {
#pragma unroll
    for (int h = 0; h < H; ++h) {
      if (!seg.active_half(h)) continue;
      const int tile = seg.tile + 8 * h;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tk = m0 + 8 * i + 2 * t + (e & 1), nn = tile * 16 + g + 8 * (e >> 1);
          if (tk < M && nn < N) y[(size_t)tk * ldy + nn] = to_bf16(v[h][4 * i + e] * alpha);
        }
    }
  };
  if (seg.whole) {
    write_y(acc);
    return;
  }
  const long long c0 = (long long)col * kg;  // the column's segments: blocks b0 .. b0 + nseg - 1
  const int b0 = sk_owner(c0, units, blocks);
  const int nseg = sk_owner(c0 + kg - 1, units, blocks) - b0 + 1;
  if constexpr (BN <= kRegisterSumsRows) {
    // A shared column (one row tile, m0 = 0) of up to kRegisterSumsRows rows per block: every thread
    // stores its accumulators as they lie in its registers (float4 q of thread tid at q * kThreads + tid
    // of the block's slot: coalesced 16-byte stores), and the column's last block adds the segments'
    // slots in segment order, each thread its own positions into its accumulators (kLoads float4 in
    // flight: several slots a round), then writes the outputs as a whole column would.
    constexpr int Q = H * BN / 8;                     // float4 of a thread
    constexpr size_t kSlot4 = (size_t)Q * kThreads;  // float4 of a slot (BN x kWidth floats)
    sk_store_partial<BN, kWidth, kThreads, H>(acc, seg, wl, tid, lane, b, M, ws);
    sync();  // the block's stores come before thread 0's release
    if (tid == 0) is_last = ticket_acq_rel(&counters[col]) == nseg - 1;
    sync();  // and the other segments' stores before the last block's loads (thread 0's acquire)
    if (is_last) {  // acc (already stored) becomes the sum: QC float4 of JB slots in flight at a time
      const float4* s0 = reinterpret_cast<const float4*>(ws) + (size_t)(b0 + col) * kSlot4 + tid;
      constexpr int QC = Q < kLoads ? Q : kLoads, JB = kLoads / QC;
#pragma unroll
      for (int q0 = 0; q0 < Q; q0 += QC)
        for (int j0 = 0; j0 < nseg; j0 += JB) {
          float4 w[JB][QC];
#pragma unroll
          for (int jj = 0; jj < JB; ++jj)
#pragma unroll
            for (int q = 0; q < QC; ++q)
              if (j0 + jj < nseg) w[jj][q] = __ldcg(s0 + (j0 + jj) * kSlot4 + (q0 + q) * kThreads);
#pragma unroll
          for (int jj = 0; jj < JB; ++jj)
#pragma unroll
            for (int q = 0; q < QC; ++q) {
              if (j0 + jj >= nseg) continue;
              float* vq = &acc[(q0 + q) / (BN / 8)][4 * ((q0 + q) % (BN / 8))];
              if (j0 + jj == 0) {
                vq[0] = w[jj][q].x, vq[1] = w[jj][q].y, vq[2] = w[jj][q].z, vq[3] = w[jj][q].w;
              } else {
                vq[0] += w[jj][q].x, vq[1] += w[jj][q].y, vq[2] += w[jj][q].z, vq[3] += w[jj][q].w;
              }
            }
        }
      write_y(acc);
      if (tid == 0) counters[col] = 0;
    }
  } else {
    // A shared column (one row tile, m0 = 0) of more rows per block: partial sums in the
    // outputs' order (M x kWidth floats a slot), then the column's last block adds them in segment
    // order and writes them, four consecutive outputs a thread.
    sk_store_partial<BN, kWidth, kThreads, H>(acc, seg, wl, tid, lane, b, M, ws);
    __threadfence();
    sync();
    if (tid == 0) is_last = atomicAdd(&counters[col], 1) == nseg - 1;
    sync();
    if (is_last) {
      __threadfence();
      sk_add_slots<BN, kWidth, kThreads, H, 4, 2>(tid, kThreads, col, seg.col, b0, nseg, M, N, m0, ldy, alpha, y,
                                                  ws);
      if (tid == 0) counters[col] = 0;
    }
  }
  sync();  // is_last is read before the next segment's ticket rewrites it
}

template <int BN, int kWidth, int kThreads, bool kNamedBarrier>
__device__ __forceinline__ void wg_segment_out(float (&acc)[BN / 2], const WgSegment& seg, int wl, int tid,
                                               int lane, int b, int blocks, long long units, int kg, int M, int N,
                                               int m0, int ldy, float alpha, uint16_t* y, float* ws, int* counters,
                                               int& is_last) {
  wg_segment_out_h<BN, kWidth, kThreads, kNamedBarrier, 1>(reinterpret_cast<float(&)[1][BN / 2]>(acc), seg, wl,
                                                           tid, lane, b, blocks, units, kg, M, N, m0, ldy, alpha, y,
                                                           ws, counters, is_last);
}

template <int BN, int WG>
__global__ void __launch_bounds__(WG * 128, WG == 1 ? 4 : (BN <= 128 ? 2 : 1))
    gemm_wg_kernel(const int4* __restrict__ wq, const uint16_t* __restrict__ x,
                   uint16_t* __restrict__ y, float* __restrict__ ws, int* __restrict__ counters,
                   const float* __restrict__ alpha_p, int M, int N, int K, int ldx, int ldy,
                   int ntiles, int kg, int ncols, int pf) {
  using T = WgTile<BN>;
  constexpr int kGroup = 144;               // int4s per record
  constexpr int kTiles = 4 * WG;            // weight tiles per block
  constexpr int kWidth = kTiles * 16;       // output columns per column block
  constexpr int kRoundRows = 8 * WG;        // activation rows one copy round covers
  constexpr int kRounds = BN / kRoundRows;  // copy rounds per chunk
  // chunks of activations requested ahead: three with 16-row blocks; from 32 rows two, so that a
  // chunk's last wgmma stays in flight across the next chunk's barrier (measured: 1-4% faster
  // from 32 rows, 5-10% slower at 16)
  constexpr int kAhead = BN >= 32 ? 2 : 3;
  static_assert(BN % kRoundRows == 0, "BN must be a multiple of 8 * WG");
  extern __shared__ __align__(128) char wg_smem[];
  __shared__ int is_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int m0 = blockIdx.z * BN;
  const int blocks = gridDim.x, b = blockIdx.x;
  const long long units = (long long)ncols * kg;
  const long long u_end = (b + 1) * units / blocks;
  const float alpha = __ldg(alpha_p);
  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem));
  const uint64_t desc0 = ((sbase >> 4) & 0x3FFF) | ((uint64_t)(kCoreLbo >> 4) << 16) |
                         ((uint64_t)(kCoreSbo >> 4) << 32);
  // activation copies: lane (t, p, jb, tk) of warp w moves, per round q and a in {0, 1}, the
  // 4-byte piece (row 16q.. + nlo, inputs 16t + 4(2a + jb) + 2p) of the chunk.
  const int cp = (lane >> 2) & 1, cjb = (lane >> 3) & 1, ctk = lane >> 4;
  const int nlo = (warp & 3) + 8 * (warp >> 2) + 4 * ctk;
  const uint32_t dst0 =
      sbase + cjb * T::kStep + cp * kCoreLbo + (nlo >> 3) * kCoreSbo + (nlo & 7) * 16 + 4 * t;
  const int rows_left = M - m0 - nlo;
  // permuted copies (BN >= kPermutedRows; x is the permuted copy, ldx its row length, rows to the
  // tile's end): piece i of a chunk is row n = i / 8, step j = i % 8 / 2, half h = i % 2, 16 bytes
  constexpr bool kPermuted = BN >= kPermutedRows;
  constexpr int kPieces = BN * 8, kPer = (kPieces + WG * 128 - 1) / (WG * 128);
  uint32_t pdst[kPer];
  int psrc[kPer];  // from the row tile's first row (m0 * ldx is in the base pointer, xb)
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int i = threadIdx.x + r * WG * 128, n = i >> 3, jh = i & 7;
    pdst[r] = sbase + (jh >> 1) * T::kStep + (jh & 1) * kCoreLbo + (n >> 3) * kCoreSbo + (n & 7) * 16;
    psrc[r] = n * ldx + jh * 8;
  }
  static_assert(!kPermuted || kPieces % (WG * 128) == 0, "every thread copies kPer pieces");

  bool first = true;
  for (long long u = b * units / blocks; u < u_end;) {
    const WgSegment seg(u, u_end, kg, kTiles, warp, ntiles);
    const int g0 = seg.g0, g1 = seg.g1;
    const bool active = seg.active;

    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;

    // direct copies: this lane's pieces of round q start at xb + xo[q] (the current group); rows
    // past M read the tile's first row, so only the chunk where K ends needs checks (and zeros)
    const uint16_t* xb =
        x + (size_t)m0 * ldx + (size_t)g0 * 256 + (kPermuted ? 0 : 16 * t + 4 * cjb + 2 * cp);
    int xo[kRounds];
#pragma unroll
    for (int q = 0; q < kRounds; ++q) xo[q] = q * kRoundRows < rows_left ? (nlo + q * kRoundRows) * ldx : 0;
    int kc = K - g0 * 256;  // inputs of K from the current group's start
    auto issue = [&](int goff, int cc) {  // chunk cc of group (current + goff) into stage cc
      const uint32_t dst = dst0 + cc * T::kStage;
      if constexpr (kPermuted) {
#pragma unroll
        for (int r = 0; r < kPer; ++r)
          asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(pdst[r] + cc * T::kStage),
                       "l"(xb + psrc[r] + goff * 256 + cc * 64));
      } else if (goff * 256 + cc * 64 + 64 <= kc) {  // the whole chunk is inside K (uniform)
#pragma unroll
        for (int q = 0; q < kRounds; ++q)
#pragma unroll
          for (int a = 0; a < 2; ++a)
            cp_async4(dst + 2 * a * T::kStep + q * (kRoundRows / 8) * kCoreSbo,
                      xb + xo[q] + goff * 256 + cc * 64 + 8 * a, true);
      } else {
        const bool ok = goff * 256 + cc * 64 + 16 * t < kc;
#pragma unroll
        for (int q = 0; q < kRounds; ++q)
#pragma unroll
          for (int a = 0; a < 2; ++a)
            cp_async4(dst + 2 * a * T::kStep + q * (kRoundRows / 8) * kCoreSbo,
                      ok ? xb + xo[q] + goff * 256 + cc * 64 + 8 * a : x, ok);
      }
    };

    // -- weights: this warp's tile, one group (4 chunks) in flight ahead
    const int4* wptr = wq + ((size_t)(active ? seg.tile : 0) * kg + g0) * kGroup + lane;
    auto sload = [&](int grp) {
      int2 r;
      const int2* p = reinterpret_cast<const int2*>(wptr - lane + grp * kGroup + 128) + lane;
      asm volatile("ld.global.nc.L1::no_allocate.v2.s32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
      return r;
    };
    int4 wb[4];
    int2 sc = make_int2(0, 0), sn = make_int2(0, 0);
    if (active) {
#pragma unroll
      for (int d = 0; d < 4; ++d) wb[d] = ld_stream(wptr + d * 32);
      sc = sload(0);
    }
    if (first) pdl_wait_then_release();  // activations are the previous kernel's output
    first = false;

    issue(0, 0);
    asm volatile("cp.async.commit_group;" ::: "memory");
    issue(0, 1);
    asm volatile("cp.async.commit_group;" ::: "memory");
    if constexpr (kAhead == 3) {
      issue(0, 2);
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
    fence_acc(acc);

    for (int gi = g0; gi < g1; ++gi) {
      const bool more = gi + 1 < g1;
      if (pf > 0 && active && lane < 18 && gi + pf < g1)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(wptr - lane + pf * kGroup + lane * 8));
      if (active && more) sn = sload(1);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        asm volatile("cp.async.wait_group %0;" ::"n"(kAhead - 1) : "memory");  // chunk c has landed
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (c + kAhead < 4) issue(0, c + kAhead);
        else if (more) issue(1, c + kAhead - 4);
        asm volatile("cp.async.commit_group;" ::: "memory");
        if (active) {
          uint32_t sg, sg8;
          chunk_scales(sc, c, sg, sg8);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t a[4];
            a_fragment(word(wb[c], j), sg, sg8, a);
            wg_fence(a);
            wgmma_bf16<BN>(acc, a, desc0 + ((c * T::kStage + j * T::kStep) >> 4));
            wg_commit();
            if (j < 3 || kAhead == 2) wg_wait<1>();
            else wg_wait<0>();
          }
          if (more) wb[c] = ld_stream(wptr + kGroup + c * 32);
        }
      }
      sc = sn;
      wptr += kGroup;
      xb += 256;
      kc -= 256;
    }
    wg_wait<0>();
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    fence_acc(acc);
    __syncthreads();  // every warpgroup is done with the ring before the next segment refills it

    wg_segment_out<BN, kWidth, WG * 128, false>(acc, seg, warp, threadIdx.x, lane, b, blocks, units, kg, M, N, m0,
                                               ldy, alpha, y, ws, counters, is_last);
    u += g1 - g0;
  }
}

// ---- Medium M, warp-specialized (wg = 3, 4) -----------------------------------------------------
// Three warpgroups per block: one warp of warpgroup 0 only issues copies into a ring of kStages
// chunk stages, warpgroups 1 and 2 (64 weight rows each, as gemm_wg_kernel's two) only compute.
// A stage holds one chunk (64 inputs): its activations, in gemm_wg_kernel's ring layout, copied
// whole from an image of that layout that stage_x_kernel writes first (one bulk copy); its weights
// (the 8 tiles' 512 bytes, one box of a tensor map whose rows are the weight tiles); and, for a
// group's first chunk, the group's scales (8 x 256 bytes, one box of a second map). One thread
// issues at most three copies a chunk (issued one per tile and lane, the 8 tiles' copies took the
// producer ~1300 cycles a chunk and the compute warps waited for them). A stage's "full" barrier
// completes when its bytes have landed, its "empty" barrier when each compute warp is done with it
// (its wgmmas of the chunk finished). The compute warps read their A fragments from shared memory
// and keep two chunks of A registers:
// chunk c's four wgmma steps are issued before chunk c-1's are waited for, so up to eight steps
// stay in flight and no barrier of the whole block is met in the loop. The producer issues the
// weights of its first kStages chunks before griddepcontrol.wait. The grid, stream-K segments,
// workspace and epilogue are gemm_wg_kernel's with WG = 2.
// H = 2 (wg = 4): each compute warp owns two weight tiles, cw and cw + 8, so that a column block is
// 256 weight rows and every stage's activations serve twice the weights (two accumulators a warp,
// at most 64 rows per block). With 32 or 64 rows per block a chunk's four A fragments share one
// wgmma.fence and one commit group (H = 1; 1-2.5% less time than one each).
template <int BN, int H = 1, bool D = false>
struct WsTile {
  static constexpr int kTiles = 8 * H;             // weight tiles of a column block
  static constexpr int kStep = WgTile<BN>::kStep;  // bytes of one k16 step of activations (all BN rows)
  static constexpr int kAct = WgTile<BN>::kStage;  // activations of one chunk (gemm_wg_kernel's stage)
  static constexpr int kW = kTiles * 512;          // weights of one chunk
  static constexpr int kStageBytes = kAct + kW + kTiles * 256;  // + the group's scales (first chunk)
  // D: the producer's warps 1-3 copy the activations (blocks of fewer than kPermutedRows rows with
  // one weight tile per warp), through kRawSlots chunks of them as they lie in x (BN rows x 128
  // bytes each) after the stages; otherwise stage_x_kernel writes them first.
  static_assert(!D || (BN < kPermutedRows && H == 1), "copies of the activations: up to 64 rows, H = 1");
  static constexpr int kRawSlots = 4, kRaw = D ? kRawSlots * BN * 128 : 0;
  static constexpr int kBudget = 227 * 1024 - 2048 - kRaw;
  static constexpr int kStages = kBudget / kStageBytes < 16 ? kBudget / kStageBytes : 16;
  static constexpr int kHead = 1024;  // the barriers
  static constexpr int kSmem = kHead + kStages * kStageBytes + kRaw;
  static_assert(kStageBytes % 16 == 0 && kStep % 16 == 0, "descriptor offsets are in 16-byte units");
};

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// A 2-D box of a tensor map (coordinates: element c0 of row c1) into shared memory at dst.
__device__ __forceinline__ void tma_copy_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// Two fp32 values rounded to bf16 (as to_bf16) in one register: lo in the low half.
__device__ __forceinline__ uint32_t bf16x2_of(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// A whole column's outputs through shared memory (the ring's bytes, free once both compute warpgroups'
// MMAs are done and the producer has nothing left to copy: the block's last segment): the threads
// write their bf16 outputs into a [BN rows][kWidth] tile, then the 256 compute threads store it to
// y in 16-byte pieces, a row's kWidth outputs by consecutive threads. Written straight from the
// registers, each store instruction of a warp covers 16 bytes of 4 rows (the MMA's layout), and at
// 1024 rows these stores took 11-13% of the call (benchmarks/RESULTS.md, twenty-sixth round).
// The accumulators of 8 activation rows x 8 weight rows (acc[4i + 2q + e]: the warp's weight row
// g + 8q, activation row 8i + 2t + e) are an 8x8 matrix in the MMA's fragment order, weight rows
// along its rows, so a transposing stmatrix writes them as eight 16-byte pieces of tile rows; one
// instruction takes four (matrix m: rows 8 (i + m / 2) .., q = m % 2; lanes 8m .. 8m + 7 give its
// rows' addresses): a thread's 32 accumulators take 16 bf16x2 conversions and 4 stmatrix where
// they took 32 conversions and 32 two-byte stores.
// Needs N and ldy multiples of 8 and y 16-byte aligned (ws_tile_stores).
template <int BN, int kWidth, int H>
__device__ __forceinline__ void ws_store_tile(const float (&acc)[H][BN / 2], const WgSegment& seg, int wl, int tid,
                                              int lane, int M, int N, int m0, int ldy, float alpha, uint16_t* y,
                                              char* tile) {
  constexpr int kRowBytes = kWidth * 2 + 16;  // padded: a matrix's eight 16-byte rows hit all 32 banks
  const uint32_t lane_at = static_cast<uint32_t>(__cvta_generic_to_shared(tile)) +
                           (8 * (lane >> 4) + (lane & 7)) * kRowBytes + 16 * ((lane >> 3) & 1) + 32 * wl;
  asm volatile("bar.sync 1, 256;" ::: "memory");  // both warpgroups' MMAs have read their last stage
#pragma unroll
  for (int h = 0; h < H; ++h)
#pragma unroll
    for (int i = 0; i < BN / 8; i += 2) {
      uint32_t r[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int e = 4 * (i + (m >> 1)) + 2 * (m & 1);
        r[m] = bf16x2_of(acc[h][e] * alpha, acc[h][e + 1] * alpha);
      }
      asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                       lane_at + i * 8 * kRowBytes + 256 * h),
                   "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                   : "memory");
    }
  asm volatile("bar.sync 1, 256;" ::: "memory");
  const int n0 = seg.col * kWidth, rows = min(BN, M - m0);
  constexpr int kPieces = kWidth / 8;  // 16-byte pieces of a row
  for (int q = tid; q < rows * kPieces; q += 256) {
    const int r = q / kPieces, c = (q % kPieces) * 8;
    if (n0 + c < N)
      *reinterpret_cast<int4*>(y + (size_t)(m0 + r) * ldy + n0 + c) =
          *reinterpret_cast<const int4*>(tile + r * kRowBytes + 2 * c);
  }
}

// Whether ws_store_tile may store to y (row stride ldy, N columns).
__device__ __forceinline__ bool ws_tile_stores(const uint16_t* y, int N, int ldy) {
  return ((N | ldy) & 7) == 0 && (reinterpret_cast<uintptr_t>(y) & 15) == 0;
}

// The warp-specialized kernel's run order and who adds its shared segments' partial sums. The
// producer's idle warps 1-3 (the helpers; staged kernels only) take a shared segment's ticket and, in
// the column's last block, add its slots (sk_add_slots) while the compute warps go on. Their sums are
// slow (96 threads of 56 registers, a few loads in flight), so they take only the run's first segment
// (whose column's other blocks mostly finish later: a ticket, seldom a sum) and segments followed by
// at least `thr` units of the run (a column at up to 32 rows a block, two above); a run's last segment
// stays with the compute warps. A block whose run ends inside a column that it did not start in takes
// that column's head first, then the rest in order (the tail of its first column, then whole columns),
// where its whole columns are at least thr units (the tail's sum then hides behind them) or it has
// none (a run of two part columns); otherwise its run goes in order. Segment order, and so the
// results, are those of a run in order (measured: 7B gate_up at 64-256 rows, runs of 2.2 columns,
// lost 10-19% with both reordered and helped, and 4% reordered with the compute warps' sums).
struct WsRun {
  long long beg, mid, end;  // [mid, end) first, then [beg, mid)
  long long first, thr;     // the run's first unit; units of compute that hide a helpers' sum
  __device__ WsRun(long long beg, long long end, int kg, long long thr) : beg(beg), end(end), thr(thr) {
    const long long c = end / kg * kg, whole0 = (beg + kg - 1) / kg * kg;
    mid = end != c && c > beg && (c - whole0 >= thr || c <= whole0) ? c : end;
    first = mid < end ? mid : beg;
  }
  __device__ long long piece_beg(int p) const { return p == 0 ? mid : beg; }
  __device__ long long piece_end(int p) const { return p == 0 ? end : mid; }
  // units of the run after the segment of piece p that ends at unit `next`
  __device__ long long left(int p, long long next) const { return p == 0 ? end - next + mid - beg : mid - next; }
  // the helpers add the shared segment [start, next) of piece p
  __device__ bool helped(int p, long long start, long long next) const {
    const long long l = left(p, next);
    return l > 0 && (start == first || l >= thr);
  }
};

template <int BN, int H, bool D>
__global__ void __launch_bounds__(384, 1)
    gemm_ws_kernel(const int4* __restrict__ wq, const uint16_t* __restrict__ x, uint16_t* __restrict__ y,
                   float* __restrict__ ws, int* __restrict__ counters, const float* __restrict__ alpha_p, int M,
                   int N, int K, int ldx, int ldy, int ntiles, int kg, int ncols, int pf,
                   const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap smap) {
  using T = WsTile<BN, H, D>;
  constexpr int S = T::kStages;
  constexpr bool copies = D;  // warps 1-3 copy the activations from x
  constexpr bool helpers = !D;  // or else add the shared segments' partial sums (sk_add_slots)
  constexpr int kTiles = T::kTiles, kWidth = kTiles * 16;
  static_assert(BN * (kWidth * 2 + 16) <= S * T::kStageBytes, "ws_store_tile: the tile fits the ring");
  extern __shared__ __align__(128) char ws_smem[];
  __shared__ int is_last, help_last;
  // the warp index as a value the compiler knows to be warp-uniform (no divergent wgmma path)
  const int warp = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 5, 0), lane = threadIdx.x & 31;
  // the row tiles' columns laid end to end (WgSegment::gcol): several row tiles make one run of whole
  // columns a block, or of stream K (the copying kernel takes one row tile)
  const int mt = (M + BN - 1) / BN;
  const int blocks = gridDim.x, b = blockIdx.x;
  const long long units = (long long)ncols * mt * kg;
  const long long u_beg = b * units / blocks, u_end = (b + 1) * units / blocks;
  const WsRun run(u_beg, u_end, kg, (long long)kg * (BN <= 32 ? 1 : 2));
  const int total = (int)(u_end - u_beg) * 4;  // chunks of this block
  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(ws_smem));
  const uint32_t full0 = sbase, empty0 = sbase + 8 * S, stage0 = sbase + T::kHead;
  const uint32_t part0 = sbase + 16 * S;  // a block's (at most two) shared segments' partial sums are stored
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full0 + 8 * s, copies ? 1 + 96 : 1);  // the expect_tx arrival (then the copies' bytes), the copiers'
      mbar_init(empty0 + 8 * s, 8);   // one per compute warp
    }
    for (int p = 0; p < 2; ++p) mbar_init(part0 + 8 * p, 256);  // every compute thread
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp < 4) {  // ---- producer warpgroup: warp 0 copies the weights, warps 1-3 the activations (D)
                   //      or add shared segments' partial sums (the helpers, staged kernels)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;" ::: "memory");
    struct Cursor {  // chunk c of group g of column col, in the run's order (WsRun)
      int col, g, c, left, col1, g1;  // after `left` units the run goes on at group g1 of column col1
      __device__ void next(int kg) {
        if (++c == 4) {
          c = 0;
          if (--left == 0) col = col1, g = g1;
          else if (++g == kg) g = 0, ++col;
        }
      }
    };
    const Cursor start = run.mid < u_end ? Cursor{(int)(run.mid / kg), 0, 0, (int)(u_end - run.mid),
                                                  (int)(u_beg / kg), (int)(u_beg % kg)}
                                         : Cursor{(int)(u_beg / kg), (int)(u_beg % kg), 0, -1, 0, 0};
    if (warp != 0) {
      if constexpr (helpers) {
        // The shared segments' sums: once the compute warps have stored a segment's partial sums,
        // take the column's ticket; the column's last block adds its segments' sums and writes them.
        const int hid = threadIdx.x - 32;
        int p = 0;
        for (int piece = 0; piece < 2; ++piece)
          for (long long u = run.piece_beg(piece), pe = run.piece_end(piece); u < pe;) {
            const WgSegment seg(u, pe, kg, kTiles, 0, ntiles, ncols);
            const long long start = u;
            u += seg.g1 - seg.g0;
            if (seg.whole || !run.helped(piece, start, u)) continue;  // the compute warps' own
            mbar_wait(part0 + 8 * p, 0);  // (acquire: the compute threads' stores, released by their arrivals)
            ++p;
            const long long c0 = (long long)seg.gcol * kg;
            const int b0 = sk_owner(c0, units, blocks), nseg = sk_owner(c0 + kg - 1, units, blocks) - b0 + 1;
            if (hid == 0) help_last = ticket_acq_rel(&counters[seg.gcol]) == nseg - 1;
            asm volatile("bar.sync 2, 96;" ::: "memory");
            if (help_last) {
              sk_add_slots<BN, kWidth, 256, H, 2, 2>(hid, 96, seg.gcol, seg.col, b0, nseg, M, N, seg.z * BN, ldy,
                                                     __ldg(alpha_p), y, ws);
              if (hid == 0) counters[seg.gcol] = 0;
            }
            asm volatile("bar.sync 2, 96;" ::: "memory");  // help_last is read before the next ticket
          }
      }
      if constexpr (copies) {
        // Each chunk's activations from x into the stage in the MMA's input order. A lane takes
        // rows rb + 12 i of the chunk (three warps of four rows each: rb = 4 (warp - 1) + lane / 8) and
        // inputs 8 t .. 8 t + 7 of them (t = lane % 8): 16-byte cp.async into its own piece of a raw
        // slot (kRawSlots chunks in flight, no other thread reads it), then its four pairs (e = 0..3)
        // to pair q = t / 2 of half e % 2 of k16 step 2 (t % 2) + e / 2 of the stage (conflict-free:
        // steps lie 32 bytes apart modulo 128, rows 16). Rows past M are left as they are (they only
        // meet outputs past M); inputs past K are zeros.
        constexpr int kG = (BN / 4 + 2) / 3, R = T::kRawSlots;  // row groups per copier warp
        // the block's row tile (a copying launch of several row tiles gives every block a whole column)
        const int m0 = (int)(u_beg / kg / ncols) * BN;
        const int t = lane & 7, rows = min(BN, M - m0);
        const int rb = 4 * (warp - 1) + (lane >> 3);
        const uint32_t off = 2 * (t & 1) * T::kStep + (t >> 1) * 4;
        const uint32_t raw0 = stage0 + S * T::kStageBytes + rb * 128 + t * 16;
        const uint16_t* xl = x + (size_t)(m0 + rb) * ldx + 8 * t;
        auto fetch = [&](const Cursor& q, int slot) {
          const int k = (q.g * 4 + q.c) * 64;
          const bool ok = k + 8 * t < K;
          const uint16_t* src = ok ? xl + k : x;
          const uint32_t dst = raw0 + slot * BN * 128;
#pragma unroll
          for (int i = 0; i < kG; ++i, src += ok ? 12 * ldx : 0)
            if (rb + 12 * i < rows) cp_async16(dst + i * 12 * 128, src, ok);
          asm volatile("cp.async.commit_group;" ::: "memory");
        };
        asm volatile("griddepcontrol.wait;" ::: "memory");  // the activations are the previous kernel's output
        Cursor qf = start;
        for (int i = 0; i < R; ++i, qf.next(kg)) {
          if (i < total) fetch(qf, i);
          else asm volatile("cp.async.commit_group;" ::: "memory");
        }
        for (int i = 0, s = 0, use = 0; i < total; ++i) {
          asm volatile("cp.async.wait_group %0;" ::"n"(R - 1) : "memory");  // chunk i is in its slot
          if (i >= S) mbar_wait(empty0 + 8 * s, (use - 1) & 1);
          const uint32_t dst = stage0 + s * T::kStageBytes + off, src = raw0 + (i % R) * BN * 128;
#pragma unroll
          for (int g = 0; g < kG; ++g) {
            const int r = rb + 12 * g;
            if (r >= rows) continue;
            uint4 v;
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(src + g * 12 * 128));
            const uint32_t d = dst + (r >> 3) * kCoreSbo + (r & 7) * 16;
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(d), "r"(v.x) : "memory");
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(d + kCoreLbo), "r"(v.y) : "memory");
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(d + T::kStep), "r"(v.z) : "memory");
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(d + T::kStep + kCoreLbo), "r"(v.w) : "memory");
          }
          mbar_arrive(full0 + 8 * s);  // (the compute warps order these stores before their wgmma reads)
          if (i + R < total) fetch(qf, i % R);
          else asm volatile("cp.async.commit_group;" ::: "memory");
          qf.next(kg);
          if (++s == S) s = 0, ++use;
        }
      }
      return;
    }
    // the chunk's weights (kTiles tiles x 512 bytes) and, at a group's first chunk, its scales
    // (kTiles x 256 bytes): one box of a tensor map each (rows = weight tiles; tiles past the layer
    // read as zeros and count in the bytes like the others)
    auto issue_w = [&](const Cursor& q, int s) {
      if (lane != 0) return;
      const uint32_t bar = full0 + 8 * s, dst = stage0 + s * T::kStageBytes + T::kAct;
      mbar_expect_tx(bar, (copies ? 0 : T::kAct) + T::kW + (q.c == 0 ? kTiles * 256 : 0));
      const int col = q.col % ncols;  // (q.col: the gcol)
      tma_copy_2d(dst, &wmap, q.g * 576 + q.c * 128, col * kTiles, bar);
      if (q.c == 0) tma_copy_2d(dst + T::kW, &smap, q.g * 576 + 512, col * kTiles, bar);
    };
    // otherwise: the chunk's activations staged by stage_x_kernel (row tile z: kg * 4 chunks), one copy
    auto issue_x = [&](const Cursor& q, int s) {
      if (!copies && lane == 0)
        bulk_copy(stage0 + s * T::kStageBytes,
                  reinterpret_cast<const char*>(x) + ((size_t)(q.col / ncols) * kg * 4 + q.g * 4 + q.c) * T::kAct,
                  T::kAct, full0 + 8 * s);
    };
    const int pre = min(S, total);
    Cursor qw = start, qx = start;
    for (int i = 0; i < pre; ++i, qw.next(kg)) issue_w(qw, i);
    pdl_wait_then_release();  // the activations (staged or not) are the previous kernel's output
    for (int i = 0; i < pre; ++i, qx.next(kg)) issue_x(qx, i);
    for (int i = S, s = 0, use = 1; i < total; ++i, qw.next(kg)) {
      mbar_wait(empty0 + 8 * s, (use - 1) & 1);
      issue_w(qw, s);
      issue_x(qw, s);
      if (++s == S) s = 0, ++use;
    }
    return;
  }

  // ---- compute warpgroups
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;" ::: "memory");
  const int cw = warp - 4, ct = threadIdx.x - 128;
  const float alpha = __ldg(alpha_p);
  const uint64_t desc0 = ((stage0 >> 4) & 0x3FFF) | ((uint64_t)(kCoreLbo >> 4) << 16) |
                         ((uint64_t)(kCoreSbo >> 4) << 32);
  int s = 0, use = 0, sp = 0;  // stage of the current chunk, its use, the previous chunk's stage
  int p = 0;                   // shared segments so far
  for (int piece = 0; piece < 2; ++piece)
  for (long long u = run.piece_beg(piece), pe = run.piece_end(piece); u < pe;) {
    const WgSegment seg(u, pe, kg, kTiles, cw, ntiles, ncols);
    const int g0 = seg.g0, g1 = seg.g1, m0 = seg.z * BN;
    const bool active = seg.active;

    // half h of the warpgroup's rows: the warp's tile cw + 8 h (H = 2: columns of 16 tiles)
    const bool active1 = H > 1 && seg.active_half(1);
    float acc[H][BN / 2];
#pragma unroll
    for (int h = 0; h < H; ++h) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[h][i] = 0.f;
      fence_acc(acc[h]);
    }
    int2 sc[H];
    uint32_t a[2][H][4][4];
    bool first = true;
    for (int gi = g0; gi < g1; ++gi) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        mbar_wait(full0 + 8 * s, use & 1);
        // the copier warps' stores (generic proxy) before this warpgroup's wgmma reads (async proxy)
        if constexpr (copies) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        const uint32_t st = stage0 + s * T::kStageBytes;
        if (active) {
          int4 wv[H];
#pragma unroll
          for (int h = 0; h < H; ++h) {
            if (c == 0)
              asm volatile("ld.shared.v2.s32 {%0,%1}, [%2];"
                           : "=r"(sc[h].x), "=r"(sc[h].y)
                           : "r"(st + T::kAct + T::kW + (cw + 8 * h) * 256 + lane * 8));
            asm volatile("ld.shared.v4.s32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(wv[h].x), "=r"(wv[h].y), "=r"(wv[h].z), "=r"(wv[h].w)
                         : "r"(st + T::kAct + (cw + 8 * h) * 512 + lane * 16));
          }
          // the stage's descriptor once a chunk; the steps' offsets are constants (no dependent
          // 64-bit arithmetic before each wgmma)
          const uint64_t dstage = desc0 + (uint32_t)s * (uint32_t)(T::kStageBytes >> 4);
          if constexpr (BN <= 64 && H == 1) {  // one fence and one commit group a chunk (faster at <= 64 rows)
            uint32_t sg, sg8;
            chunk_scales(sc[0], c, sg, sg8);
#pragma unroll
            for (int j = 0; j < 4; ++j) a_fragment(word(wv[0], j), sg, sg8, a[c & 1][0][j]);
            wg_fence4(a[c & 1][0]);
#pragma unroll
            for (int j = 0; j < 4; ++j) wgmma_bf16<BN>(acc[0], a[c & 1][0][j], dstage + (j * T::kStep >> 4));
            wg_commit();
            wg_wait<1>();  // the previous chunk's steps are done: its stage and A registers are free
          } else {
#pragma unroll
            for (int h = 0; h < H; ++h) {
              if (h > 0 && !active1) break;
              uint32_t sg, sg8;
              chunk_scales(sc[h], c, sg, sg8);
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                uint32_t(&aj)[4] = a[c & 1][h][j];
                a_fragment(word(wv[h], j), sg, sg8, aj);
                wg_fence(aj);
                wgmma_bf16<BN>(acc[h], aj, dstage + (j * T::kStep >> 4));
                wg_commit();
              }
            }
            // the previous chunk's steps are done: its stage and A registers are free
            if (H == 1 || !active1) wg_wait<4>();
            else wg_wait<4 * H>();
          }
        }
        if (!first && lane == 0) mbar_arrive(empty0 + 8 * sp);
        first = false;
        sp = s;
        if (++s == S) s = 0, ++use;
      }
    }
    wg_wait<0>();
#pragma unroll
    for (int h = 0; h < H; ++h) fence_acc(acc[h]);
    if (lane == 0) mbar_arrive(empty0 + 8 * sp);

    if (helpers && !seg.whole && run.helped(piece, u, u + (g1 - g0))) {  // the helpers add them
      sk_store_partial<BN, kWidth, 256, H>(acc, seg, cw, ct, lane, b, M, ws);
      mbar_arrive(part0 + 8 * p++);
    } else if (mt > 1 && blocks * (long long)kg == units && ws_tile_stores(y, N, ldy)) {
      // several row tiles, every block one whole column, its only segment
      ws_store_tile<BN, kWidth, H>(acc, seg, cw, ct, lane, M, N, m0, ldy, alpha, y, ws_smem + T::kHead);
    } else {
      // 16 loads in flight where the block copies its activations (7B q/k/v and o at 64 rows: 5-7% less
      // time than 4); 4 in the staged kernels, whose whole-column launches ran 3-5% slower built with 16
      constexpr int kLoads = H == 1 && D ? 16 : 4;
      wg_segment_out_h<BN, kWidth, 256, true, H, kLoads>(acc, seg, cw, ct, lane, b, blocks, units, kg, M, N, m0, ldy,
                                                         alpha, y, ws, counters, is_last);
    }
    u += g1 - g0;
  }
}

// 16-byte piece i of the activations in the MMA's input order, per_row pieces a row: piece pc of
// row r is half h of k16 step j of chunk ch (pc = 8 ch + 2 j + h), i.e. inputs 16 q + 4 j + 2 h
// and the next one of the chunk for q = 0..3; load() reads them from x (zeros past M and K).
struct XPiece {
  int r, pc, ch, j, h;
  __device__ XPiece(long long i, int per_row)
      : r((int)(i / per_row)), pc((int)(i % per_row)), ch(pc >> 3), j((pc & 7) >> 1), h(pc & 1) {}
  __device__ uint4 load(const uint16_t* __restrict__ x, int M, int K, int ldx) const {
    uint32_t v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int k = ch * 64 + 16 * q + 4 * j + 2 * h;
      v[q] = r < M && k < K ? __ldg(reinterpret_cast<const uint32_t*>(x + (size_t)r * ldx + k)) : 0u;
    }
    return make_uint4(v[0], v[1], v[2], v[3]);
  }
};

// The warp-specialized kernel's activations: x [M, K] -> xs, for each row tile of BN rows and each
// chunk of 64 inputs, the image of one ring stage (WsTile<BN>::kAct bytes; the k16 steps' core
// matrices in the MMA's input order, zeros past M and K; the paddings are never read). One thread
// per 16-byte core-matrix row.
template <int BN>
__global__ void __launch_bounds__(256) stage_x_kernel(const uint16_t* __restrict__ x, char* __restrict__ xs,
                                                      int M, int K, int ldx, int rows, int chunks) {
  using T = WsTile<BN>;
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  pdl_wait_then_release();
  if (i >= (long long)rows * chunks * 8) return;
  const XPiece p(i, chunks * 8);
  const int n = p.r % BN;
  char* dst = xs + ((size_t)(p.r / BN) * chunks + p.ch) * T::kAct + p.j * T::kStep + p.h * kCoreLbo +
              (n >> 3) * kCoreSbo + (n & 7) * 16;
  *reinterpret_cast<uint4*>(dst) = p.load(x, M, K, ldx);
}

// The wgmma kernel's permuted activations: x [M, K] (row stride ldx) -> xp [rows, kpad] with each
// k16 step's two halves as 8 contiguous inputs (inputs 16 (e / 2) + 4 j + 2 h + e % 2 of a chunk
// at 16 j + 8 h + e), zeros past M and K. One thread per 16-byte piece of xp.
__global__ void __launch_bounds__(256) permute_x_kernel(const uint16_t* __restrict__ x, uint16_t* __restrict__ xp,
                                                         int M, int K, int ldx, int rows, int kpad) {
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  const int per_row = kpad / 8;
  pdl_wait_then_release();
  if (i >= (long long)rows * per_row) return;
  const XPiece p(i, per_row);
  *reinterpret_cast<uint4*>(xp + (size_t)p.r * kpad + p.pc * 8) = p.load(x, M, K, ldx);
}

// Weights back to bf16 [N, K] (times 2^-7, exact) for the cuBLAS path and the backward pass.
// One thread per lane of a record (four 16-byte loads in flight); each chunk's 16 rows x 128
// bytes go through shared memory so every store instruction writes whole 128-byte rows.
__global__ void __launch_bounds__(256)
    dequant_kernel(const int4* __restrict__ wq, uint16_t* __restrict__ w, int N, int K, int ntiles,
                   int kg) {
  constexpr int kRow = 144;  // padded smem row (bytes): conflict-free 16-byte writes and reads
  __shared__ __align__(16) char tile[kWarps][16 * kRow];
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const size_t grp = idx >> 5;
  const int gi = grp % kg, nt = grp / kg;
  // whole warps leave together
  const bool work = grp < (size_t)ntiles * kg && nt * 16 < N && gi * 256 < K;
  const int4* base = wq + (work ? grp : 0) * 144;
  int4 q[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) q[c] = ld_stream(base + c * 32 + lane);
  int2 sv;
  asm volatile("ld.global.nc.L1::no_allocate.v2.s32 {%0,%1}, [%2];"
               : "=r"(sv.x), "=r"(sv.y)
               : "l"(reinterpret_cast<const int2*>(base + 128) + lane));
  pdl_wait_then_release();  // before writing w (its memory may be what the previous kernel reads)
  if (!work) return;
  char* sm = tile[threadIdx.x >> 5];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int k0 = gi * 256 + c * 64;
    if (k0 >= K) break;
    uint32_t sg, sg8;
    chunk_scales(sv, c, sg, sg8);
    uint32_t row0[8], row1[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t a[4];
      a_fragment(word(q[c], j), sg, sg8, a);
      row0[2 * j] = a[0];
      row0[2 * j + 1] = a[2];
      row1[2 * j] = a[1];
      row1[2 * j + 1] = a[3];
    }
    int4* s0 = reinterpret_cast<int4*>(sm + g * kRow + 32 * t);
    int4* s1 = reinterpret_cast<int4*>(sm + (g + 8) * kRow + 32 * t);
    s0[0] = make_int4(row0[0], row0[1], row0[2], row0[3]);
    s0[1] = make_int4(row0[4], row0[5], row0[6], row0[7]);
    s1[0] = make_int4(row1[0], row1[1], row1[2], row1[3]);
    s1[1] = make_int4(row1[4], row1[5], row1[6], row1[7]);
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int piece = lane + 32 * i, r = piece >> 3, col = (piece & 7) * 8;  // col in inputs
      const int row = nt * 16 + r, k = k0 + col;
      if (row < N && k < K)
        *reinterpret_cast<int4*>(w + (size_t)row * K + k) =
            *reinterpret_cast<const int4*>(sm + r * kRow + (piece & 7) * 16);
    }
    __syncwarp();
  }
}

struct Variant {
  void* fn;
  int smem;
};

// fn<<<grid, block, smem, stream>>>(args) with PDL if enabled.
cudaError_t launch(const void* fn, dim3 grid, dim3 block, int smem, void* stream, void** args) {
  return qerl::launch_pdl(fn, grid, block, (size_t)smem, stream, args);
}

// epi: 0 plain, 1 bias / LoRA epilogue, 2 that and the residual and norm modes (MT <= 2 only; a
// variant of its own, so that the registers of the others stay as they were).
template <int MT, int TNW>
Variant variant(int epi) {
  constexpr bool kSmem = MT >= 4;
  constexpr int kRing = TNW >= 2 ? 2 : 4;
  constexpr int kBytes = kSmem ? 2 * MT * 8 * kXRowBytes : 0;
  if (epi == 2) {
    if constexpr (MT <= 2) return {reinterpret_cast<void*>(&gemm_small_kernel<MT, TNW, kRing, kSmem, 2>), kBytes};
    return {nullptr, 0};
  }
  return {epi ? reinterpret_cast<void*>(&gemm_small_kernel<MT, TNW, kRing, kSmem, 1>)
              : reinterpret_cast<void*>(&gemm_small_kernel<MT, TNW, kRing, kSmem, 0>),
          kBytes};
}

Variant pick(int mt, int tnw, int epi = 0) {
#define QERL_CASE(A, B) \
  if (mt == A && tnw == B) return variant<A, B>(epi);
  QERL_CASE(1, 1) QERL_CASE(1, 2) QERL_CASE(1, 4)
  QERL_CASE(2, 1) QERL_CASE(2, 2) QERL_CASE(2, 4)
  QERL_CASE(4, 1) QERL_CASE(4, 2) QERL_CASE(4, 4)
  QERL_CASE(8, 1) QERL_CASE(8, 2)
  QERL_CASE(16, 1)
#undef QERL_CASE
  return {nullptr, 0};
}

template <int BN, int WG>
Variant wg_variant() {
  return {reinterpret_cast<void*>(&gemm_wg_kernel<BN, WG>), WgTile<BN>::kSmem};
}

template <int BN, int H, bool D = false>
Variant ws_variant() {
  return {reinterpret_cast<void*>(&gemm_ws_kernel<BN, H, D>), WsTile<BN, H, D>::kSmem};
}

// wg 1 or 2: gemm_wg_kernel; wg 3: gemm_ws_kernel (two compute warpgroups and a producer), wg 4:
// the same with two weight tiles per compute warp (columns of 256 weight rows).
Variant pick_wg(int bn, int wg, bool direct = false) {
  if (wg == 3) {
    if (bn == 32) return direct ? ws_variant<32, 1, true>() : ws_variant<32, 1>();
    if (bn == 64) return direct ? ws_variant<64, 1, true>() : ws_variant<64, 1>();
    if (direct) return {nullptr, 0};
    if (bn == 128) return ws_variant<128, 1>();
    if (bn == 256) return ws_variant<256, 1>();
    return {nullptr, 0};
  }
  if (wg == 4) {
    if (bn == 32) return ws_variant<32, 2>();
    if (bn == 64) return ws_variant<64, 2>();
    return {nullptr, 0};
  }
#define QERL_CASE(A, B) \
  if (bn == A && wg == B) return wg_variant<A, B>();
  QERL_CASE(16, 1) QERL_CASE(32, 1) QERL_CASE(64, 1) QERL_CASE(96, 1) QERL_CASE(128, 1)
  QERL_CASE(16, 2) QERL_CASE(32, 2) QERL_CASE(64, 2) QERL_CASE(96, 2) QERL_CASE(128, 2)
  QERL_CASE(192, 2) QERL_CASE(256, 2)
#undef QERL_CASE
  return {nullptr, 0};
}

// The weight records as a 2-D tensor of 32-bit words for the warp-specialized kernel's copies:
// one row per 16-row weight tile (its kg records of 576 words), boxes of `tiles` tiles x `words` words.
cudaError_t weight_map(CUtensorMap* map, const void* wq, int ntiles, int kg, int words, int tiles) {
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<Encode>(fn) : nullptr;
  }();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {(cuuint64_t)kg * 576, (cuuint64_t)ntiles};
  const cuuint64_t strides[1] = {(cuuint64_t)kg * 2304};
  const cuuint32_t box[2] = {(cuuint32_t)words, (cuuint32_t)tiles}, steps[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 2, const_cast<void*>(wq), dims, strides, box, steps,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Rings over 48 KB of shared memory need the kernel's limit raised, once per kernel and device.
cudaError_t allow_smem(const Variant& v) {
  if (v.smem <= 48 * 1024) return cudaSuccess;
  constexpr int kMaxDevices = 64, kMaxKernels = 16;
  static void* done[kMaxDevices][kMaxKernels] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  for (int i = 0; dev < kMaxDevices && i < kMaxKernels && done[dev][i] != nullptr; ++i)
    if (done[dev][i] == v.fn) return cudaSuccess;
  err = cudaFuncSetAttribute(v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem);
  if (err != cudaSuccess) cudaGetLastError();  // not the next launch's error
  if (err == cudaSuccess && dev < kMaxDevices)
    for (int i = 0; i < kMaxKernels; ++i)
      if (done[dev][i] == nullptr) {
        done[dev][i] = v.fn;
        break;
      }
  return err;
}

}  // namespace

extern "C" {

#define QERL_EPILOGUE_ARGS                                                                         \
  const void *bias, const void *ls, const void *lb, int lr, int lds, int ldb, int n1, int n2, void *hw, \
      const void *w, const void *xn, const void *a, void *s_out, void *r_out, void *sync, int ntasks, float eps
#define QERL_EPILOGUE                                                                                 \
  Epilogue {                                                                                          \
    (const uint16_t*)bias, (const float*)ls, (const float*)lb, lr, lds, ldb, n1, n2, (uint16_t*)hw,   \
        (const float*)w, (const uint16_t*)xn, (const float*)a, (float*)s_out, (float*)r_out, (int*)sync, \
        ntasks, eps                                                                                   \
  }

// Returns a cudaError_t (0 = launched). mt: 8-row activation tiles (1, 2, 4, 8, 16);
// tnw: 16-row weight tiles per warp (1, 2, 4); wpt: warps per weight tile slot, splitting its K
// range inside the block (1, 2, 4, 8; above 1 only for mt <= 2); splits: K split across blocks;
// gps: groups (256 inputs) per K slice (splits * wpt slices);
// pf: L2 prefetch distance in groups (0: none). Epilogue (bias, LoRA shrink s (M, lds), B^T
// (lr, ldb), member edges n1, n2): null pointers for none. Residual mode (hw, w; y is the
// residual stream) and norm mode (xn, a, s_out, r_out, sync, ntasks > 0, eps; up to 16 rows;
// xn null: shrink only): see Epilogue; null / 0 for neither.
int qerl_nvfp4_gemm_small(int mt, int tnw, int wpt, const void* wq, const void* x, void* y, void* ws,
                          void* counters, const void* alpha, int M, int N, int K, int ldx, int ldy,
                          int ntiles, int kg, int splits, int gps, int pf, QERL_EPILOGUE_ARGS,
                          void* stream) {
  const Epilogue ep = QERL_EPILOGUE;
  const Variant v = pick(mt, tnw, hw != nullptr || ntasks > 0 ? 2 : (bias != nullptr || ls != nullptr ? 1 : 0));
  if (v.fn == nullptr || (wpt != 1 && wpt != 2 && wpt != 4 && wpt != 8) || (wpt > 1 && mt > 2))
    return (int)cudaErrorInvalidValue;
  if ((hw != nullptr && (w == nullptr || ldy != N)) ||
      (ntasks > 0 && (mt > 2 || (xn == nullptr && a == nullptr) || r_out == nullptr || sync == nullptr ||
                      K % 16 || (a != nullptr && s_out == nullptr))))
    return (int)cudaErrorInvalidValue;
  const int per_block = kWarps / wpt * tnw;  // weight tiles per block
  const int smem = wpt > 1 ? kWarps * tnw * mt * 4 * 32 * (int)sizeof(float) : v.smem;
  const int cols = (ntiles + per_block - 1) / per_block;
  // norm mode: the tasks' blocks, then the GEMM's
  const dim3 grid = ntasks > 0 ? dim3(cols * splits + ntasks) : dim3(cols, splits);
  const void* epp = &ep;
  void* args[] = {&wq, &x, &y, &ws, &counters, &alpha, &M, &N, &K,
                  &ldx, &ldy, &ntiles, &kg, &splits, &gps, &pf, &wpt, const_cast<void*>(epp)};
  return (int)launch(v.fn, grid, dim3(kWarps * 32), smem, stream, args);
}

// Medium M: the wgmma kernel. bn: activation rows per block (16, 32, 64, 96, 128; 192 and 256
// with wg = 2); wg: warpgroups per block (64 weight rows each), or 3 for the warp-specialized
// kernel (32, 64, 128, 256 rows; two compute warpgroups, columns as wg = 2), or 4 for that kernel
// with columns of 256 weight rows (32, 64 rows); blocks: the grid along x, from
// one block per column block (ncols, whole columns) to ncols * kg (one group each); other than
// ncols it shares columns between blocks (stream K), which needs the workspace, (blocks + ncols)
// slots of bn x 64 wg floats (128 for wg = 3, 256 for wg = 4), and a single row tile. Rows past bn
// go to further blocks along z; with wg = 3 and 4 the row tiles' columns are laid end to end
// instead (ncols x row tiles of them): ncols blocks then mean whole columns (one block each), any
// other count stream K across them, with (blocks + ncols x row tiles) slots of min(M, bn) x 128
// floats and as many counters.
// From kPermutedRows rows per block xp (bf16, mtiles * bn rows of kg * 256) takes the permuted
// activations, written by a kernel of its own launched first; with wg = 3 and 4 always as stage
// images (mtiles x 4 kg x qerl_nvfp4_ws_stage_bytes(bn) bytes), unless `direct` (wg = 3 below
// kPermutedRows rows per block): then the kernel's producer warps copy them from x themselves.
int qerl_nvfp4_gemm_wg(int bn, int wg, const void* wq, const void* x, void* y, void* ws, void* xp,
                       void* counters, const void* alpha, int M, int N, int K, int ldx, int ldy,
                       int ntiles, int kg, int blocks, int pf, void* stream, int direct) {
  const Variant v = pick_wg(bn, wg, direct != 0);
  const int mtiles = (M + bn - 1) / bn;
  const bool ws_kernel = wg >= 3;  // gemm_ws_kernel
  const int per_col = wg == 4 ? 16 : 4 * (wg == 3 ? 2 : wg);  // weight tiles per column block
  int ncols = (ntiles + per_col - 1) / per_col;
  // gemm_ws_kernel lays the row tiles' columns end to end: stream K may run across row tiles
  const long long units = (long long)ncols * kg * (ws_kernel ? mtiles : 1);
  if (v.fn == nullptr || blocks < 1 || blocks > units || (blocks != ncols && (ws == nullptr ||
      (mtiles > 1 && !ws_kernel))) || (direct && (wg != 3 || bn >= kPermutedRows || (mtiles > 1 && blocks != ncols))) ||
      ((bn >= kPermutedRows || (ws_kernel && !direct)) && xp == nullptr))
    return (int)cudaErrorInvalidValue;
  cudaError_t err = allow_smem(v);
  if (err != cudaSuccess) return (int)err;
  if (ws_kernel && !direct) {  // the activations as images of the ring's stages first
    int rows = mtiles * bn, chunks = kg * 4;
    const long long pieces = (long long)rows * chunks * 8;
    void* pargs[] = {const_cast<void**>(&x), &xp, &M, &K, &ldx, &rows, &chunks};
    const void* fn = bn == 32 ? reinterpret_cast<const void*>(&stage_x_kernel<32>)
                     : bn == 64 ? reinterpret_cast<const void*>(&stage_x_kernel<64>)
                     : bn == 128 ? reinterpret_cast<const void*>(&stage_x_kernel<128>)
                                 : reinterpret_cast<const void*>(&stage_x_kernel<256>);
    err = launch(fn, dim3((unsigned)((pieces + 255) / 256)), dim3(256), 0, stream, pargs);
    if (err != cudaSuccess) return (int)err;
    x = xp;
  } else if (!ws_kernel && bn >= kPermutedRows) {  // the activations in the MMA's input order first
    int rows = mtiles * bn, kpad = kg * 256;
    const long long pieces = (long long)rows * kpad / 8;
    void* pargs[] = {const_cast<void**>(&x), &xp, &M, &K, &ldx, &rows, &kpad};
    err = launch(reinterpret_cast<void*>(&permute_x_kernel), dim3((unsigned)((pieces + 255) / 256)), dim3(256), 0,
                 stream, pargs);
    if (err != cudaSuccess) return (int)err;
    x = xp;
    ldx = kpad;
  }
  dim3 grid(blocks, 1, mtiles);
  if (ws_kernel) grid = dim3(blocks == ncols ? ncols * mtiles : blocks);  // whole columns, or stream K
  CUtensorMap wmap, smap;  // wg = 3, 4: the weights' and the scales' boxes
  if (ws_kernel) {
    if ((err = weight_map(&wmap, wq, ntiles, kg, 128, per_col)) != cudaSuccess ||
        (err = weight_map(&smap, wq, ntiles, kg, 64, per_col)) != cudaSuccess)
      return (int)err;
  }
  void* args[] = {&wq, &x, &y, &ws, &counters, &alpha, &M, &N, &K,
                  &ldx, &ldy, &ntiles, &kg, &ncols, &pf, &wmap, &smap};
  return (int)launch(v.fn, grid, dim3(ws_kernel ? 384 : wg * 128), v.smem, stream, args);
}

int qerl_nvfp4_occupancy_wg(int bn, int wg) {
  const Variant v = pick_wg(bn, wg);
  if (v.fn == nullptr || allow_smem(v) != cudaSuccess) return 0;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, v.fn, wg >= 3 ? 384 : wg * 128, v.smem) != cudaSuccess)
    return 0;
  return blocks;
}

// Resident blocks per SM of one variant (0 if the variant does not exist).
int qerl_nvfp4_occupancy(int mt, int tnw) {
  const Variant v = pick(mt, tnw);
  if (v.fn == nullptr) return 0;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, v.fn, kWarps * 32, v.smem) !=
      cudaSuccess)
    return 0;
  return blocks;
}

int qerl_nvfp4_dequant(const void* wq, void* w, int N, int K, int ntiles, int kg, void* stream) {
  const size_t threads = (size_t)ntiles * kg * 32;
  const unsigned blocks = (unsigned)((threads + 255) / 256);
  const int4* wq4 = static_cast<const int4*>(wq);
  uint16_t* w16 = static_cast<uint16_t*>(w);
  void* args[] = {&wq4, &w16, &N, &K, &ntiles, &kg};
  return (int)launch(reinterpret_cast<const void*>(&dequant_kernel), dim3(blocks), dim3(256), 0, stream, args);
}

// Rows per block from which the wgmma kernel reads the permuted activations (xp must be given).
int qerl_nvfp4_wg_permuted_rows() { return kPermutedRows; }

// Bytes of one chunk's staged activations in the warp-specialized kernel (xp holds row tiles x
// chunks of them), 0 for a row count it does not take.
int qerl_nvfp4_ws_stage_bytes(int bn) {
  return bn == 32 ? WsTile<32>::kAct : bn == 64 ? WsTile<64>::kAct : bn == 128 ? WsTile<128>::kAct
         : bn == 256 ? WsTile<256>::kAct : 0;
}

const char* qerl_nvfp4_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

}  // extern "C"

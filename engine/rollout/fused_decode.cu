// Fused element-wise steps of one decode token (bf16 activations), for engine/rollout/fused_ops.py.
//
// Each kernel repeats the eager decoder's operations with the same bf16 roundings, in the same
// order: a projection's output gets its bias added in bf16, then its LoRA delta in fp32 and is
// rounded once more (the delta's expand is done here: s (rows, G*r) from lora_shrink_kernel times
// the output column's row of B, r multiply-adds per element); the residual add is a bf16 add; RMSNorm computes in fp32 and rounds once;
// RoPE is three bf16 ops (x*cos, rotate_half(x)*sin, their sum). Only reduction orders differ.
// Plain C entry points (no torch headers), launched on the caller's stream.
//
// Every kernel is launched with programmatic dependent launch (../kernels/pdl.cuh: its rules).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../kernels/pdl.cuh"

namespace cg = cooperative_groups;
typedef __nv_bfloat16 bf16;
using qerl::pdl_wait_then_release;

__device__ __forceinline__ float rb(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float ld(const bf16* p) { return __bfloat162float(*p); }

// The LoRA term of a fused projection of up to three members (columns [0, n1), [n1, n2), [n2, N)):
// delta[row, col] = s[row, m*r : (m+1)*r] . b[:, col], m the column's member; s = 0: no LoRA.
struct Lora {
  const float* s;  // (rows, ld_s) fp32: the shrink x @ A^T, member m in columns m*r .. m*r+r-1
  const float* b;  // (r, ld_b) fp32: B^T with the scaling folded in (zero columns: no adapter there)
  int r, ld_s, ld_b, n1, n2;
};

// Projection output after its bias and LoRA epilogue, as a bf16 value in fp32.
__device__ __forceinline__ float proj(const bf16* y, const bf16* bias, const Lora& L, long long row, int col,
                                      int ld_y) {
  float v = ld(y + row * ld_y + col);
  if (bias) v = rb(v + ld(bias + col));
  if (L.s) {
    const int m = (col >= L.n1) + (col >= L.n2);
    const float* sp = L.s + row * L.ld_s + m * L.r;
    const float* bp = L.b + col;  // column col of B^T: consecutive threads read consecutive words
    float d = 0.f;
#pragma unroll 16
    for (int t = 0; t < L.r; ++t) d = fmaf(sp[t], bp[(long long)t * L.ld_b], d);  // r = 16: one round of loads
    v = rb(v + d);
  }
  return v;
}

// The residual stream after adding a projection output: x (+ proj(y, bias, L) in bf16 when y).
__device__ __forceinline__ float residual(const bf16* x, const bf16* y, const bf16* bias, const Lora& L,
                                          long long row, int col, int hdim) {
  const float v = ld(x + row * hdim + col);
  return y ? rb(v + proj(y, bias, L, row, col, hdim)) : v;
}

// bf16(bf16(silu(g)) * u), as the eager decoder rounds it.
__device__ __forceinline__ float silu_times(float g, float u) { return rb(rb(g / (1.0f + expf(-g))) * u); }

// grid (ceil(n / 256), rows), block 256: out = proj(y, bias, L) (bias and LoRA epilogue of a
// projection whose consumer runs one block per row, so that the expand uses the whole GPU).
__global__ void lora_expand_kernel(const bf16* __restrict__ y, const bf16* __restrict__ bias, const Lora L,
                                   bf16* __restrict__ out, int n, int ld_y) {
  pdl_wait_then_release();
  const long long row = blockIdx.y;
  const int col = blockIdx.x * 256 + threadIdx.x;
  if (col >= n) return;
  out[row * n + col] = __float2bfloat16_rn(proj(y, bias, L, row, col, ld_y));
}

// The LoRA shrink s[row, j] = sum_k x[row, k] * a[j, k] (fp32) of up to 8 rows, in blocks of
// grid (rtot, kb = ceil(k / 4096), ceil(rows / 8)) and 1024 threads: each thread multiplies 4
// inputs of a by those of each row; the block adds its threads' products in a fixed order
// (warps, then across warps). With kb > 1 each block writes its sums to ws (kb, rows, rtot) and
// takes a ticket; the last block of an output adds the kb sums in block order, writes s and
// resets the ticket (left zero for the next call). One launch, no zeroed output, the same result
// on every run. A is read before the PDL wait (no kernel of a decode step writes it).
// Launched in clusters of the kb blocks of an output (2 <= kb <= kMaxShrinkCluster; the default,
// QERL_SHRINK_CLUSTER=0 turns it off), the blocks instead store their sums into the first block's shared memory
// (distributed shared memory) and meet at one cluster barrier; the first block adds them as the
// ticket's last block does (lane p takes block p, then the same shuffle tree): the same bits, no
// workspace round trip through L2, no atomic.
// Three kernels share it: the plain shrink, and two that first compute the inputs x themselves
// (residual add + RMSNorm, SiLU * up), writing them out from the blocks of j = 0, so that the
// shrink of the next projection costs no launch of its own; those two take one row per block and
// RB rank rows of a (grid (ceil(rtot / RB), kb, rows)), so that a batch of rows costs no more
// latency than one.
constexpr int kShrinkThreads = 1024, kShrinkWarps = kShrinkThreads / 32;
constexpr int kShrinkInputs = 4 * kShrinkThreads;  // inputs per block
constexpr int kMaxShrinkCluster = 8;                // K blocks merged in a cluster (the portable limit)

// Called first by every thread of a shrink kernel: in a cluster launch, its arrival for the
// barrier that shrink_finish waits on before its first store into another block's shared memory
// (so that every block of the cluster has started).
__device__ __forceinline__ void shrink_cluster_start() {
  if (cg::this_cluster().num_blocks() > 1) __cluster_barrier_arrive_relaxed();
}

struct Shrink {
  const float* a;  // (rtot, k) fp32
  float* s;        // (rows, rtot) fp32
  float* ws;       // (kb, rows, rtot) fp32 when kb > 1
  int* tickets;    // (grid z, rtot) int, zero
  int rtot;
};

// This thread's 4 inputs of row j of a (zeros past k and for j >= rtot).
__device__ __forceinline__ float4 shrink_a(const Shrink& S, int k, int j) {
  const int i = blockIdx.y * kShrinkInputs + threadIdx.x * 4;
  if (i >= k || j >= S.rtot) return make_float4(0.f, 0.f, 0.f, 0.f);
  return *reinterpret_cast<const float4*>(S.a + (long long)j * k + i);
}

__device__ __forceinline__ float shrink_dot(const float4& av, float x0, float x1, float x2, float x3) {
  return fmaf(av.x, x0, fmaf(av.y, x1, fmaf(av.z, x2, av.w * x3)));
}

// Adds the threads' products acc[q] (q < nr) of this block and writes s (see above): in the rows
// mode acc[q] is row r0 + q of rank row j = blockIdx.x, in the ranks mode (RANKS) rank row
// blockIdx.x * NR + q of row r0. The block's ticket is (blockIdx.z, its first rank row).
template <int NR, bool RANKS = false>
__device__ __forceinline__ void shrink_finish(const Shrink& S, const float (&acc)[NR], int rows, int r0, int nr) {
  const int kbi = blockIdx.y, kb = gridDim.y, rtot = S.rtot;
  const int j0 = RANKS ? blockIdx.x * NR : blockIdx.x;
  // offset of acc[q]'s output in s (rows, rtot), and in each K block's slice of ws
  auto at = [&](int q) { return RANKS ? (long long)r0 * rtot + j0 + q : (long long)(r0 + q) * rtot + j0; };
  __shared__ float part[NR][kShrinkWarps];
  __shared__ int is_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int q = 0; q < NR; ++q) {
    float v = acc[q];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) part[q][warp] = v;
  }
  __syncthreads();
  cg::cluster_group cluster = cg::this_cluster();
  const bool merge_in_cluster = cluster.num_blocks() > 1;  // then a cluster of the kb blocks (grid y)
  __shared__ float gathered[NR][kMaxShrinkCluster];       // the first block's: block b's sums at [q][b]
  if (merge_in_cluster) __cluster_barrier_wait();         // every block of the cluster has started
  float* out = kb == 1 ? S.s : S.ws + (long long)kbi * rows * rtot;  // this block's sums
  if (warp < nr) {  // warp q adds output q's warp sums
    float v = part[warp][lane];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) {
      if (merge_in_cluster)
        cluster.map_shared_rank(&gathered[0][0], 0)[warp * kMaxShrinkCluster + kbi] = v;
      else
        out[at(warp)] = v;
    }
  }
  if (merge_in_cluster) {
    cluster.sync();  // the stores above are visible to the first block
    if (kbi == 0 && warp < nr) {  // as the ticket's last block below, for kb <= 32
      float v = 0.f;
      if (lane < kb) v += gathered[warp][lane];
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) S.s[at(warp)] = v;
    }
    return;
  }
  if (kb == 1) return;
  __threadfence();
  __syncthreads();
  int* ticket = S.tickets + blockIdx.z * rtot + j0;
  if (threadIdx.x == 0) is_last = atomicAdd(ticket, 1) == kb - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if (warp < nr) {  // lane p adds blocks p, p + 32, ...; then the warp adds its lanes
    float v = 0.f;
    for (int b = lane; b < kb; b += 32) v += __ldcg(S.ws + (long long)b * rows * rtot + at(warp));
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) S.s[at(warp)] = v;
  }
  if (threadIdx.x == 0) *ticket = 0;
}

__device__ __forceinline__ void bf16x4(const bf16* p, float& a, float& b, float& c, float& d) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  a = lo.x, b = lo.y, c = hi.x, d = hi.y;
}

__global__ void __launch_bounds__(kShrinkThreads)
    lora_shrink_kernel(const bf16* __restrict__ x, int ldx, const Shrink S, int rows, int k) {
  const int r0 = blockIdx.z * 8, nr = min(8, rows - r0);
  const int i = blockIdx.y * kShrinkInputs + threadIdx.x * 4;
  shrink_cluster_start();
  const float4 av = shrink_a(S, k, blockIdx.x);
  pdl_wait_then_release();
  float acc[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    acc[q] = 0.f;
    if (q < nr && i < k) {  // k is a multiple of 4, rows of x and a are 8-byte aligned
      float x0, x1, x2, x3;
      bf16x4(x + (long long)(r0 + q) * ldx + i, x0, x1, x2, x3);
      acc[q] = shrink_dot(av, x0, x1, x2, x3);
    }
  }
  shrink_finish(S, acc, rows, r0, nr);
}

// grid (rows, heads + 2 * kv_heads), block head_dim. q heads -> q_out (rows, heads, D) roped;
// k heads roped and v heads as they are -> the caches. Row r is token r % seq of cache row r / seq
// and goes to column *slot + r % seq (decode: seq = 1, one token per cache row; prefill: seq
// tokens per sequence).
__global__ void qkv_rope_cache_kernel(const bf16* __restrict__ y, const bf16* __restrict__ bias, const Lora L,
                                      const bf16* __restrict__ cos_t,
                                      const bf16* __restrict__ sin_t, bf16* __restrict__ q_out, bf16* kc, bf16* vc,
                                      const int64_t* __restrict__ slot, int heads, int kv_heads, int d,
                                      long long cache_row, long long cache_head, int ld_y, int seq) {
  pdl_wait_then_release();
  const long long row = blockIdx.x;
  const int h = blockIdx.y;
  const int t = threadIdx.x;
  if (t >= d) return;
  const long long crow = row / seq, s = *slot + row % seq;
  const float x = proj(y, bias, L, row, h * d + t, ld_y);
  if (h >= heads + kv_heads) {
    vc[crow * cache_row + (long long)(h - heads - kv_heads) * cache_head + s * d + t] = __float2bfloat16_rn(x);
    return;
  }
  const int half = d / 2;
  const float p = proj(y, bias, L, row, h * d + (t < half ? t + half : t - half), ld_y);
  const float rot = t < half ? -p : p;
  const float c = ld(cos_t + row * d + t), sn = ld(sin_t + row * d + t);
  const bf16 o = __float2bfloat16_rn(rb(x * c) + rb(rot * sn));
  if (h < heads) {
    q_out[(row * heads + h) * d + t] = o;
  } else {
    kc[crow * cache_row + (long long)(h - heads) * cache_head + s * d + t] = o;
  }
}

template <int THREADS>
__device__ float block_sum(float v) {
  __shared__ float part[THREADS / 32];
  __shared__ float total;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float w = threadIdx.x < THREADS / 32 ? part[threadIdx.x] : 0.f;
    for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
    if (threadIdx.x == 0) total = w;
  }
  __syncthreads();
  return total;
}

// Inputs of one row per thread of a THREADS-thread block: i = threadIdx.x + c * THREADS, c < kRowSlots
// (hidden sizes up to 8 * 1024), held in registers so that a row's loads go out in one round.
constexpr int kRowSlots = 8;

// This thread's slots of row `row` after the residual add (0 past the row's end).
template <int THREADS>
__device__ __forceinline__ void load_row(float (&v)[kRowSlots], const bf16* x, const bf16* y, const bf16* bias,
                                         const Lora& L, long long row, int hdim) {
#pragma unroll
  for (int c = 0; c < kRowSlots; ++c) {
    const int i = threadIdx.x + c * THREADS;
    v[c] = i < hdim ? residual(x, y, bias, L, row, i, hdim) : 0.f;
  }
}

// grid (rows), block THREADS. x (rows, H) += projection output (if y), then
// out = bf16(x * rsqrt(mean(x^2) + eps) * w). The norm weight (constant during a step) is read
// before the PDL wait.
template <int THREADS>
__global__ void __launch_bounds__(THREADS)
    add_rmsnorm_kernel(bf16* x, const bf16* __restrict__ y, const bf16* __restrict__ bias, const Lora L,
                       const float* __restrict__ w, float eps, bf16* __restrict__ out, int hdim) {
  const long long row = blockIdx.x;
  float v[kRowSlots], wv[kRowSlots];
#pragma unroll
  for (int c = 0; c < kRowSlots; ++c) {
    const int i = threadIdx.x + c * THREADS;
    wv[c] = i < hdim ? w[i] : 0.f;
  }
  pdl_wait_then_release();
  load_row<THREADS>(v, x, y, bias, L, row, hdim);
  bf16* xr = x + row * hdim;
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < kRowSlots; ++c) {
    const int i = threadIdx.x + c * THREADS;
    if (i < hdim) {
      if (y) xr[i] = __float2bfloat16_rn(v[c]);
      ss += v[c] * v[c];
    }
  }
  const float r = rsqrtf(block_sum<THREADS>(ss) / (float)hdim + eps);
#pragma unroll
  for (int c = 0; c < kRowSlots; ++c) {
    const int i = threadIdx.x + c * THREADS;
    if (i < hdim) out[row * hdim + i] = __float2bfloat16_rn(rb((v[c] * r) * wv[c]));
  }
}

// This block's RB rank rows of a (ranks blockIdx.x * RB ..), its thread's 4 inputs of each.
template <int RB>
__device__ __forceinline__ void shrink_rows(const Shrink& S, int k, float4 (&av)[RB]) {
#pragma unroll
  for (int q = 0; q < RB; ++q) av[q] = shrink_a(S, k, blockIdx.x * RB + q);
}

// acc[q] = av[q] . (h0, h1, h2, h3), written out by shrink_finish for RB rank rows of row `row`.
template <int RB>
__device__ __forceinline__ void shrink_rank_rows(const Shrink& S, const float4 (&av)[RB], const float (&hv)[4],
                                                 bool in, int rows, int row) {
  float acc[RB];
#pragma unroll
  for (int q = 0; q < RB; ++q) acc[q] = in ? shrink_dot(av[q], hv[0], hv[1], hv[2], hv[3]) : 0.f;
  shrink_finish<RB, true>(S, acc, rows, row, min(RB, S.rtot - (int)blockIdx.x * RB));
}

// Residual add + RMSNorm (as add_rmsnorm_kernel, without a LoRA term) and the next projection's
// shrink in one launch: grid (ceil(rtot / RB), kb, rows), block 1024 (the shrink's). Every block
// computes the norm of its row (the whole row, the same sums as add_rmsnorm_kernel<1024>) and the
// normed inputs of its 4096-input range, which blocks x = 0 also write out (x_out: the new
// residual, never x itself: other blocks still read x), and adds them times RB rows of a (the
// caller picks RB so that the launch stays one wave of blocks: fused_ops.CudaOps._fused_ranks).
template <int RB>
__global__ void __launch_bounds__(kShrinkThreads)
    add_rmsnorm_shrink_kernel(const bf16* __restrict__ x, const bf16* __restrict__ y, const bf16* __restrict__ bias,
                              const float* __restrict__ w, float eps, bf16* __restrict__ x_out,
                              bf16* __restrict__ h_out, const Shrink S, int rows, int hdim) {
  shrink_cluster_start();
  const long long row = blockIdx.z;
  const int i = blockIdx.y * kShrinkInputs + threadIdx.x * 4;
  float4 av[RB];
  shrink_rows<RB>(S, hdim, av);
  float wv[4] = {0.f, 0.f, 0.f, 0.f};  // the norm weight is constant during a step
  if (i < hdim) {
#pragma unroll
    for (int c = 0; c < 4; ++c) wv[c] = w[i + c];
  }
  pdl_wait_then_release();
  const Lora none{};  // no LoRA term: null pointers, zero sizes
  // the whole row (for the norm) and this thread's 4 inputs, loaded in one round
  float v[kRowSlots], own[4] = {0.f, 0.f, 0.f, 0.f};
  load_row<kShrinkThreads>(v, x, y, bias, none, row, hdim);
  if (i < hdim) {
#pragma unroll
    for (int c = 0; c < 4; ++c) own[c] = residual(x, y, bias, none, row, i + c, hdim);
  }
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < kRowSlots; ++c)
    if (threadIdx.x + c * kShrinkThreads < hdim) ss += v[c] * v[c];
  const float r = rsqrtf(block_sum<kShrinkThreads>(ss) / (float)hdim + eps);
  float hv[4] = {0.f, 0.f, 0.f, 0.f};
  if (i < hdim) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      hv[c] = rb((own[c] * r) * wv[c]);
      if (blockIdx.x == 0) {
        x_out[row * hdim + i + c] = __float2bfloat16_rn(own[c]);
        h_out[row * hdim + i + c] = __float2bfloat16_rn(hv[c]);
      }
    }
  }
  shrink_rank_rows<RB>(S, av, hv, i < hdim, rows, (int)row);
}

// SiLU * up (as silu_mul_kernel, without a LoRA term) and the down projection's shrink in one
// launch: grid (ceil(rtot / RB), kb = ceil(I / 4096), rows), block 1024; blocks x = 0 write out.
template <int RB>
__global__ void __launch_bounds__(kShrinkThreads)
    silu_mul_shrink_kernel(const bf16* __restrict__ gu, const bf16* __restrict__ bias, bf16* __restrict__ out,
                           const Shrink S, int rows, int inter) {
  shrink_cluster_start();
  const long long row = blockIdx.z;
  const int i = blockIdx.y * kShrinkInputs + threadIdx.x * 4;
  float4 av[RB];
  shrink_rows<RB>(S, inter, av);
  pdl_wait_then_release();
  const Lora none{};  // no LoRA term: null pointers, zero sizes
  float o4[4] = {0.f, 0.f, 0.f, 0.f};
  if (i < inter) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      o4[c] = silu_times(proj(gu, bias, none, row, i + c, 2 * inter),
                         proj(gu, bias, none, row, inter + i + c, 2 * inter));
      if (blockIdx.x == 0) out[row * inter + i + c] = __float2bfloat16_rn(o4[c]);
    }
  }
  shrink_rank_rows<RB>(S, av, o4, i < inter, rows, (int)row);
}

// grid (ceil(I / 256), rows), block 256. gu (rows, 2I) = [gate | up] -> bf16(bf16(silu(g)) * u).
__global__ void silu_mul_kernel(const bf16* __restrict__ gu, const bf16* __restrict__ bias, const Lora L,
                                bf16* __restrict__ out, int inter) {
  pdl_wait_then_release();
  const long long row = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= inter) return;
  const float o = silu_times(proj(gu, bias, L, row, i, 2 * inter), proj(gu, bias, L, row, inter + i, 2 * inter));
  out[row * inter + i] = __float2bfloat16_rn(o);
}


// ---- the step's own small work: inputs before the first layer, sampling after the head ------

// grid (rows), block 256: row r of a decode step's inputs: x[r] = embed[tok[r]], cos/sin rows of
// position pos[r], and valid[r, *slot] = true (the token's own cache column). Gathers only.
__global__ void __launch_bounds__(256)
    step_inputs_kernel(const int64_t* __restrict__ tok, const int64_t* __restrict__ pos,
                       const int64_t* __restrict__ slot, const bf16* __restrict__ embed,
                       const bf16* __restrict__ cos_t, const bf16* __restrict__ sin_t, bf16* __restrict__ x,
                       bf16* __restrict__ cos_out, bf16* __restrict__ sin_out, bool* __restrict__ valid,
                       long long ld_valid, int hdim, int d) {
  pdl_wait_then_release();
  const long long r = blockIdx.x, t = tok[r], p = pos[r];
  for (int i = threadIdx.x; i < hdim; i += blockDim.x) x[r * hdim + i] = embed[t * hdim + i];
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    cos_out[r * d + i] = cos_t[p * d + i];
    sin_out[r * d + i] = sin_t[p * d + i];
  }
  if (threadIdx.x == 0) valid[r * ld_valid + *slot] = true;
}

// grid (ceil(n / kOutSpan), rows), block kOutThreads: out (rows, n) fp32 = y (rows, n) bf16; then
// the step's counters move on: pos[r] += 1 for r < rows and *slot += 1 (block (0, 0)).
constexpr int kOutThreads = 256, kOutPerThread = 4, kOutSpan = kOutThreads * kOutPerThread;
__global__ void __launch_bounds__(kOutThreads)
    step_outputs_kernel(const bf16* __restrict__ y, float* __restrict__ out, long long ld_out, int64_t* pos,
                        int64_t* slot, int rows, int n) {
  pdl_wait_then_release();
  const long long r = blockIdx.y;
  const int i0 = blockIdx.x * kOutSpan + threadIdx.x;
#pragma unroll
  for (int c = 0; c < kOutPerThread; ++c) {
    const int i = i0 + c * kOutThreads;
    if (i < n) out[r * ld_out + i] = __bfloat162float(y[r * n + i]);
  }
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    for (int j = threadIdx.x; j < rows; j += blockDim.x) pos[j] += 1;
    if (threadIdx.x == 0) *slot += 1;
  }
}

// Sampling (engine/rollout/sampler.py): with q (exponential draws), token = argmax_i (x_i / T -
// log q_i), which draws i with probability softmax(x / T)_i (the argmax of p_i / q_i, taken in
// logs); without q, token = argmax_i x_i (T = 1). Ties go to the smaller index, as torch.argmax.
// logprob = s_tok - m - log(sum_i exp(s_i - m)), s = x / T, m = max s: log_softmax at the token.
// grid (ceil(V / kSampleSpan), rows), block kSampleThreads: each block reduces its span to
// (max, sum of exp(s - max), best value, its index); the row's last block (a ticket) combines
// them in block order, so the result does not depend on which block ends last.
constexpr int kSampleThreads = 256, kSampleSpan = 4 * kSampleThreads;

struct SamplePart {
  float m, sum, best;
  int idx;
};

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

// p := p combined with o: the larger max, the sums rescaled to it, the better (best, index).
__device__ __forceinline__ void merge(SamplePart& p, const SamplePart& o) {
  const float mm = fmaxf(p.m, o.m);
  p.sum = (mm == -INFINITY) ? 0.f : p.sum * expf(p.m - mm) + o.sum * expf(o.m - mm);
  p.m = mm;
  if (better(o.best, o.idx, p.best, p.idx)) p.best = o.best, p.idx = o.idx;
}

// The block's (max, sum of exp(s - max), best, index) from each thread's; thread 0 gets it.
__device__ SamplePart block_part(SamplePart p) {
  __shared__ SamplePart parts[kSampleThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    const SamplePart q{__shfl_xor_sync(0xffffffffu, p.m, o), __shfl_xor_sync(0xffffffffu, p.sum, o),
                       __shfl_xor_sync(0xffffffffu, p.best, o), __shfl_xor_sync(0xffffffffu, p.idx, o)};
    merge(p, q);
  }
  if ((threadIdx.x & 31) == 0) parts[threadIdx.x >> 5] = p;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kSampleThreads / 32; ++w) merge(p, parts[w]);
  }
  return p;
}

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* __restrict__ x, long long ld_x, const float* __restrict__ q, long long ld_q,
                  float temperature, int64_t* __restrict__ tokens, float* __restrict__ logprobs,
                  int64_t* __restrict__ tok_out, SamplePart* __restrict__ ws, int* __restrict__ tickets, int n) {
  pdl_wait_then_release();
  const long long r = blockIdx.y;
  const int nb = gridDim.x, i0 = blockIdx.x * kSampleSpan + threadIdx.x * 4;
  float s[4], v[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int i = i0 + c;
    s[c] = i < n ? x[r * ld_x + i] / temperature : -INFINITY;
    v[c] = i < n ? (q ? s[c] - logf(q[r * ld_q + i]) : s[c]) : -INFINITY;
  }
  SamplePart p{-INFINITY, 0.f, -INFINITY, 0x7fffffff};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    p.m = fmaxf(p.m, s[c]);
    if (i0 + c < n && better(v[c], i0 + c, p.best, p.idx)) p.best = v[c], p.idx = i0 + c;
  }
  if (p.m != -INFINITY) {
#pragma unroll
    for (int c = 0; c < 4; ++c) p.sum += expf(s[c] - p.m);
  }
  p = block_part(p);
  __shared__ int is_last;
  if (threadIdx.x == 0) {
    ws[r * nb + blockIdx.x] = p;
    __threadfence();
    is_last = atomicAdd(tickets + r, 1) == nb - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // the row's parts, thread j taking blocks j, j + 256, ... in order, then the same tree as above
  SamplePart a{-INFINITY, 0.f, -INFINITY, 0x7fffffff};
  for (int b = threadIdx.x; b < nb; b += kSampleThreads) {
    const float4 w = __ldcg(reinterpret_cast<const float4*>(ws + r * nb + b));  // other blocks' writes: via L2
    merge(a, SamplePart{w.x, w.y, w.z, __float_as_int(w.w)});
  }
  a = block_part(a);
  if (threadIdx.x == 0) {
    const int tok = a.idx < n ? a.idx : 0;
    tokens[r] = tok;
    if (tok_out) tok_out[r] = tok;
    logprobs[r] = (x[r * ld_x + tok] / temperature - a.m) - logf(a.sum);
    tickets[r] = 0;
  }
}

namespace {

// kernel<<<grid, block, 0, stream>>>(args...), with PDL if enabled.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, void* stream, Args... args) {
  return qerl::launch_pdl(kernel, grid, block, 0, stream, args...);
}

// The shrinks merge their K blocks in a cluster unless QERL_SHRINK_CLUSTER=0 (read at every
// launch; then through the workspace and tickets). Measured on the H200 (benchmarks/RESULTS.md):
// 0.8-1.2 us a 7B layer faster, 0.9 at 32B batch 1 and 5.1 at 32B batch 8.
bool shrink_cluster_enabled() {
  const char* v = getenv("QERL_SHRINK_CLUSTER");
  return v == nullptr || strcmp(v, "0") != 0;
}

// A shrink kernel of grid (., kb, .) and 1024 threads: in clusters of its kb K blocks where
// enabled and 2 <= kb <= kMaxShrinkCluster (shrink_finish), else as launch().
template <typename... Params, typename... Args>
cudaError_t launch_shrink(void (*kernel)(Params...), dim3 grid, void* stream, Args... args) {
  if (shrink_cluster_enabled() && grid.y >= 2 && grid.y <= (unsigned)kMaxShrinkCluster)
    return qerl::launch_pdl_cluster(kernel, grid, dim3(kShrinkThreads), dim3(1, grid.y, 1), 0, stream, args...);
  return launch(kernel, grid, dim3(kShrinkThreads), stream, args...);
}

}  // namespace

extern "C" {

#define LORA_ARGS const void *ls, const void *lb, int lr, int lds, int ldb, int n1, int n2
#define LORA_MAKE Lora{(const float*)ls, (const float*)lb, lr, lds, ldb, n1, n2}

// The shrinks' launches: grid (rtot, ceil(k / 4096), ceil(rows / 8)) for the plain shrink,
// (ceil(rtot / rb), ceil(k / 4096), rows) for the fused ones. With k > 4096, ws holds
// ceil(k / 4096) * rows * rtot floats and tickets (grid z) * rtot ints, all zero before the first
// call (each call leaves them zero); unused otherwise.
#define SHRINK_ARGS const void *a, void *s, void *ws, void *tickets, int rtot
static int shrink_grid(int rows, int rows_per_block, int k, int rtot, const void* ws, const void* tickets,
                       dim3* grid) {
  if (k % 4 || rows < 1 || k < 1 || rtot < 1) return (int)cudaErrorInvalidValue;
  const int kb = (k + kShrinkInputs - 1) / kShrinkInputs;
  if (kb > 1 && (ws == nullptr || tickets == nullptr)) return (int)cudaErrorInvalidValue;
  *grid = dim3(rtot, kb, (rows + rows_per_block - 1) / rows_per_block);
  return 0;
}
#define SHRINK_MAKE Shrink{(const float*)a, (float*)s, (float*)ws, (int*)tickets, rtot}

// s (rows, rtot) = x (rows, k; row stride ldx, bf16) @ a^T (a: rtot x k, fp32).
int qerl_lora_shrink(const void* x, int ldx, SHRINK_ARGS, int rows, int k, void* stream) {
  dim3 grid;
  if (ldx % 4) return (int)cudaErrorInvalidValue;
  if (int err = shrink_grid(rows, 8, k, rtot, ws, tickets, &grid)) return err;
  return (int)launch_shrink(lora_shrink_kernel, grid, stream, (const bf16*)x, ldx, SHRINK_MAKE, rows, k);
}

// The fused kernels' grid: (ceil(rtot / rb), kb, rows) for rb rank rows per block (1, 2, 4, 8).
static int fused_grid(int rows, int k, int rtot, int rb, const void* ws, const void* tickets, dim3* grid) {
  if (rb != 1 && rb != 2 && rb != 4 && rb != 8) return (int)cudaErrorInvalidValue;
  if (int err = shrink_grid(rows, 1, k, rtot, ws, tickets, grid)) return err;
  grid->x = (rtot + rb - 1) / rb;
  return 0;
}

#define QERL_RB_CASES(KERNEL, ...)                                             \
  switch (rb) {                                                               \
    case 1: return (int)launch_shrink(KERNEL<1>, grid, stream, __VA_ARGS__);  \
    case 2: return (int)launch_shrink(KERNEL<2>, grid, stream, __VA_ARGS__);  \
    case 4: return (int)launch_shrink(KERNEL<4>, grid, stream, __VA_ARGS__);  \
    default: return (int)launch_shrink(KERNEL<8>, grid, stream, __VA_ARGS__); \
  }

// x_out = x + y (+ bias), h = RMSNorm(x_out) * w, s = h @ a^T (x_out must not be x); rb rank rows
// of a per block.
int qerl_add_rmsnorm_shrink(const void* x, const void* y, const void* bias, const void* w, float eps, void* x_out,
                            void* h, SHRINK_ARGS, int rows, int hdim, int rb, void* stream) {
  dim3 grid;
  if (x == x_out || hdim > kRowSlots * kShrinkThreads) return (int)cudaErrorInvalidValue;
  if (int err = fused_grid(rows, hdim, rtot, rb, ws, tickets, &grid)) return err;
  QERL_RB_CASES(add_rmsnorm_shrink_kernel, (const bf16*)x, (const bf16*)y, (const bf16*)bias, (const float*)w, eps,
                (bf16*)x_out, (bf16*)h, SHRINK_MAKE, rows, hdim)
}

// out = silu(gate (+ bias)) * (up (+ bias)) for gu = [gate | up] (rows, 2 inter), s = out @ a^T;
// rb rank rows of a per block.
int qerl_silu_mul_shrink(const void* gu, const void* bias, void* out, SHRINK_ARGS, int rows, int inter, int rb,
                         void* stream) {
  dim3 grid;
  if (int err = fused_grid(rows, inter, rtot, rb, ws, tickets, &grid)) return err;
  QERL_RB_CASES(silu_mul_shrink_kernel, (const bf16*)gu, (const bf16*)bias, (bf16*)out, SHRINK_MAKE, rows, inter)
}

int qerl_lora_expand(const void* y, const void* bias, LORA_ARGS, void* out, int rows, int n, int ld_y,
                     void* stream) {
  const dim3 grid((n + 255) / 256, rows);
  return (int)launch(lora_expand_kernel, grid, dim3(256), stream, (const bf16*)y, (const bf16*)bias, LORA_MAKE,
                     (bf16*)out, n, ld_y);
}

int qerl_qkv_rope_cache(const void* y, const void* bias, LORA_ARGS, const void* cos_t, const void* sin_t,
                        void* q_out, void* kc, void* vc, const void* slot, int rows, int heads, int kv_heads, int d,
                        long long cache_row, long long cache_head, int ld_y, int seq, void* stream) {
  if (d > 1024 || d % 2 || seq < 1 || rows % seq) return (int)cudaErrorInvalidValue;
  const dim3 grid(rows, heads + 2 * kv_heads);
  return (int)launch(qkv_rope_cache_kernel, grid, dim3(d), stream, (const bf16*)y, (const bf16*)bias, LORA_MAKE,
                     (const bf16*)cos_t, (const bf16*)sin_t, (bf16*)q_out, (bf16*)kc, (bf16*)vc,
                     (const int64_t*)slot, heads, kv_heads, d, cache_row, cache_head, ld_y, seq);
}

int qerl_add_rmsnorm(void* x, const void* y, const void* bias, LORA_ARGS, const void* w, float eps, void* out,
                     int rows, int hdim, void* stream) {
  if (hdim > kRowSlots * 1024) return (int)cudaErrorInvalidValue;
  return (int)launch(add_rmsnorm_kernel<1024>, dim3(rows), dim3(1024), stream, (bf16*)x, (const bf16*)y,
                     (const bf16*)bias, LORA_MAKE, (const float*)w, eps, (bf16*)out, hdim);
}

int qerl_silu_mul(const void* gu, const void* bias, LORA_ARGS, void* out, int rows, int inter, void* stream) {
  const dim3 grid((inter + 255) / 256, rows);
  return (int)launch(silu_mul_kernel, grid, dim3(256), stream, (const bf16*)gu, (const bf16*)bias, LORA_MAKE,
                     (bf16*)out, inter);
}

// A decode step's inputs (step_inputs_kernel): x (rows, hdim), cos / sin (rows, d), valid[:rows, *slot].
int qerl_step_inputs(const void* tok, const void* pos, const void* slot, const void* embed, const void* cos_t,
                     const void* sin_t, void* x, void* cos_out, void* sin_out, void* valid, long long ld_valid,
                     int rows, int hdim, int d, void* stream) {
  if (rows < 1 || hdim < 1 || d < 1) return (int)cudaErrorInvalidValue;
  return (int)launch(step_inputs_kernel, dim3(rows), dim3(256), stream, (const int64_t*)tok, (const int64_t*)pos,
                     (const int64_t*)slot, (const bf16*)embed, (const bf16*)cos_t, (const bf16*)sin_t, (bf16*)x,
                     (bf16*)cos_out, (bf16*)sin_out, (bool*)valid, ld_valid, hdim, d);
}

// out (rows, n; row stride ld_out) fp32 = y (rows, n) bf16; pos[:rows] += 1; *slot += 1.
int qerl_step_outputs(const void* y, void* out, long long ld_out, void* pos, void* slot, int rows, int n,
                      void* stream) {
  if (rows < 1 || n < 1) return (int)cudaErrorInvalidValue;
  const dim3 grid((n + kOutSpan - 1) / kOutSpan, rows);
  return (int)launch(step_outputs_kernel, grid, dim3(kOutThreads), stream, (const bf16*)y, (float*)out, ld_out,
                     (int64_t*)pos, (int64_t*)slot, rows, n);
}

// tokens (rows) int64 and logprobs (rows) fp32 from x (rows, n) fp32 and q (rows, n) fp32 or null
// (sample_kernel); tok_out (or null) gets the tokens too. ws: rows * ceil(n / 1024) * 16 bytes;
// tickets: rows ints, zero before the call (each call leaves them zero).
int qerl_sample(const void* x, long long ld_x, const void* q, long long ld_q, float temperature, void* tokens,
                void* logprobs, void* tok_out, void* ws, void* tickets, int rows, int n, void* stream) {
  if (rows < 1 || n < 1 || !(temperature > 0.f)) return (int)cudaErrorInvalidValue;
  const dim3 grid((n + kSampleSpan - 1) / kSampleSpan, rows);
  return (int)launch(sample_kernel, grid, dim3(kSampleThreads), stream, (const float*)x, ld_x, (const float*)q,
                     ld_q, temperature, (int64_t*)tokens, (float*)logprobs, (int64_t*)tok_out, (SamplePart*)ws,
                     (int*)tickets, n);
}

const char* qerl_fused_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }
}

// Decode attention over the static KV cache of engine/rollout/cuda_graph.py: one new query token
// per row, grouped-query heads (the n_rep query heads of a kv head share its keys and values),
// bf16 inputs and output, fp32 arithmetic. Plain C entry point (no torch headers), launched on
// the caller's stream.
//
// Grid (splits, kv heads, rows), 128 threads. A block owns the n_rep query heads of one kv head
// and a range of key tiles (64 keys each) of the columns [0, s) of the cache. Per tile it starts
// an asynchronous copy of the value tile into shared memory, and meanwhile two threads per key
// compute the n_rep scores (key halves in registers, queries from shared memory); then a running
// max / sum per head (online softmax, base 2) and the output accumulators (one head dimension
// per thread, 4 keys per step). Masked columns (valid = false) get no weight. With one split
// the block writes the output; otherwise it writes its partial (output, max, sum) to a
// workspace, and the last block of a (row, kv head) to arrive (an atomic ticket, reset by that
// block) combines the splits in split order, so results do not depend on the order blocks
// finish in; it loads eight splits' partials at a time before adding them (a chain of one load
// per split made the combine the longest part of a call: up to 64 round trips to L2).
//
// Launched with programmatic dependent launch (../kernels/pdl.cuh): the kernel touches memory
// only after griddepcontrol.wait and releases its dependents after it.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "../kernels/pdl.cuh"

typedef __nv_bfloat16 bf16;

namespace {

constexpr int kKeys = 64;     // keys per tile
constexpr int kThreads = 128;
constexpr int kMaxRep = 8;    // query heads per kv head
constexpr int kMaxSplits = 64;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}

template <int D>
__global__ void __launch_bounds__(kThreads)
decode_attention_kernel(const bf16* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
                        long long cache_row, long long cache_head, const uint8_t* __restrict__ valid, int ld_valid,
                        bf16* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters, int n_rep, int s,
                        int tiles_per_split, float scale_log2) {
  constexpr int TPK = kThreads / kKeys;  // threads per key for the scores
  constexpr int DH = D / TPK;            // head dimensions per thread for the scores
  constexpr int KG = kThreads / D;       // key groups for the output accumulation
  constexpr int QP = DH + 4;             // padded half of a query row (keeps the two halves on other banks)
  static_assert(TPK == 2 && DH % 8 == 0 && KG >= 1 && kThreads % D == 0, "unsupported head size");

  __shared__ float qs[kMaxRep][TPK * QP];
  __shared__ __align__(16) bf16 vs[kKeys][D];
  __shared__ float ps[kMaxRep][kKeys];
  __shared__ float m_s[kMaxRep], l_s[kMaxRep], c_s[kMaxRep];
  __shared__ float red[KG > 1 ? KG : 1][KG > 1 ? kMaxRep : 1][KG > 1 ? D : 1];
  __shared__ float sm_m[kMaxSplits * kMaxRep], sm_l[kMaxSplits * kMaxRep];
  __shared__ int last;

  qerl::pdl_wait_then_release();

  const int split = blockIdx.x, g = blockIdx.y, b = blockIdx.z, splits = gridDim.x, kvh = gridDim.y;
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const long long head0 = (long long)b * kvh * n_rep + (long long)g * n_rep;  // first query head of the group
  for (int c = t; c < n_rep * D / 8; c += kThreads) {  // 16 bytes of queries per thread
    const uint4 v = *reinterpret_cast<const uint4*>(q + head0 * D + c * 8);
    const int r = c * 8 / D, d = c * 8 % D;
    const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&v);
    float f[8];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 x = __bfloat1622float2(h2[e]);
      f[2 * e] = x.x * scale_log2;
      f[2 * e + 1] = x.y * scale_log2;
    }
    float* dst = &qs[r][(d / DH) * QP + d % DH];
    reinterpret_cast<float4*>(dst)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(f[4], f[5], f[6], f[7]);
  }
  if (t < kMaxRep) {
    m_s[t] = -INFINITY;
    l_s[t] = 0.f;
  }
  const bf16* kb = kc + b * cache_row + g * cache_head;
  const bf16* vb = vc + b * cache_row + g * cache_head;
  const uint8_t* vrow = valid + (long long)b * ld_valid;
  const int key_l = t / TPK, part = t % TPK, dim = t % D, kg = t / D;
  float o[kMaxRep];
#pragma unroll
  for (int r = 0; r < kMaxRep; ++r) o[r] = 0.f;

  const int k0 = split * tiles_per_split * kKeys;
  const int k_end = min(s, k0 + tiles_per_split * kKeys);
  for (int kt = k0; kt < k_end; kt += kKeys) {
    __syncthreads();  // the queries are in place; the previous tile's values and weights are used
    for (int c = t; c < kKeys * D / 8; c += kThreads) {  // the value tile, asynchronously (zeros past the end)
      const int kk = c / (D / 8), off = (c % (D / 8)) * 8;
      const bool in = kt + kk < k_end;
      cp_async16(&vs[kk][off], vb + (in ? (long long)(kt + kk) * D + off : 0), in);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    const int key = kt + key_l;
    float acc[kMaxRep];
#pragma unroll
    for (int r = 0; r < kMaxRep; ++r) acc[r] = 0.f;
    if (key < k_end) {
      const uint4* kp = reinterpret_cast<const uint4*>(kb + (long long)key * D + part * DH);
      uint4 kr[DH / 8];
#pragma unroll
      for (int j = 0; j < DH / 8; ++j) kr[j] = kp[j];
#pragma unroll
      for (int j = 0; j < DH / 8; ++j) {
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&kr[j]);
        float kf[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 x = __bfloat1622float2(h2[e]);
          kf[2 * e] = x.x;
          kf[2 * e + 1] = x.y;
        }
#pragma unroll
        for (int r = 0; r < kMaxRep; ++r) {
          if (r < n_rep) {
            const float4* qp = reinterpret_cast<const float4*>(&qs[r][part * QP + j * 8]);
            const float4 a = qp[0], b = qp[1];
            float v = acc[r];
            v = fmaf(kf[0], a.x, v); v = fmaf(kf[1], a.y, v); v = fmaf(kf[2], a.z, v); v = fmaf(kf[3], a.w, v);
            v = fmaf(kf[4], b.x, v); v = fmaf(kf[5], b.y, v); v = fmaf(kf[6], b.z, v); v = fmaf(kf[7], b.w, v);
            acc[r] = v;
          }
        }
      }
    }
    const bool ok = key < k_end && vrow[key] != 0;
#pragma unroll
    for (int r = 0; r < kMaxRep; ++r) {
      acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 1);
      if (r < n_rep && part == 0) ps[r][key_l] = ok ? acc[r] : -INFINITY;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    for (int r = warp; r < n_rep; r += kThreads / 32) {  // online softmax of head r over this tile
      const float a = ps[r][lane], c = ps[r][lane + 32];
      float mx = fmaxf(a, c);
      for (int w = 16; w > 0; w >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, w));
      const float m_old = m_s[r], m_new = fmaxf(m_old, mx);
      const float pa = m_new == -INFINITY ? 0.f : exp2f(a - m_new);
      const float pc = m_new == -INFINITY ? 0.f : exp2f(c - m_new);
      ps[r][lane] = pa;
      ps[r][lane + 32] = pc;
      float sum = pa + pc;
      for (int w = 16; w > 0; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
      if (lane == 0) {
        const float corr = m_old == -INFINITY ? 0.f : exp2f(m_old - m_new);
        l_s[r] = l_s[r] * corr + sum;
        m_s[r] = m_new;
        c_s[r] = corr;
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kMaxRep; ++r) o[r] *= r < n_rep ? c_s[r] : 0.f;
    for (int kk = kg * (kKeys / KG); kk < (kg + 1) * (kKeys / KG); kk += 4) {  // this thread's keys, 4 at a time
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = __bfloat162float(vs[kk + e][dim]);
#pragma unroll
      for (int r = 0; r < kMaxRep; ++r) {
        if (r < n_rep) {
          const float4 p = *reinterpret_cast<const float4*>(&ps[r][kk]);
          o[r] = fmaf(p.w, v[3], fmaf(p.z, v[2], fmaf(p.y, v[1], fmaf(p.x, v[0], o[r]))));
        }
      }
    }
  }
  if constexpr (KG > 1) {  // add the key groups' accumulators
#pragma unroll
    for (int r = 0; r < kMaxRep; ++r) {
      if (r < n_rep) red[kg][r][dim] = o[r];
    }
    __syncthreads();
    if (kg == 0) {
#pragma unroll
      for (int r = 0; r < kMaxRep; ++r) {
        if (r < n_rep) {
          float v = 0.f;
          for (int j = 0; j < KG; ++j) v += red[j][r][dim];
          o[r] = v;
        }
      }
    }
  }
  if (splits == 1) {
    if (kg == 0) {
#pragma unroll
      for (int r = 0; r < kMaxRep; ++r) {
        if (r < n_rep) {
          const float l = l_s[r];
          out[(head0 + r) * D + dim] = __float2bfloat16_rn(l > 0.f ? o[r] / l : 0.f);
        }
      }
    }
    return;
  }
  const int rec = D + 2;  // per head: D outputs, max, sum
  float* wg = ws + ((long long)b * kvh + g) * splits * n_rep * rec;
  if (kg == 0) {
#pragma unroll
    for (int r = 0; r < kMaxRep; ++r) {
      if (r < n_rep) wg[(split * n_rep + r) * rec + dim] = o[r];
    }
  }
  if (t < n_rep) {
    wg[(split * n_rep + t) * rec + D] = m_s[t];
    wg[(split * n_rep + t) * rec + D + 1] = l_s[t];
  }
  __threadfence();
  __syncthreads();
  if (t == 0) {
    int* ctr = counters + (long long)b * kvh + g;
    last = atomicAdd(ctr, 1) == splits - 1;
    if (last) *ctr = 0;  // every block of this (row, kv head) has counted: ready for the next call
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = t; i < splits * n_rep; i += kThreads) {  // every split's max and sum (i = split * n_rep + head)
    sm_m[i] = __ldcg(wg + i * rec + D);
    sm_l[i] = __ldcg(wg + i * rec + D + 1);
  }
  __syncthreads();
  if (t < n_rep) {
    float mx = -INFINITY, den = 0.f;
    for (int sp = 0; sp < splits; ++sp) mx = fmaxf(mx, sm_m[sp * n_rep + t]);
    if (mx != -INFINITY) {
      for (int sp = 0; sp < splits; ++sp) {
        const float m = sm_m[sp * n_rep + t];
        if (m != -INFINITY) den = fmaf(exp2f(m - mx), sm_l[sp * n_rep + t], den);
      }
    }
    m_s[t] = mx;
    l_s[t] = den > 0.f ? 1.f / den : 0.f;
  }
  __syncthreads();
  for (int i = t; i < splits * n_rep; i += kThreads) {  // each split's weight in the final output
    const int r = i % n_rep;
    const float m = sm_m[i];
    sm_m[i] = m == -INFINITY ? 0.f : exp2f(m - m_s[r]) * l_s[r];
  }
  __syncthreads();
  // Thread (kg, dim) adds the splits' outputs of heads kg, kg + KG, ... at dimension dim, in split
  // order; the partials of kSplitBatch splits for all its heads are loaded before any is used, so
  // a combine costs ceil(splits / kSplitBatch) round trips to L2 rather than one per split.
  constexpr int RPT = (kMaxRep + KG - 1) / KG;  // heads per thread
  constexpr int kSplitBatch = 8;
  float acc[RPT];
#pragma unroll
  for (int j = 0; j < RPT; ++j) acc[j] = 0.f;
  for (int sp0 = 0; sp0 < splits; sp0 += kSplitBatch) {
    float v[kSplitBatch][RPT];
#pragma unroll
    for (int e = 0; e < kSplitBatch; ++e) {
#pragma unroll
      for (int j = 0; j < RPT; ++j) {
        const int r = kg + j * KG;
        v[e][j] = sp0 + e < splits && r < n_rep ? __ldcg(wg + ((sp0 + e) * n_rep + r) * rec + dim) : 0.f;
      }
    }
#pragma unroll
    for (int e = 0; e < kSplitBatch; ++e) {
#pragma unroll
      for (int j = 0; j < RPT; ++j) {
        const int r = kg + j * KG;
        if (sp0 + e < splits && r < n_rep) acc[j] = fmaf(sm_m[(sp0 + e) * n_rep + r], v[e][j], acc[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < RPT; ++j) {
    const int r = kg + j * KG;
    if (r < n_rep) out[(head0 + r) * D + dim] = __float2bfloat16_rn(acc[j]);
  }
}

template <int D>
cudaError_t launch(dim3 grid, void* stream, const bf16* q, const bf16* kc, const bf16* vc, long long cache_row,
                   long long cache_head, const uint8_t* valid, int ld_valid, bf16* out, float* ws, int* counters,
                   int n_rep, int s, int tiles_per_split, float scale_log2) {
  return qerl::launch_pdl(decode_attention_kernel<D>, grid, dim3(kThreads), 0, stream, q, kc, vc, cache_row,
                          cache_head, valid, ld_valid, out, ws, counters, n_rep, s, tiles_per_split, scale_log2);
}

}  // namespace

extern "C" {

// q (rows, kv_heads * n_rep, d) contiguous; kc, vc: one layer of the cache, element (row, kv head,
// column, dim) at row * cache_row + head * cache_head + column * d + dim; valid (rows, ld_valid)
// bool; out (rows, kv_heads * n_rep * d). ws: splits * rows * kv_heads * n_rep * (d + 2) floats
// (unused when splits == 1); counters: rows * kv_heads ints, zero (and left zero).
int qerl_decode_attention(const void* q, const void* kc, const void* vc, long long cache_row, long long cache_head,
                          const void* valid, int ld_valid, void* out, void* ws, void* counters, int rows, int kv_heads,
                          int n_rep, int d, int s, int splits, int tiles_per_split, float scale_log2, void* stream) {
  if (n_rep < 1 || n_rep > kMaxRep || s < 1 || splits < 1 || splits > kMaxSplits || tiles_per_split < 1 ||
      (long long)splits * tiles_per_split * kKeys < s || (long long)(splits - 1) * tiles_per_split * kKeys >= s)
    return (int)cudaErrorInvalidValue;
  const dim3 grid(splits, kv_heads, rows);
  void* st = stream;
  const bf16 *qq = static_cast<const bf16*>(q), *k = static_cast<const bf16*>(kc), *v = static_cast<const bf16*>(vc);
  const uint8_t* va = static_cast<const uint8_t*>(valid);
  bf16* o = static_cast<bf16*>(out);
  float* w = static_cast<float*>(ws);
  int* c = static_cast<int*>(counters);
  if (d == 128)
    return (int)launch<128>(grid, st, qq, k, v, cache_row, cache_head, va, ld_valid, o, w, c, n_rep, s, tiles_per_split,
                            scale_log2);
  if (d == 64)
    return (int)launch<64>(grid, st, qq, k, v, cache_row, cache_head, va, ld_valid, o, w, c, n_rep, s, tiles_per_split,
                           scale_log2);
  return (int)cudaErrorInvalidValue;
}

const char* qerl_decode_attention_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

}  // extern "C"

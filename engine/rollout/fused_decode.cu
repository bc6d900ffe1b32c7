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
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../kernels/pdl.cuh"

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
#pragma unroll 8
    for (int t = 0; t < L.r; ++t) d = fmaf(sp[t], bp[(long long)t * L.ld_b], d);
    v = rb(v + d);
  }
  return v;
}

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

// grid (rtot, kb = ceil(k / 4096), ceil(rows / 8)), block 1024: s[row, j] = sum_k x[row, k] * a[j, k]
// (fp32) for 8 rows. Each thread multiplies 4 inputs of a by those of each row; the block adds its
// threads' products in a fixed order (warps, then across warps). With kb > 1 each block writes its
// sums to ws (kb, rows, rtot) and takes a ticket; the last block of an output adds the kb sums in
// block order, writes s and resets the ticket (left zero for the next call). One launch, no
// zeroed output, the same result on every run. A is read before the PDL wait (no kernel of a
// decode step writes it).
constexpr int kShrinkThreads = 1024, kShrinkWarps = kShrinkThreads / 32;
constexpr int kShrinkInputs = 4 * kShrinkThreads;  // inputs per block

__global__ void __launch_bounds__(kShrinkThreads)
    lora_shrink_kernel(const bf16* __restrict__ x, int ldx, const float* __restrict__ a, float* __restrict__ s,
                       float* __restrict__ ws, int* __restrict__ tickets, int rows, int k, int rtot) {
  const int j = blockIdx.x, kbi = blockIdx.y, kb = gridDim.y, r0 = blockIdx.z * 8;
  const int nr = min(8, rows - r0);
  const int i = kbi * kShrinkInputs + threadIdx.x * 4;
  float4 av = make_float4(0.f, 0.f, 0.f, 0.f);
  if (i < k) av = *reinterpret_cast<const float4*>(a + (long long)j * k + i);
  pdl_wait_then_release();
  float acc[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] = 0.f;
  if (i < k) {  // k is a multiple of 4, rows of x and a are 8-byte aligned
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      if (q < nr) {
        const uint2 raw = *reinterpret_cast<const uint2*>(x + (long long)(r0 + q) * ldx + i);
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
        acc[q] = fmaf(av.x, lo.x, fmaf(av.y, lo.y, fmaf(av.z, hi.x, av.w * hi.y)));
      }
    }
  }
  __shared__ float part[8][kShrinkWarps];
  __shared__ int is_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    float v = acc[q];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) part[q][warp] = v;
  }
  __syncthreads();
  float* out = kb == 1 ? s : ws + (long long)kbi * rows * rtot;  // this block's sums
  if (warp < nr) {  // warp q adds row q's warp sums
    float v = part[warp][lane];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) out[(long long)(r0 + warp) * rtot + j] = v;
  }
  if (kb == 1) return;
  __threadfence();
  __syncthreads();
  int* ticket = tickets + blockIdx.z * rtot + j;
  if (threadIdx.x == 0) is_last = atomicAdd(ticket, 1) == kb - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if (warp < nr) {  // lane p adds blocks p, p + 32, ...; then the warp adds its lanes
    float v = 0.f;
    for (int b = lane; b < kb; b += 32) v += __ldcg(ws + ((long long)b * rows + r0 + warp) * rtot + j);
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) s[(long long)(r0 + warp) * rtot + j] = v;
  }
  if (threadIdx.x == 0) *ticket = 0;
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

// grid (rows), block THREADS. x (rows, H) += projection output (if y), then
// out = bf16(x * rsqrt(mean(x^2) + eps) * w).
template <int THREADS>
__global__ void add_rmsnorm_kernel(bf16* x, const bf16* __restrict__ y, const bf16* __restrict__ bias, const Lora L,
                                   const float* __restrict__ w, float eps, bf16* __restrict__ out, int hdim) {
  pdl_wait_then_release();
  const long long row = blockIdx.x;
  bf16* xr = x + row * hdim;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hdim; i += THREADS) {
    float v = ld(xr + i);
    if (y) {
      v = rb(v + proj(y, bias, L, row, i, hdim));
      xr[i] = __float2bfloat16_rn(v);
    }
    ss += v * v;
  }
  const float r = rsqrtf(block_sum<THREADS>(ss) / (float)hdim + eps);
  for (int i = threadIdx.x; i < hdim; i += THREADS) {
    const float o = rb((ld(xr + i) * r) * w[i]);
    out[row * hdim + i] = __float2bfloat16_rn(o);
  }
}

// grid (ceil(I / 256), rows), block 256. gu (rows, 2I) = [gate | up] -> bf16(bf16(silu(g)) * u).
__global__ void silu_mul_kernel(const bf16* __restrict__ gu, const bf16* __restrict__ bias, const Lora L,
                                bf16* __restrict__ out, int inter) {
  pdl_wait_then_release();
  const long long row = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= inter) return;
  const float g = proj(gu, bias, L, row, i, 2 * inter);
  const float u = proj(gu, bias, L, row, inter + i, 2 * inter);
  const float s = rb(g / (1.0f + expf(-g)));
  const float o = rb(s * u);
  out[row * inter + i] = __float2bfloat16_rn(o);
}


namespace {

// kernel<<<grid, block, 0, stream>>>(args...), with PDL if enabled.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, void* stream, Args... args) {
  return qerl::launch_pdl(kernel, grid, block, 0, stream, args...);
}

}  // namespace

extern "C" {

#define LORA_ARGS const void *ls, const void *lb, int lr, int lds, int ldb, int n1, int n2
#define LORA_MAKE Lora{(const float*)ls, (const float*)lb, lr, lds, ldb, n1, n2}

// s (rows, rtot) = x (rows, k; row stride ldx, bf16) @ a^T (a: rtot x k, fp32). With k > 4096, ws
// holds ceil(k / 4096) * rows * rtot floats and tickets ceil(rows / 8) * rtot ints, all zero
// before the first call (each call leaves them zero); unused otherwise.
int qerl_lora_shrink(const void* x, int ldx, const void* a, void* s, void* ws, void* tickets, int rows, int k,
                     int rtot, void* stream) {
  if (k % 4 || ldx % 4 || rows < 1 || k < 1) return (int)cudaErrorInvalidValue;
  const int kb = (k + kShrinkInputs - 1) / kShrinkInputs;
  if (kb > 1 && (ws == nullptr || tickets == nullptr)) return (int)cudaErrorInvalidValue;
  const dim3 grid(rtot, kb, (rows + 7) / 8);
  return (int)launch(lora_shrink_kernel, grid, dim3(kShrinkThreads), stream, (const bf16*)x, ldx,
                     (const float*)a, (float*)s, (float*)ws, (int*)tickets, rows, k, rtot);
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
  return (int)launch(add_rmsnorm_kernel<1024>, dim3(rows), dim3(1024), stream, (bf16*)x, (const bf16*)y,
                     (const bf16*)bias, LORA_MAKE, (const float*)w, eps, (bf16*)out, hdim);
}

int qerl_silu_mul(const void* gu, const void* bias, LORA_ARGS, void* out, int rows, int inter, void* stream) {
  const dim3 grid((inter + 255) / 256, rows);
  return (int)launch(silu_mul_kernel, grid, dim3(256), stream, (const bf16*)gu, (const bf16*)bias, LORA_MAKE,
                     (bf16*)out, inter);
}

const char* qerl_fused_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }
}

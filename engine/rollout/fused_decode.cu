// Fused element-wise steps of one decode token (bf16 activations), for engine/rollout/fused_ops.py.
//
// Each kernel repeats the eager decoder's operations with the same bf16 roundings, in the same
// order: a projection's output gets its bias added in bf16, then its LoRA delta in fp32 and is
// rounded once more; the residual add is a bf16 add; RMSNorm computes in fp32 and rounds once;
// RoPE is three bf16 ops (x*cos, rotate_half(x)*sin, their sum). Only reduction orders differ.
// Plain C entry points (no torch headers), launched on the caller's stream.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float rb(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float ld(const bf16* p) { return __bfloat162float(*p); }

// Projection output after its bias and LoRA epilogue, as a bf16 value in fp32.
__device__ __forceinline__ float proj(const bf16* y, const bf16* bias, const float* delta, long long row, int col,
                                      int ld_y) {
  float v = ld(y + row * ld_y + col);
  if (bias) v = rb(v + ld(bias + col));
  if (delta) v = rb(v + delta[row * ld_y + col]);
  return v;
}

// grid (rows, heads + 2 * kv_heads), block head_dim. q heads -> q_out (rows, heads, D) roped;
// k heads roped and v heads as they are -> the caches at column *slot.
__global__ void qkv_rope_cache_kernel(const bf16* __restrict__ y, const bf16* __restrict__ bias,
                                      const float* __restrict__ delta, const bf16* __restrict__ cos_t,
                                      const bf16* __restrict__ sin_t, bf16* __restrict__ q_out, bf16* kc, bf16* vc,
                                      const int64_t* __restrict__ slot, int heads, int kv_heads, int d,
                                      long long cache_row, long long cache_head, int ld_y) {
  const long long row = blockIdx.x;
  const int h = blockIdx.y;
  const int t = threadIdx.x;
  if (t >= d) return;
  const long long s = *slot;
  const float x = proj(y, bias, delta, row, h * d + t, ld_y);
  if (h >= heads + kv_heads) {
    vc[row * cache_row + (long long)(h - heads - kv_heads) * cache_head + s * d + t] = __float2bfloat16_rn(x);
    return;
  }
  const int half = d / 2;
  const float p = proj(y, bias, delta, row, h * d + (t < half ? t + half : t - half), ld_y);
  const float rot = t < half ? -p : p;
  const float c = ld(cos_t + row * d + t), sn = ld(sin_t + row * d + t);
  const bf16 o = __float2bfloat16_rn(rb(x * c) + rb(rot * sn));
  if (h < heads) {
    q_out[(row * heads + h) * d + t] = o;
  } else {
    kc[row * cache_row + (long long)(h - heads) * cache_head + s * d + t] = o;
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
// out = bf16(x * rsqrt(mean(x^2) + eps) * w) and, if out32, its fp32 copy.
template <int THREADS>
__global__ void add_rmsnorm_kernel(bf16* x, const bf16* __restrict__ y, const bf16* __restrict__ bias,
                                   const float* __restrict__ delta, const float* __restrict__ w, float eps,
                                   bf16* __restrict__ out, float* __restrict__ out32, int hdim) {
  const long long row = blockIdx.x;
  bf16* xr = x + row * hdim;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hdim; i += THREADS) {
    float v = ld(xr + i);
    if (y) {
      v = rb(v + proj(y, bias, delta, row, i, hdim));
      xr[i] = __float2bfloat16_rn(v);
    }
    ss += v * v;
  }
  const float r = rsqrtf(block_sum<THREADS>(ss) / (float)hdim + eps);
  for (int i = threadIdx.x; i < hdim; i += THREADS) {
    const float o = rb((ld(xr + i) * r) * w[i]);
    out[row * hdim + i] = __float2bfloat16_rn(o);
    if (out32) out32[row * hdim + i] = o;
  }
}

// grid (ceil(I / 256), rows), block 256. gu (rows, 2I) = [gate | up] -> bf16(bf16(silu(g)) * u).
__global__ void silu_mul_kernel(const bf16* __restrict__ gu, const bf16* __restrict__ bias,
                                const float* __restrict__ delta, bf16* __restrict__ out, float* __restrict__ out32,
                                int inter) {
  const long long row = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= inter) return;
  const float g = proj(gu, bias, delta, row, i, 2 * inter);
  const float u = proj(gu, bias, delta, row, inter + i, 2 * inter);
  const float s = rb(g / (1.0f + expf(-g)));
  const float o = rb(s * u);
  out[row * inter + i] = __float2bfloat16_rn(o);
  if (out32) out32[row * inter + i] = o;
}

extern "C" {

int qerl_qkv_rope_cache(const void* y, const void* bias, const void* delta, const void* cos_t, const void* sin_t,
                        void* q_out, void* kc, void* vc, const void* slot, int rows, int heads, int kv_heads, int d,
                        long long cache_row, long long cache_head, int ld_y, void* stream) {
  if (d > 1024 || d % 2) return (int)cudaErrorInvalidValue;
  dim3 grid(rows, heads + 2 * kv_heads);
  qkv_rope_cache_kernel<<<grid, d, 0, (cudaStream_t)stream>>>(
      (const bf16*)y, (const bf16*)bias, (const float*)delta, (const bf16*)cos_t, (const bf16*)sin_t, (bf16*)q_out,
      (bf16*)kc, (bf16*)vc, (const int64_t*)slot, heads, kv_heads, d, cache_row, cache_head, ld_y);
  return (int)cudaGetLastError();
}

int qerl_add_rmsnorm(void* x, const void* y, const void* bias, const void* delta, const void* w, float eps, void* out,
                     void* out32, int rows, int hdim, void* stream) {
  add_rmsnorm_kernel<1024><<<rows, 1024, 0, (cudaStream_t)stream>>>(
      (bf16*)x, (const bf16*)y, (const bf16*)bias, (const float*)delta, (const float*)w, eps, (bf16*)out,
      (float*)out32, hdim);
  return (int)cudaGetLastError();
}

int qerl_silu_mul(const void* gu, const void* bias, const void* delta, void* out, void* out32, int rows, int inter,
                  void* stream) {
  dim3 grid((inter + 255) / 256, rows);
  silu_mul_kernel<<<grid, 256, 0, (cudaStream_t)stream>>>((const bf16*)gu, (const bf16*)bias, (const float*)delta,
                                                          (bf16*)out, (float*)out32, inter);
  return (int)cudaGetLastError();
}

const char* qerl_fused_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }
}

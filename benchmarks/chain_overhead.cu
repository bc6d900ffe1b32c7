// What the boundaries between the decode step's dependent launches cost, against the same phases
// inside one persistent kernel per layer: how much of a batch-1 layer is launch chain, not bytes.
//
// A 7B decoder layer at batch 1 runs nine dependent launches (q/k/v, RoPE + cache write,
// attention, o, add + RMSNorm, gate/up, SiLU * up, down, add + RMSNorm). Here each phase of a
// layer reads its own weights (plain coalesced 16-byte loads, no dequantization: bytes as the
// NVFP4 GEMMs stream them), reads all of the previous phase's output vector (every block, as a
// GEMM reads its activations) and writes its share of the next one. Phases' weights, MB, 7B shape:
// q/k/v 9.3, RoPE 0, attention 0.6 (a 1280-token KV window), o 7.2, norm 0, gate/up 76.3, SiLU 0,
// down 38.1, norm 0 (131.5 MB a layer; eight layers a replay, 1.05 GB, so L2 holds none of it).
// Rows (one CUDA graph of eight layers each, replayed; median of 7 timings of 20 replays):
// - kernels + PDL: one launch per phase with programmatic dependent launch, each thread's first
//   U weight loads issued before griddepcontrol.wait (as the NVFP4 kernels do).
// - kernels: the same launches in plain stream order.
// - persistent: one launch per layer, every block resident (2 per SM); a phase waits on an arrival
//   counter of the one before (each block's thread 0 adds 1 after its writes, a release; the
//   waiters read it with acquire loads), with its first U weight loads issued before that wait.
// - "+ L2 prefetch": as the row named, and once a block has done its share of a phase it asks L2
//   (cp.async.bulk.prefetch.L2, 8 KB a request) for its share of the next 16 MB of weights past
//   what the next phase's register preload reads (into the phase after that one when the next is
//   short), so that DRAM works through the boundaries.
// Each row is also run with every phase's weights left out (the chain alone), and the first row
// with one phase's weights at a time (that phase's cost over the chain alone, against its bytes at
// the coalesced read's rate). The last vector of every run is compared with the first row's, bit
// for bit (the persistent kernel's waits are right).
// Build and run on the GPU machine (no torch needed):
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/chain_overhead benchmarks/chain_overhead.cu && /tmp/chain_overhead
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../engine/kernels/nvfp4_unpack.cuh"  // the kernels' weight load

#define CK(x)                                                             \
  do {                                                                    \
    cudaError_t e_ = (x);                                                 \
    if (e_ != cudaSuccess) {                                              \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                       \
    }                                                                     \
  } while (0)

namespace {

constexpr int kThreads = 512;
constexpr int kBlocksPerSm = 2;
constexpr int kVec = 4096;   // floats passed from phase to phase
constexpr int kPhases = 9;
constexpr int kLayers = 8;
constexpr int U = 4;         // 16-byte loads in flight per thread (and issued before a wait)
constexpr double kPhaseMb[kPhases] = {9.3, 0.0, 0.6, 7.2, 0.0, 76.3, 0.0, 38.1, 0.0};

struct Phase {
  const int4* w;
  long long n16;  // 16-byte words
};
struct Layer {
  Phase p[kPhases];
};

// Phase q of this layer, or past its last one, of the next layer.
__host__ __device__ inline const Phase& phase_at(const Layer& cur, const Layer& next, int q) {
  return q < kPhases ? cur.p[q] : next.p[q - kPhases];
}

using qerl::ld_stream;  // the kernels' 16-byte weight load, not kept in L1

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The first U of this thread's words (grid-stride order), loaded before the phase may start.
__device__ __forceinline__ void preload(const Phase& ph, int4 (&pre)[U]) {
  const long long stride = (long long)gridDim.x * kThreads;
  const long long i0 = (long long)blockIdx.x * kThreads + threadIdx.x;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long i = i0 + u * stride;
    pre[u] = i < ph.n16 ? ld_stream(ph.w + i) : make_int4(0, 0, 0, 0);
  }
}

// This block's 8 KB chunks (the grid-stride order's) of bytes [from, to) of a phase's weights into
// L2: one bulk prefetch per chunk, by threads 0, 1, ... of the block.
__device__ __forceinline__ void prefetch_l2(const Phase& ph, long long from, long long to) {
  to = min(to, ph.n16 * 16);
  const long long chunk = (long long)kThreads * 16, step = chunk * gridDim.x;
  long long c = (from / step) * step + (long long)blockIdx.x * chunk;
  if (c < from) c += step;
  for (c += threadIdx.x * step; c < to; c += (long long)kThreads * step) {
    const unsigned bytes = (unsigned)min(chunk, to - c);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"((const char*)ph.w + c), "r"(bytes) : "memory");
  }
}

// After this block's share of a phase: the next weights into L2, kPrefetch bytes past what the
// next phase's register preload asks for (reaching into the phase after it when that one is short).
constexpr long long kPrefetch = 16ll << 20;
__device__ __forceinline__ void prefetch_next(const Phase& a, const Phase& b) {
  const long long pre = (long long)U * gridDim.x * kThreads * 16;  // the register preload's bytes
  prefetch_l2(a, pre, pre + kPrefetch);
  const long long left = kPrefetch + pre - a.n16 * 16;
  if (left > 0) prefetch_l2(b, pre, pre + left);
}

// One phase for this block: the mean of `in`, the xor of its weight words, its share of `out`.
__device__ void phase_body(const Phase& ph, const int4 (&pre)[U], const float* in, float* out, int tag) {
  __shared__ float s_sum[kThreads / 32];
  __shared__ unsigned s_x[kThreads / 32];
  const long long stride = (long long)gridDim.x * kThreads;
  const long long i0 = (long long)blockIdx.x * kThreads + threadIdx.x;
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kVec / kThreads; ++j) s += __ldcg(in + threadIdx.x + j * kThreads);
  unsigned x = 0;
#pragma unroll
  for (int u = 0; u < U; ++u) x ^= pre[u].x ^ pre[u].y ^ pre[u].z ^ pre[u].w;
  for (long long i = i0 + U * stride; i < ph.n16; i += U * stride) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = i + u * stride < ph.n16 ? ld_stream(ph.w + i + u * stride) : make_int4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    x ^= __shfl_xor_sync(0xffffffffu, x, o);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    s_sum[warp] = s;
    s_x[warp] = x;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
    unsigned y = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      t += s_sum[w];
      y ^= s_x[w];
    }
    s_sum[0] = t / kVec;
    s_x[0] = y;
  }
  __syncthreads();
  const float mean = s_sum[0];
  const unsigned wx = s_x[0];
  for (int i = blockIdx.x + gridDim.x * threadIdx.x; i < kVec; i += gridDim.x * kThreads)
    out[i] = 0.5f * mean + 1e-3f * (float)((wx >> (i & 15)) & 0xff) + 0.01f * (float)(tag + (i & 7));
  __syncthreads();  // s_sum / s_x are reused by the next phase
}

__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    phase_kernel(Phase ph, Phase next1, Phase next2, const float* in, float* out, int tag, int pdl, int pf) {
  int4 pre[U];
  preload(ph, pre);
  if (pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  phase_body(ph, pre, in, out, tag);
  if (pf) prefetch_next(next1, next2);
}

// One layer: phase p waits until every block has finished phase p - 1 (arrive[p - 1] == grid).
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    layer_kernel(Layer L, Layer next, float* vec, unsigned* arrive, int tag0, int pf) {
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the previous layer's launch has ended
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  for (int p = 0; p < kPhases; ++p) {
    int4 pre[U];
    preload(L.p[p], pre);
    if (p > 0) {
      if (threadIdx.x == 0)
        while (ld_acquire(arrive + p - 1) < gridDim.x) {
        }
      __syncthreads();
    }
    phase_body(L.p[p], pre, vec + (size_t)p * kVec, vec + (size_t)(p + 1) * kVec, tag0 + p);
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(arrive + p, 1u);
    }
    if (pf) {
      prefetch_next(phase_at(L, next, p + 1), phase_at(L, next, p + 2));
    }
  }
}

__global__ void fill(int4* p, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    p[i] = make_int4((int)(i * 2654435761u), (int)i, (int)(i >> 7), 12345);
}

__global__ void __launch_bounds__(kThreads) copy_read(const int4* p, long long n, unsigned* sink) {
  const long long stride = (long long)gridDim.x * kThreads;
  unsigned x = 0;
  for (long long i = (long long)blockIdx.x * kThreads + threadIdx.x; i < n; i += U * stride) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = i + u * stride < n ? ld_stream(p + i + u * stride) : make_int4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (x == 0x9e3779b9u) *sink = x;
}

}  // namespace

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, layer_kernel, kThreads, 0));
  if (per_sm < kBlocksPerSm) {
    std::fprintf(stderr, "only %d blocks of the layer kernel fit an SM\n", per_sm);
    return 1;
  }
  const int grid = sms * kBlocksPerSm;
  // weights: eight layers of the nine phases, each phase's bytes rounded to 16
  std::vector<long long> n16(kPhases);
  long long layer16 = 0;
  for (int p = 0; p < kPhases; ++p) layer16 += n16[p] = (long long)(kPhaseMb[p] * 1e6 / 16);
  int4* wbuf;
  CK(cudaMalloc(&wbuf, (size_t)layer16 * kLayers * 16));
  fill<<<1024, 256>>>(wbuf, layer16 * kLayers);
  const int nvec = kLayers * kPhases + 1;
  float *vec_ref, *vec;
  unsigned *arrive, *sink;
  CK(cudaMalloc(&vec_ref, (size_t)nvec * kVec * 4));
  CK(cudaMalloc(&vec, (size_t)nvec * kVec * 4));
  CK(cudaMalloc(&arrive, kLayers * kPhases * 4));
  CK(cudaMalloc(&sink, 4));
  std::vector<float> init(kVec);
  for (int i = 0; i < kVec; ++i) init[i] = 0.25f + 1e-3f * (i % 97);
  float* d_init;
  CK(cudaMalloc(&d_init, kVec * 4));
  CK(cudaMemcpy(d_init, init.data(), kVec * 4, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());

  auto layers = [&](unsigned mask) {  // the phases in mask read their weights
    std::vector<Layer> out(kLayers);
    long long off = 0;
    for (int l = 0; l < kLayers; ++l)
      for (int p = 0; p < kPhases; ++p) {
        out[l].p[p] = Phase{wbuf + off, (mask >> p) & 1 ? n16[p] : 0};
        off += n16[p];
      }
    return out;
  };
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaLaunchAttribute pdl_attr[1];
  pdl_attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl_attr[0].val.programmaticStreamSerializationAllowed = 1;
  auto config = [&](bool pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.stream = st;
    cfg.attrs = pdl_attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cfg;
  };
  // variants: 0 kernels + PDL, 1 kernels, 2 persistent, 3 kernels + PDL + L2 prefetch, 4 persistent + L2 prefetch
  auto record = [&](int variant, unsigned mask, float* v) {
    const auto Ls = layers(mask);
    const bool persistent = variant == 2 || variant == 4, pf = variant >= 3;
    CK(cudaMemcpyAsync(v, d_init, kVec * 4, cudaMemcpyDeviceToDevice, st));
    if (persistent) CK(cudaMemsetAsync(arrive, 0, kLayers * kPhases * 4, st));
    for (int l = 0; l < kLayers; ++l) {
      float* lv = v + (size_t)l * kPhases * kVec;
      const Layer& nxt = Ls[(l + 1) % kLayers];
      if (persistent) {
        auto cfg = config(true);
        CK(cudaLaunchKernelEx(&cfg, layer_kernel, Ls[l], nxt, lv, arrive + l * kPhases, l * kPhases, pf ? 1 : 0));
        continue;
      }
      for (int p = 0; p < kPhases; ++p) {
        auto cfg = config(variant != 1);
        CK(cudaLaunchKernelEx(&cfg, phase_kernel, Ls[l].p[p], phase_at(Ls[l], nxt, p + 1), phase_at(Ls[l], nxt, p + 2),
                              (const float*)(lv + (size_t)p * kVec), lv + (size_t)(p + 1) * kVec, l * kPhases + p,
                              variant != 1 ? 1 : 0, pf ? 1 : 0));
      }
    }
  };
  auto graph_of = [&](int variant, unsigned mask, float* v) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    record(variant, mask, v);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphDestroy(g));
    return ge;
  };
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time_graph = [&](cudaGraphExec_t ge) {
    for (int i = 0; i < 5; ++i) CK(cudaGraphLaunch(ge, st));
    CK(cudaStreamSynchronize(st));
    std::vector<float> ts;
    for (int r = 0; r < 7; ++r) {
      CK(cudaEventRecord(e0, st));
      for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ge, st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      ts.push_back(ms * 1e3f / 20 / kLayers);  // us per layer (the initial copy and memset included)
    }
    std::sort(ts.begin(), ts.end());
    return (double)ts[ts.size() / 2];
  };

  // copy bandwidth: a coalesced read of the eight layers' weights
  double read_us;
  {
    for (int i = 0; i < 3; ++i) copy_read<<<grid, kThreads, 0, st>>>(wbuf, layer16 * kLayers, sink);
    CK(cudaStreamSynchronize(st));
    std::vector<float> ts;
    for (int r = 0; r < 7; ++r) {
      CK(cudaEventRecord(e0, st));
      for (int i = 0; i < 5; ++i) copy_read<<<grid, kThreads, 0, st>>>(wbuf, layer16 * kLayers, sink);
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      ts.push_back(ms * 1e3f / 5 / kLayers);
    }
    std::sort(ts.begin(), ts.end());
    read_us = ts[ts.size() / 2];
  }
  const double layer_mb = layer16 * 16 / 1e6;
  std::printf("H200-class GPU: %d SMs, grid %d x %d threads; a layer's weights %.1f MB; one coalesced read of "
              "them %.2f us (%.2f TB/s)\n", sms, grid, kThreads, layer_mb, read_us, layer_mb / read_us);
  constexpr int kVariants = 5;
  const char* names[kVariants] = {"kernels + PDL", "kernels", "persistent", "kernels + PDL + L2 prefetch",
                                  "persistent + L2 prefetch"};
  const unsigned all = (1u << kPhases) - 1;
  double t[kVariants][2];
  std::vector<float> ref(kVec), got(kVec);
  bool ok = true;
  auto run = [&](int v, unsigned mask) {
    float* dst = v == 0 ? vec_ref : vec;
    cudaGraphExec_t ge = graph_of(v, mask, dst);
    const double us = time_graph(ge);
    CK(cudaGraphExecDestroy(ge));
    CK(cudaMemcpy((v == 0 ? ref : got).data(), dst + (size_t)(nvec - 1) * kVec, kVec * 4, cudaMemcpyDeviceToHost));
    if (v > 0 && std::memcmp(ref.data(), got.data(), kVec * 4) != 0) {
      std::printf("MISMATCH: %s (phases 0x%x) differs from kernels + PDL\n", names[v], mask);
      ok = false;
    }
    return us;
  };
  for (int w = 1; w >= 0; --w)
    for (int v = 0; v < kVariants; ++v) t[v][w] = run(v, w ? all : 0u);
  std::printf("\n| row | us a layer, 7B weights | us a layer, no weights (%d phases) | us a boundary (no weights / %d) |\n",
              kPhases, kPhases);
  std::printf("|---|---|---|---|\n");
  for (int v = 0; v < kVariants; ++v)
    std::printf("| %s | %.2f | %.2f | %.2f |\n", names[v], t[v][1], t[v][0], t[v][0] / kPhases);
  std::printf("| one coalesced read of the same bytes | %.2f | | |\n", read_us);
  std::printf("\nOne phase's weights at a time (kernels + PDL; the others' left out), us a layer over the chain alone:\n\n");
  std::printf("| phase | MB | us over no weights | bytes at the read's rate, us | excess, us |\n|---|---|---|---|---|\n");
  const char* phase_names[kPhases] = {"q/k/v", "RoPE + cache", "attention", "o", "add + norm", "gate/up", "SiLU * up",
                                      "down", "add + norm"};
  double excess = 0.0;
  for (int p = 0; p < kPhases; ++p) {
    if (n16[p] == 0) continue;
    const double us = run(0, 1u << p) - t[0][0], ideal = n16[p] * 16 / 1e6 / (layer_mb / read_us);
    excess += us - ideal;
    std::printf("| %s | %.1f | %.2f | %.2f | %.2f |\n", phase_names[p], n16[p] * 16 / 1e6, us, ideal, us - ideal);
  }
  std::printf("\nkernels + PDL: chain alone %.2f + phases' excess %.2f + bytes %.2f = %.2f us (measured %.2f)\n",
              t[0][0], excess, read_us, t[0][0] + excess + read_us, t[0][1]);
  std::printf("results %s\n", ok ? "bit-identical across rows" : "DIFFER");
  return ok ? 0 : 1;
}

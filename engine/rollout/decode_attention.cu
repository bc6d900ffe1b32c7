// Decode attention over the static KV cache of engine/rollout/cuda_graph.py: one new query token
// per row, grouped-query heads (the n_rep query heads of a kv head share its keys and values),
// bf16 inputs and output, bf16 tensor-core products with fp32 accumulation and fp32 softmax.
// Plain C entry point (no torch headers), launched on the caller's stream.
//
// Grid (splits, kv heads, rows), 4 warps a block, the splits of a (row, kv head) one thread
// block cluster. A block owns the n_rep query heads of one kv head and a range of keys; each of
// its warps takes chunks of 16 keys and keeps its own online softmax (base 2) over them:
// - scores: S (heads x 16 keys) = Q K^T as m16n8k16 MMAs, the query heads as A's rows (rows
//   n_rep.. are zero), the keys as B's columns. The order of the head dimensions inside a product
//   is free, so lane (g, t) of a warp loads, for k steps 2u and 2u+1, the 16 contiguous bytes at
//   dimensions 32u + 8t of its query head g and of its keys g and 8 + g: every fragment straight
//   from memory, no shared memory.
// - the scores' C layout (lane (g, t): head g, keys 2t, 2t+1, 8+2t, 9+2t of the chunk) is the B
//   layout of P^T in O^T = V^T P^T with the chunk's keys as its k dimension, so the probabilities
//   (rounded to bf16, as flash attention does) stay in registers, and the heads are the MMA's
//   n = 8 columns (none wasted). V^T is A (16 dims x 16 keys per MMA); lane (g, t) loads its keys'
//   rows at dimensions [g D/8, (g+1) D/8) and pairs the two keys of a register with a byte
//   permute, so rows g and g+8 of m-tile m are dimensions g D/8 + m and g D/8 + D/16 + m, and a
//   lane ends with heads 2t, 2t+1 at dimensions [g D/8, (g+1) D/8).
// - the warps' (max, sum, output) are merged through shared memory in warp order, then the
//   blocks of a cluster merge theirs through distributed shared memory: each block reads every
//   block's maxima and sums, then adds every block's outputs in split order for its own slice
//   of the (head, dimension) outputs. No workspace, no atomics: the result does not depend on
//   the order blocks run in.
// Masked columns (valid = false) and columns past the attention length get no weight (their
// values are read as zeros).
//
// Launched with programmatic dependent launch (../kernels/pdl.cuh): the kernel reads the queries
// and writes only after griddepcontrol.wait, and releases its dependents after it. Given the cache
// column that the previous kernel writes (the decode step's write column), each warp reads its
// first chunk's keys and values before the wait, so that the cache's DRAM latency overlaps the
// previous kernel, and reads that one column again after it.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "../kernels/mma.cuh"
#include "../kernels/pdl.cuh"

typedef __nv_bfloat16 bf16;
namespace cg = cooperative_groups;

namespace {

constexpr int kChunk = 16;  // keys per warp step
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxRep = 8;  // query heads per kv head
constexpr int kMaxSplits = 8;  // blocks of a cluster (the portable limit)

using qerl::mma_m16n8k16_bf16;
using qerl::word;

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <int D>
struct Chunk {
  static constexpr int KU = D / 32;  // 16-byte key pieces per key row (two k steps each)
  static constexpr int VU = D / 64;  // 16-byte value pieces per key row ([g D/8, (g+1) D/8))
  uint4 k[2][KU];                    // keys g and 8 + g
  uint4 v[4][VU];                    // keys 2t, 2t+1, 2t+8, 2t+9
  bool ok[4];                        // those four keys count
};

template <int D>
__global__ void __launch_bounds__(kThreads)
decode_attention_kernel(const bf16* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
                        long long cache_row, long long cache_head, const uint8_t* __restrict__ valid, int ld_valid,
                        bf16* __restrict__ out, const long long* __restrict__ slot_p, int n_rep, int s,
                        int keys_per_split, float scale_log2) {
  using C = Chunk<D>;
  constexpr int MT = D / 16;  // m-tiles of the output (16 dimensions each)
  constexpr int KS = D / 16;  // k steps of the scores
  constexpr int DG = D / 8;   // output dimensions per lane and head: [g DG, (g + 1) DG)
  constexpr int SEG = DG + 1; // a (head, g) segment in shared memory, padded
  __shared__ float sm_o[kWarps * kMaxRep * 8 * SEG];
  __shared__ float sm_m[kWarps][kMaxRep], sm_l[kWarps][kMaxRep];
  __shared__ float co[kMaxRep * D];                       // this block's merged outputs (unnormalised)
  __shared__ float cm[kMaxRep], cl[kMaxRep];              // and maxima, sums
  __shared__ float wts[kMaxSplits][kMaxRep];              // each block's weight in the final output

  const int split = blockIdx.x, kvg = blockIdx.y, b = blockIdx.z, splits = gridDim.x, kvh = gridDim.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const long long head0 = (long long)b * kvh * n_rep + (long long)kvg * n_rep;  // first query head of the group
  const bf16* kb = kc + b * cache_row + kvg * cache_head;
  const bf16* vb = vc + b * cache_row + kvg * cache_head;
  const uint8_t* vrow = valid + (long long)b * ld_valid;
  const int k0 = split * keys_per_split, k1 = min(s, k0 + keys_per_split);

  // key rows: of the scores (g, 8 + g) and of the values (2t, 2t+1, 2t+8, 2t+9), within a chunk
  auto vkey = [&](int e) { return 2 * t + (e & 1) + 8 * (e >> 1); };
  auto load_k = [&](C& c, int base, int j) {
    const int key = base + 8 * j + g;
#pragma unroll
    for (int u = 0; u < C::KU; ++u)
      c.k[j][u] = key < k1 ? *reinterpret_cast<const uint4*>(kb + (long long)key * D + 32 * u + 8 * t)
                           : make_uint4(0u, 0u, 0u, 0u);
  };
  auto load_v = [&](C& c, int base, int e) {
    const int key = base + vkey(e);
    c.ok[e] = key < k1 && vrow[key] != 0;
#pragma unroll
    for (int u = 0; u < C::VU; ++u)
      c.v[e][u] = c.ok[e] ? *reinterpret_cast<const uint4*>(vb + (long long)key * D + g * (D / 8) + 8 * u)
                          : make_uint4(0u, 0u, 0u, 0u);
  };
  auto load_chunk = [&](C& c, int base) {
    load_k(c, base, 0);
    load_k(c, base, 1);
#pragma unroll
    for (int e = 0; e < 4; ++e) load_v(c, base, e);
  };

  const int first = k0 + kChunk * warp;
  C ch;
  const int slot = slot_p != nullptr ? (int)*slot_p : -1;
  if (slot_p != nullptr && first < k1) load_chunk(ch, first);
  qerl::pdl_wait_then_release();
  if (first < k1) {
    if (slot_p == nullptr) {
      load_chunk(ch, first);
    } else if (slot >= first && slot < first + kChunk) {  // the column the previous kernel wrote, again
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (first + 8 * j + g == slot) load_k(ch, first, j);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (first + vkey(e) == slot) load_v(ch, first, e);
    }
  }

  // query head g (zero past n_rep) as the A fragments of the k steps: (a0, a2) of step 2u + h are
  // words 2h, 2h + 1 of the 16 bytes at dimensions 32u + 8t
  uint32_t qa[KS][2];
#pragma unroll
  for (int u = 0; u < C::KU; ++u) {
    const uint4 v = g < n_rep ? *reinterpret_cast<const uint4*>(q + (head0 + g) * D + 32 * u + 8 * t)
                              : make_uint4(0u, 0u, 0u, 0u);
    qa[2 * u][0] = v.x;
    qa[2 * u][1] = v.y;
    qa[2 * u + 1][0] = v.z;
    qa[2 * u + 1][1] = v.w;
  }

  // O^T (dimensions x heads) = V^T P^T: lane (g, t) accumulates heads 2t, 2t+1 at dimensions
  // g DG + m (c0, c1) and g DG + MT + m (c2, c3) of m-tile m
  float o[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  float m = -INFINITY, l = 0.f;  // head g's running max and this lane's share of the sum
  for (int base = first; base < k1; base += kChunk * kWarps) {
    if (base != first) load_chunk(ch, base);
    float sc[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        const uint4& kv = ch.k[j][kk >> 1];
        mma_m16n8k16_bf16(sc[j], qa[kk][0], 0u, qa[kk][1], 0u, word(kv, 2 * (kk & 1)), word(kv, 2 * (kk & 1) + 1));
      }
    }
    // lane's scores: keys 2t, 2t+1 (n-tile 0) and 8+2t, 9+2t (n-tile 1) = value keys e = 0..3
    float x[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = ch.ok[e] ? sc[e >> 1][e & 1] * scale_log2 : -INFINITY;
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    const float corr = m == -INFINITY ? 0.f : exp2f(m - m_new);
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) p[e] = x[e] == -INFINITY ? 0.f : exp2f(x[e] - m_new);
    l = l * corr + ((p[0] + p[1]) + (p[2] + p[3]));
    m = m_new;
    // P^T as B: (keys 2t, 2t+1 | 2t+8, 2t+9) x head g, as the scores left them
    const uint32_t pb0 = pack_bf16(p[0], p[1]), pb1 = pack_bf16(p[2], p[3]);
    const float c_lo = __shfl_sync(0xffffffffu, corr, 8 * t), c_hi = __shfl_sync(0xffffffffu, corr, 8 * t + 4);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      o[mt][0] *= c_lo;
      o[mt][1] *= c_hi;
      o[mt][2] *= c_lo;
      o[mt][3] *= c_hi;
      // V^T as A: rows g, g + 8 = dimensions g DG + mt, g DG + MT + mt; keys paired per register
      uint32_t a[4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int n = r * MT + mt, u = n >> 3, w = (n & 7) >> 1;
        const uint32_t sel = (n & 1) ? 0x7632u : 0x5410u;
        a[r] = __byte_perm(word(ch.v[0][u], w), word(ch.v[1][u], w), sel);
        a[r + 2] = __byte_perm(word(ch.v[2][u], w), word(ch.v[3][u], w), sel);
      }
      mma_m16n8k16_bf16(o[mt], a[0], a[1], a[2], a[3], pb0, pb1);
    }
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);

  // -- merge the warps (in warp order): segment (warp, head, g) holds dimensions [g DG, (g+1) DG)
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int h = 2 * t + hh;
    if (h < n_rep) {
      float* seg = sm_o + ((warp * kMaxRep + h) * 8 + g) * SEG;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        seg[mt] = o[mt][hh];
        seg[MT + mt] = o[mt][2 + hh];
      }
    }
  }
  if (g < n_rep && t == 0) {
    sm_m[warp][g] = m;
    sm_l[warp][g] = l;
  }
  __syncthreads();
  if (threadIdx.x < n_rep) {
    const int h = threadIdx.x;
    float mb = -INFINITY, lb = 0.f;
    for (int w = 0; w < kWarps; ++w) mb = fmaxf(mb, sm_m[w][h]);
    for (int w = 0; w < kWarps; ++w) {
      const float mw = sm_m[w][h];
      const float e = mw == -INFINITY ? 0.f : exp2f(mw - mb);
      sm_m[w][h] = e;  // now the warp's weight
      lb = fmaf(e, sm_l[w][h], lb);
    }
    cm[h] = mb;
    cl[h] = lb;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n_rep * D; i += kThreads) {
    const int h = i / D, d = i % D;
    const int at = (h * 8 + d / DG) * SEG + d % DG;
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) acc = fmaf(sm_m[w][h], sm_o[w * kMaxRep * 8 * SEG + at], acc);
    co[i] = acc;
  }
  if (splits == 1) {
    __syncthreads();
    for (int i = threadIdx.x; i < n_rep * D; i += kThreads) {
      const float lb = cl[i / D];
      out[head0 * D + i] = __float2bfloat16_rn(lb > 0.f ? co[i] / lb : 0.f);
    }
    return;
  }

  // -- merge the blocks of the cluster (split order): every block's max and sum, then this
  // block's slice of the outputs from every block's shared memory
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  if (threadIdx.x < n_rep) {
    const int h = threadIdx.x;
    float mj[kMaxSplits], lj[kMaxSplits];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kMaxSplits; ++j) {
      mj[j] = j < splits ? cluster.map_shared_rank(cm, j)[h] : -INFINITY;
      lj[j] = j < splits ? cluster.map_shared_rank(cl, j)[h] : 0.f;
      mx = fmaxf(mx, mj[j]);
    }
    float den = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxSplits; ++j) {
      mj[j] = mj[j] == -INFINITY ? 0.f : exp2f(mj[j] - mx);
      den = fmaf(mj[j], lj[j], den);
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
#pragma unroll
    for (int j = 0; j < kMaxSplits; ++j)
      if (j < splits) wts[j][h] = mj[j] * inv;
  }
  __syncthreads();
  const int total = n_rep * D, per = (total + splits - 1) / splits;
  const int i0 = split * per, i1 = min(total, i0 + per);
  for (int i = i0 + threadIdx.x; i < i1; i += kThreads) {
    const int h = i / D;
    float acc = 0.f;
    for (int j = 0; j < splits; ++j) acc = fmaf(wts[j][h], cluster.map_shared_rank(co, j)[i], acc);
    out[head0 * D + i] = __float2bfloat16_rn(acc);
  }
  cluster.sync();  // no block leaves while another reads its shared memory
}

template <int D>
cudaError_t launch(dim3 grid, void* stream, const bf16* q, const bf16* kc, const bf16* vc, long long cache_row,
                   long long cache_head, const uint8_t* valid, int ld_valid, bf16* out, const long long* slot,
                   int n_rep, int s, int keys_per_split, float scale_log2) {
  return qerl::launch_pdl_cluster(decode_attention_kernel<D>, grid, dim3(kThreads), dim3(grid.x, 1, 1), 0, stream,
                                  q, kc, vc, cache_row, cache_head, valid, ld_valid, out, slot, n_rep, s,
                                  keys_per_split, scale_log2);
}

}  // namespace

extern "C" {

// q (rows, kv_heads * n_rep, d) contiguous; kc, vc: one layer of the cache, element (row, kv head,
// column, dim) at row * cache_row + head * cache_head + column * d + dim; valid (rows, ld_valid)
// bool; out (rows, kv_heads * n_rep * d). Columns [0, s) in splits (<= 8) of keys_per_split (a
// multiple of 16) each, none empty. slot: null, or the one cache column (an int64 on the device)
// that the previous kernel of the stream writes, so that every other column may be read before
// that kernel ends.
int qerl_decode_attention(const void* q, const void* kc, const void* vc, long long cache_row, long long cache_head,
                          const void* valid, int ld_valid, void* out, const void* slot, int rows, int kv_heads,
                          int n_rep, int d, int s, int splits, int keys_per_split, float scale_log2, void* stream) {
  if (n_rep < 1 || n_rep > kMaxRep || s < 1 || splits < 1 || splits > kMaxSplits || keys_per_split < kChunk ||
      keys_per_split % kChunk || (long long)splits * keys_per_split < s || (long long)(splits - 1) * keys_per_split >= s)
    return (int)cudaErrorInvalidValue;
  const dim3 grid(splits, kv_heads, rows);
  const bf16 *qq = static_cast<const bf16*>(q), *k = static_cast<const bf16*>(kc), *v = static_cast<const bf16*>(vc);
  const uint8_t* va = static_cast<const uint8_t*>(valid);
  bf16* o = static_cast<bf16*>(out);
  const long long* sl = static_cast<const long long*>(slot);
  if (d == 128)
    return (int)launch<128>(grid, stream, qq, k, v, cache_row, cache_head, va, ld_valid, o, sl, n_rep, s,
                            keys_per_split, scale_log2);
  if (d == 64)
    return (int)launch<64>(grid, stream, qq, k, v, cache_row, cache_head, va, ld_valid, o, sl, n_rep, s,
                           keys_per_split, scale_log2);
  return (int)cudaErrorInvalidValue;
}

const char* qerl_decode_attention_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

}  // extern "C"

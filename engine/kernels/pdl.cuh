// Programmatic dependent launch (PDL) for qerl's kernels: a kernel launched with programmatic
// stream serialization may start while the previous kernel of the stream drains. Each kernel
// touches nothing an earlier kernel writes, and writes nothing, before griddepcontrol.wait (which
// returns once the previous kernel has finished and its writes are visible; at once when the
// launch was not programmatic), and signals launch_dependents only after that wait: so when a
// kernel starts, every kernel but its direct predecessor has finished, whoever launched them.
// QERL_PDL=0 (read at every launch) launches without it.
#pragma once

#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

namespace qerl {

// Wait for the previous kernel of the stream (its writes visible), then let the next one start.
// A second call returns at once.
__device__ __forceinline__ void pdl_wait_then_release() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

inline bool pdl_enabled() {
  const char* v = getenv("QERL_PDL");
  return v == nullptr || strcmp(v, "0") != 0;
}

inline cudaLaunchConfig_t pdl_config(dim3 grid, dim3 block, size_t smem, void* stream, cudaLaunchAttribute* attr) {
  attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr->val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  return cfg;
}

// kernel<<<grid, block, smem, stream>>>(args...), with PDL if enabled.
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, void* stream, Args... args) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = pdl_config(grid, block, smem, stream, &attr);
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

// The same in clusters of `cluster` blocks (each of grid's dimensions a multiple of cluster's).
template <typename... Params, typename... Args>
cudaError_t launch_pdl_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, dim3 cluster, size_t smem,
                               void* stream, Args... args) {
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t cfg = pdl_config(grid, block, smem, stream, attr);  // attr[0]: PDL, if enabled
  cudaLaunchAttribute& dims = attr[cfg.numAttrs++];
  dims.id = cudaLaunchAttributeClusterDimension;
  dims.val.clusterDim.x = cluster.x;
  dims.val.clusterDim.y = cluster.y;
  dims.val.clusterDim.z = cluster.z;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

// The same for a kernel chosen at run time (fn) and its argument pointers.
inline cudaError_t launch_pdl(const void* fn, dim3 grid, dim3 block, size_t smem, void* stream, void** args) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = pdl_config(grid, block, smem, stream, &attr);
  const cudaError_t err = cudaLaunchKernelExC(&cfg, fn, args);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace qerl

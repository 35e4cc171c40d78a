// Host-side launch helpers shared by the kernel launchers.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include <cuda_runtime.h>

namespace jax_flash_mla {

// Throws "jax_flash_mla <who>: <what>: <CUDA error>"; the FFI handlers turn it
// into an ffi::Error, so nothing unwinds into XLA.
inline void check_cuda(cudaError_t e, const char* who, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("jax_flash_mla ") + who + ": " + what + ": " + cudaGetErrorString(e));
}

// Launches `kernel` with programmatic dependent launch allowed: its grid may
// start while the previous kernel of the stream drains, so it must wait
// (griddepcontrol.wait / cudaGridDependencySynchronize) before reading that
// kernel's output. This hides the launch gap between decode and combine.
template <class... KernelArgs, class... Args>
void launch_with_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                     const char* who, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), who, "launch");
  check_cuda(cudaGetLastError(), who, "launch (last error)");
}

}  // namespace jax_flash_mla

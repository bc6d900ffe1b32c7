"""GPU kernels for the frozen base: NVFP4 weight-only GEMM on Hopper, torch fallback elsewhere.

Importing this package needs neither a GPU nor a compiler; the CUDA code is built at first use.
"""
from engine.kernels.nvfp4_gemm import (
    PreparedNVFP4,
    available,
    nvfp4_matmul,
    nvfp4_matmul_t,
    prepare,
    prepare_model,
    prepare_tensors,
)

nvfp4_available = available

__all__ = ["PreparedNVFP4", "available", "nvfp4_matmul", "nvfp4_matmul_t", "prepare", "prepare_model", "prepare_tensors",
           "nvfp4_available"]

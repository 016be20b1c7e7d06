"""GPU kernels of the project (Triton). Import lazily: Triton is a GPU-side dependency.

`qerl_lib.kernels.nvfp4_triton` holds the fused NVFP4 (W4A16, compressed-tensors layout)
dequantize-and-multiply kernels (and the one-kernel dequantization); `nvfp4_backends` wraps
them as the backends `qerl_lib.nvfp4_linear.NVFP4Linear` uses on CUDA; `nvfp4_gemv` is the rollout
engine's decode GEMM (1-64 rows, LoRA fused). See docs/kernels.md.
"""

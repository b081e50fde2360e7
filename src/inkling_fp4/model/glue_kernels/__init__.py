"""The model's elementwise glue as hand-written Triton kernels, one autograd Function per function.

common.py             numerics contract, interpreter-safe FP32 helpers, tile choice, launch plumbing
norm_kernels.py       rms_norm and add_rms_norm (the residual add fused with the next norm)
gated_norm_kernels.py skip_gated_rms_norm (Mamba-2's D skip with the gated group norm)
pointwise_kernels.py  squared_relu and dt_softplus

Each public function has the signature and math of its plain PyTorch reference in
:mod:`inkling_fp4.model.norm`, :mod:`~inkling_fp4.model.mlp` or :mod:`~inkling_fp4.model.mamba2`, which
reach it through :func:`inkling_fp4.model.compiled.cuda_kernel` on CUDA tensors. Importing this package
imports triton, which is why nothing imports it until a CUDA tensor needs it.
"""

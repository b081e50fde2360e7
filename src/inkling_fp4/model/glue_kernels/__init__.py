"""The model's elementwise glue as hand-written Triton kernels, one autograd Function per function:
norm_kernels.py (rms_norm, add_rms_norm), gated_norm_kernels.py (skip_gated_rms_norm),
pointwise_kernels.py (squared_relu, dt_softplus), on the shared common.py.

Each has the signature and math of its PyTorch reference, which reaches it through
``compiled.cuda_kernel``. Importing this package imports triton, so only a CUDA tensor triggers it.
"""

"""The hybrid Mamba-2 / attention / MLP language model (Nemotron-H style).

Model: config.py, presets.py (named sizes); hybrid.py (HybridLM); mamba2.py (the mixer), conv.py,
ssd.py (the scan); attention.py; mlp.py; norm.py; loss.py (chunked LM head + cross-entropy);
packing.py (document boundaries); vocab.py (growing the vocabulary); flops.py (for MFU).

Decoding: cache.py, attention_decode.py, mamba2_decode.py, decode_kernels.py, graphed_decoder.py
(the step as one CUDA graph).

Kernels, each beside its torch reference: ssd_triton.py (ssd_kernels/), conv_triton.py, and
compiled.py, which runs the elementwise glue through glue_kernels/ or torch.compile.

Fused FP8 training paths (delayed scaling), swapped in by the trainer, never branched on here:
fused_fp8/ (layers.py and the paths it calls); grad_slab.py.
"""

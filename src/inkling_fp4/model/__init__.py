"""The hybrid Mamba-2 / attention / MLP language model (Nemotron-H style).

config.py      ModelConfig: the pattern and the sizes of the three block types
presets.py     named sizes: tiny, hybrid-125m, hybrid-350m, nemotron-h-12b
hybrid.py      HybridLM: embedding, pre-norm blocks from the pattern, final norm, LM head; generation
mamba2.py      the Mamba-2 mixer: in_proj, conv, SSD scan, gated norm, out_proj
conv.py        the depthwise causal conv with document resets (reference and fused)
ssd.py         the SSD scan: chunked reference, token recurrence, dispatcher to the Triton kernel
ssd_triton.py  the Triton SSD kernel (ssd_kernels/ holds its pieces)
attention.py   grouped-query causal attention without positional embedding
mlp.py         squared-ReLU MLP
mlp_fp8.py     the MLP under delayed-scaled FP8: its squared ReLU computed inside the quantizers
in_proj_fp8.py Mamba-2's in_proj under delayed FP8: its output gradient written as FP8 by the consumers
norm.py        RMSNorm and the grouped, gated RMSNorm of Mamba-2
compiled.py    how the glue functions run on CUDA: a Triton kernel (glue_kernels/) or torch.compile
loss.py        the chunked LM head + cross-entropy (no full logits)
packing.py     document boundaries of packed batches (segment ids, attention mask)
cache.py       the inference cache (KV, conv window, SSM state, per-sequence lengths)
flops.py       training FLOPs per token, for MFU
"""

"""The hybrid Mamba-2 / attention / MLP language model (Nemotron-H style).

The math:
config.py        ModelConfig: the pattern and the sizes of the three block types
presets.py       named sizes: tiny, hybrid-125m, hybrid-350m, nemotron-h-12b
hybrid.py        HybridLM: embedding, pre-norm blocks from the pattern, final norm, LM head; generation
mamba2.py        the Mamba-2 mixer: in_proj, conv, SSD scan, gated norm, out_proj
conv.py          the depthwise causal conv with document resets (reference and fused)
ssd.py           the SSD scan: chunked reference, token recurrence, dispatcher to the Triton kernel
attention.py     grouped-query causal attention without positional embedding
mlp.py           squared-ReLU MLP
norm.py          RMSNorm and the grouped, gated RMSNorm of Mamba-2
loss.py          the chunked LM head + cross-entropy (no full logits)
packing.py       document boundaries of packed batches (segment ids, attention mask)
vocab.py         growing the vocabulary of a trained model (new embedding and LM-head rows)
flops.py         training FLOPs per token, for MFU

Decoding:
cache.py             the inference cache (KV, conv window, SSM state, per-sequence lengths)
attention_decode.py  one new query per sequence against its cached keys
mamba2_decode.py     one Mamba-2 step between its two GEMMs, fused kernel and torch twin
decode_kernels.py    the Triton kernels of the decoding step
graphed_decoder.py   the decode step as one CUDA graph per batch-size bucket

Kernels (each beside its torch reference):
ssd_triton.py    the Triton SSD kernel (ssd_kernels/ holds its pieces)
conv_triton.py   the causal depthwise conv + SiLU as Triton kernels
compiled.py      how the glue functions run on CUDA: a Triton kernel (glue_kernels/) or torch.compile

Fused FP8 training paths (delayed scaling), swapped in by the trainer, never branched on here:
fused_fp8_layers.py  fuse_fp8(model): the layers' fused variants, which call the paths below
mlp_fp8.py       the MLP: its squared ReLU computed inside the quantizers
in_proj_fp8.py   Mamba-2's in_proj: its output gradient written as FP8 by the consumers
norm_fp8.py      the block's pre-norm writes the mixer's first x as FP8
out_proj_fp8.py  Mamba-2's output norm writes out_proj's x as FP8
residual_fp8.py  the output projections' gradient written as FP8 by the next norm's backward
grad_slab.py     one gradient buffer for a tensor split into column blocks, written in place
"""

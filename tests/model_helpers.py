"""Helpers for the model tests: random SSD inputs, and models whose GEMMs are exact.

QuantLinear computes in BF16 by design. The tests of masking, padding and caching want to see logic
errors, not rounding, so :func:`exact_model` runs the whole model in FP64 with each QuantLinear's GEMM
replaced by an FP64 ``F.linear``; then two computations that are mathematically equal agree to ~1e-12.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.precision.quant_linear import QuantLinear


def ssd_inputs(b, l, h, p, g, n, dtype=torch.float64, generator=None):
    """x, dt (> 0), A (< 0), B, C with the shapes of :func:`inkling_fp4.model.ssd.ssd_reference`."""
    kw = dict(dtype=dtype, generator=generator)
    x = torch.randn(b, l, h, p, **kw)
    dt = torch.rand(b, l, h, **kw) * 0.5 + 0.01
    A = -(torch.rand(h, **kw) * 4 + 0.1)
    B = torch.randn(b, l, g, n, **kw)
    C = torch.randn(b, l, g, n, **kw)
    return x, dt, A, B, C


def random_doc_ids(b, l, n_docs, generator=None):
    """[b, l] int32 document ids with ``n_docs - 1`` random boundaries per row; ids repeat (0, 1, 0, ...)
    so only changes can mark boundaries."""
    doc = torch.zeros(b, l, dtype=torch.int32)
    for row in range(b):
        cuts = torch.randperm(l - 1, generator=generator)[: n_docs - 1] + 1
        for cut in cuts.tolist():
            doc[row, cut:] += 1
    return doc % 2


def _exact_forward(self, x, pair_x=None, dy_fp8=None):
    assert pair_x is None and dy_fp8 is None, "an exact model has no FP8 operands"
    return F.linear(x, self.weight.to(x.dtype))


def exact_model(cfg: ModelConfig, seed: int = 0) -> HybridLM:
    """A HybridLM in FP64 whose QuantLinear GEMMs are plain FP64 matmuls."""
    torch.manual_seed(seed)
    model = HybridLM(cfg).double()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.forward = types.MethodType(_exact_forward, m)
    return model


SMALL_RUN = [
    "model.pattern=M*-M",
    "model.vocab_size=512",
    "model.d_model=32",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=64",
    "model.mamba_heads=4",
    "model.mamba_head_dim=16",
    "model.n_groups=1",
    "model.d_state=8",
    "model.chunk_size=16",
    "data.vocab_size=512",
    "data.seq_len=32",
    "data.max_documents=30",
    "train.batch_size=4",
    "train.log_every=1",
    "train.checkpoint_every=0",
    "eval.batches=1",
    "log.progress=false",
]
"""Overrides of the tiny recipe for a training run of a few seconds on CPU (a Mamba, an attention and
an MLP layer); tests add their own steps, schedule and evaluation."""

"""The decode step as one CUDA graph per batch-size bucket.

A small model's decode step is some hundred microsecond launches, so eagerly it waits on the host;
replayed as a graph it is one launch. That works because every shape is static for a given cache and no
kernel takes a host value that changes per token: positions live on the device (``cache.lengths``).
n sequences run in the graph of :func:`batch_bucket` (n), the surplus rows as padding.

NOTE the returned logits are the graph's output buffer, overwritten by the next replay. A later
``prefill`` into the same cache keeps the graph valid; another cache needs another graph. The capture
runs with autocast's cast cache off: a cast cached outside the graph would be freed while it reads it.
Quantized forwards are captured as in ``precision/graph_capture.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from inkling_fp4.errors import UserError
from inkling_fp4.model.cache import InferenceCache
from inkling_fp4.model.compiled import glue_enabled
from inkling_fp4.precision import finite_guard
from inkling_fp4.precision.graph_capture import graph_blocker, quantized_graph

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Batch sizes a decode graph is captured for (a larger batch is its own bucket)."""


def batch_bucket(n: int) -> int:
    """The batch size of the graph that decodes ``n`` sequences: the smallest bucket >= n."""
    if n < 1:
        raise ValueError(f"batch_bucket: a batch has at least one sequence, got {n}")
    return next((b for b in BUCKETS if b >= n), n)


def cache_tensors(cache: InferenceCache) -> list[torch.Tensor]:
    """Every tensor of ``cache``: the lengths and each layer's state."""
    tensors = [cache.lengths]
    for state in cache.layers:
        if state is not None:
            tensors += [t for f in state.__dataclass_fields__ if (t := getattr(state, f)) is not None]
    return tensors


class GraphedDecoder:
    """``model.decode_step(tokens, cache)`` for this ``cache``, replayed as one CUDA graph. ``warmup``
    eager steps run first on a side stream, on the cache zeroed and then restored."""

    def __init__(self, model: nn.Module, cache: InferenceCache, warmup: int = 2):
        device = cache.lengths.device
        if device.type != "cuda":
            raise ValueError(f"GraphedDecoder needs a CUDA cache, got one on {device}")
        blocker = graph_blocker(model, 1, device)
        if blocker is not None:
            raise ValueError(f"the decode step cannot be captured as a CUDA graph: {blocker}")
        if not glue_enabled():  # the attention twin slices the cache at a host-side length (cache.longest)
            raise ValueError(
                "the decode step's torch twins (reference_glue) cannot be captured: they read the "
                "cache's length on the host, which a replay would not update"
            )
        if cache.max_len < warmup + 1:
            raise ValueError(f"GraphedDecoder: a cache of max_len {cache.max_len} is too short to warm up")
        self.model = model
        self.cache = cache
        self.tokens = torch.zeros(cache.batch_size, dtype=torch.long, device=device)  # [B] the input
        autocast = dict(
            device_type="cuda",
            dtype=torch.get_autocast_dtype("cuda"),
            enabled=torch.is_autocast_enabled("cuda"),
            cache_enabled=False,
        )
        saved = [t.clone() for t in cache_tensors(cache)]
        longest = cache.longest
        for t in cache_tensors(cache):
            t.zero_()
        cache.longest = 0
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.autocast(**autocast):
            for _ in range(warmup):
                model.decode_step(self.tokens, cache)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        cache.longest = 0
        with quantized_graph(self.graph, device) as self.records, torch.autocast(**autocast):
            self.logits = model.decode_step(self.tokens, cache)  # [B, V], the graph's output buffer
        for t, s in zip(cache_tensors(cache), saved, strict=True):
            t.copy_(s)
        cache.longest = longest

    @property
    def batch_size(self) -> int:
        return self.cache.batch_size

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B] -> the next logits [B, V]: the graph's buffer, valid until the next call."""
        cache = self.cache
        if cache.longest >= cache.max_len:
            raise UserError(f"decode_step: the cache is full ({cache.max_len} tokens); allocate a longer one")
        self.tokens.copy_(tokens)
        self.graph.replay()
        finite_guard.record_replay(self.records)  # the quantized operands' amaxes, for the NaN/Inf check
        cache.longest += 1
        return self.logits

"""The sampler's decode step as CUDA graphs: per batch bucket one preallocated cache and one captured
step, kept across ``generate`` calls.

Why kept: an RL run calls ``generate`` every step, and a capture costs more than the steps it would
speed up. So each bucket (``batch_bucket``) holds a cache of fixed ``max_len`` (a power of two) and
the :class:`GraphedDecoder` captured on it; a later prefill into it keeps the graph valid.

Padding: rows past n are copies of row 0 (its prompt, its token every step), outputs dropped. Copies
change no real row under any recipe: with row-wise arithmetic (BF16, NVFP4 ``activation_scale=row``)
trivially; under tensorwise activation scales because a copy holds no value row 0 does not, so the
amax and every real row's codes are those without padding (zero rows cannot be held at zero in
decode). Only the GEMM kernel picked for another row count may move the last bit.

Staleness: a graph replays captured addresses. Parameters are updated in place and held quantized
weights refreshed in place (``precision/held_operand.py``), but the recipes' kernels are fixed at
capture. So graphs are keyed on what they read (:func:`graph_key`: parameter and buffer addresses,
each QuantLinear's recipe and held operand's addresses); any change drops and recaptures them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from inkling_fp4.model.cache import InferenceCache
from inkling_fp4.model.graphed_decoder import GraphedDecoder, batch_bucket
from inkling_fp4.precision.held_operand import operand_tensors
from inkling_fp4.precision.quant_linear import QuantLinear


def log_to_stderr(line: str) -> None:
    """The fallback's one line, on stderr: stdout may carry completions (``fp4train generate``)."""
    print(line, file=sys.stderr, flush=True)


def graph_key(model: nn.Module) -> tuple:
    """What a captured decode step depends on besides the cache (see the module docstring)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    tensors = tuple((n, t.data_ptr(), t.dtype, tuple(t.shape)) for n, t in named)
    layers = []
    for m in model.modules():
        if isinstance(m, QuantLinear):
            held = m.frozen_weight()
            addresses = None if held is None else tuple(t.data_ptr() for t in operand_tensors(held))
            layers.append((m.recipe, addresses))
    return tensors, tuple(layers)


def cache_len(needed: int, bound: int | None) -> int:
    """A bucket cache's ``max_len``: ``needed`` rounded up to a power of two (>= 64), at most ``bound``."""
    n = max(64, 1 << (needed - 1).bit_length())
    return max(needed, min(n, bound)) if bound is not None else n


@dataclass
class Slot:
    """One bucket: its cache and the decode step captured on it (None: decoded eagerly)."""

    cache: InferenceCache
    decoder: GraphedDecoder | None


class DecodeGraphs:
    """The buckets' caches and graphs of one model. ``capture=False`` keeps caches and padding but
    decodes eagerly (how the padding is tested on the CPU)."""

    def __init__(self, model: nn.Module, capture: bool = True, log: Callable[[str], None] = log_to_stderr):
        self.model = model
        self.capture = capture
        self.log = log
        self.slots: dict[int, Slot] = {}
        self.failed: set[int] = set()
        """Buckets whose capture failed: they decode eagerly, without padding, from then on."""
        self.key: tuple | None = None
        self.setup_s = 0.0
        """Seconds spent allocating caches and capturing graphs (once per bucket, not per generation)."""

    def check(self) -> None:
        """Drop every graph if what they captured changed (:func:`graph_key`); call it per generate."""
        key = graph_key(self.model)
        if key != self.key:
            self.slots.clear()
            self.failed.clear()
            self.key = key

    def slot(self, batch: int, needed: int, bound: int | None) -> Slot | None:
        """The slot that decodes ``batch`` sequences of up to ``needed`` tokens, or None: decode eagerly."""
        bucket = batch_bucket(batch)
        if bucket in self.failed:
            return None
        slot = self.slots.get(bucket)
        if slot is not None and slot.cache.max_len >= needed:
            return slot
        self.slots.pop(bucket, None)  # a longer cache replaces it: free the old one first
        t0 = time.perf_counter()
        cache = self.model.allocate_cache(bucket, cache_len(needed, bound))
        decoder = self._capture(cache) if self.capture else None
        self.setup_s += time.perf_counter() - t0
        if self.capture and decoder is None:
            self.failed.add(bucket)
            return None
        self.slots[bucket] = Slot(cache, decoder)
        return self.slots[bucket]

    def _capture(self, cache: InferenceCache) -> GraphedDecoder | None:
        """The decode step captured on ``cache``, or None (logged) where the runtime refuses the capture."""
        try:
            return GraphedDecoder(self.model, cache)
        except Exception as e:  # noqa: BLE001 (a capture the runtime refuses must not end the run)
            why = (str(e).splitlines() or [type(e).__name__])[0]
            self.log(f"sampler: batch bucket {cache.batch_size} decodes eagerly, capture failed: {why}")
            return None

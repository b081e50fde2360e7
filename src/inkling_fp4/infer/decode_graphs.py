"""The sampler's decode step as CUDA graphs: per batch bucket one preallocated cache and one captured
step, kept across ``generate`` calls.

Why kept: an RL run calls ``generate`` every step, and a capture (warm-up steps, then the capture)
costs more than the few hundred steps it would speed up. So each bucket (``batch_bucket``, a power
of two) holds a cache of a fixed ``max_len`` and the :class:`GraphedDecoder` captured on it; a later
prefill into that cache keeps the graph valid. A call that needs a longer cache allocates one
(lengths are rounded up to a power of two, so this happens a handful of times at most).

Padding: a batch of n sequences decodes in its bucket's graph, the rows past n being copies of row
0 (its prompt at the prefill, its token at every step), whose outputs are dropped. Copies change no
real row's result, under any recipe:
- BF16, and NVFP4 with ``precision.activation_scale=row``: every row's arithmetic is its own (the
  GEMMs, norms and mixers work row by row; attention and the SSM read only the row's own cache).
- tensorwise activation scales (NVFP4 ``activation_scale=tensor``, FP8): a GEMM quantizes x with a
  scale from the amax over all its rows. A copy of row 0 holds no value row 0 does not, so the
  amax, the scales and every real row's codes are those of the batch without padding. (Zero rows
  would do too, but a decode row cannot be held at zero: its embedding and residual stream are not.)
What padding can change is the GEMM kernel picked for the bucket's number of rows instead of n,
as between any two batch sizes: a last-bit difference, not a dependence on the padding's values.

Staleness: a graph replays the addresses it captured. The parameters are updated in place by the
optimizer (the graph reads their new values: BF16 layers and the head cast them inside the graph),
and each layer's held quantized weight is refreshed in place by ``PrecisionPolicy.freeze_weights``
(``precision/held_operand.py``). The kernels of each layer's recipe, though, are fixed at capture.
So the graphs are keyed on what they read (:func:`graph_key`): every parameter's and buffer's
address, each QuantLinear's recipe and its held operand's addresses (or that none is used). A
precision switch, a load that replaced tensors, or a weight changed without being quantized again
changes the key, and every graph is dropped and captured again when next needed.
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
    """The ``max_len`` of a bucket's cache: ``needed`` rounded up to a power of two (at least 64),
    at most ``bound`` (the longest prompt plus completion the sampler can ask for)."""
    n = max(64, 1 << (needed - 1).bit_length())
    return max(needed, min(n, bound)) if bound is not None else n


@dataclass
class Slot:
    """One bucket: its cache and the decode step captured on it (None: decoded eagerly)."""

    cache: InferenceCache
    decoder: GraphedDecoder | None


class DecodeGraphs:
    """The buckets' caches and graphs of one model. ``capture=False`` keeps the caches and the
    padding but decodes them eagerly (on the CPU, where there are no graphs: how the padding is tested)."""

    def __init__(self, model: nn.Module, capture: bool = True, log: Callable[[str], None] = log_to_stderr):
        self.model = model
        self.capture = capture
        self.log = log
        self.slots: dict[int, Slot] = {}
        self.failed: set[int] = set()
        """Buckets whose capture failed: they decode eagerly, without padding, from then on."""
        self.key: tuple | None = None
        self.setup_s = 0.0
        """Seconds spent allocating the buckets' caches and capturing their graphs: paid once per
        bucket (and again after :meth:`check` drops them), not per generation."""

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
        """The decode step captured on ``cache``, or None (logged) where the runtime refuses the
        capture (out of memory for the graph's pool, an operation a capture forbids)."""
        try:
            return GraphedDecoder(self.model, cache)
        except Exception as e:  # noqa: BLE001 (a capture the runtime refuses must not end the run)
            why = (str(e).splitlines() or [type(e).__name__])[0]
            self.log(f"sampler: batch bucket {cache.batch_size} decodes eagerly, capture failed: {why}")
            return None

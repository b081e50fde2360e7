"""One micro-batch's forward and backward, captured once as a CUDA graph and then replayed.

Why: a small model's step is bound by the host's cost of launching its many kernels (BENCHMARKS.md);
a replay's host cost does not depend on the kernel count.

What a replay requires, and how it is kept:

- Static shapes and addresses: inputs (and the loss scale, a device scalar) are copied into buffers
  made at capture; a batch of another shape is refused.
- Gradients stay where the capture put them: with ``accumulate`` the backward adds into the capture's
  ``.grad`` tensors (:meth:`zero_grad` zeroes them in place), else it writes them in the graph's pool.
  NOTE never replace them (``optimizer.zero_grad(set_to_none=False)``): a swapped one is refused.
- No host reads inside: stochastic rounding reads a device seed word rewritten before every replay
  (``numerics/kernels/seeds.py``); amax words and NaN/Inf records: ``precision/graph_capture.py``.
- Nothing compiles or autotunes during capture: the first ``warmup`` calls run eagerly. Packed batches
  take the masked path in both (``packing.always_masked``): a capture cannot read the device to
  choose, and its kernels must serve every later batch. The capturing call replays once as well.
- One process: DDP all-reduces from hooks inside the backward.

Call :meth:`reset` after anything that changes a step's kernels (precision switch, monitor fallback).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from inkling_fp4.model.packing import always_masked
from inkling_fp4.numerics.kernels import seeds
from inkling_fp4.precision import finite_guard
from inkling_fp4.precision.graph_capture import quantized_graph


class GraphedMicroStep:
    """``loss_fn(ids, doc_ids, targets, loss_mask)`` forward and backward (scaled by ``grad_scale``)
    into ``model``'s ``.grad``, as a replayed CUDA graph after ``warmup`` eager calls.

    ``loss_fn`` returns the summed FP32 loss and must be the whole step: autocast belongs inside it,
    since only what runs inside is captured."""

    def __init__(
        self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], warmup: int = 2, accumulate: bool = True
    ):
        if warmup < 1:
            raise ValueError(f"GraphedMicroStep: warmup must be >= 1 (autotuning runs there), got {warmup}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.loss_fn = loss_fn
        self.warmup = warmup
        self.accumulate = accumulate
        self.eager_calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[torch.Tensor | None] = []
        self.scale: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.grads: list[torch.Tensor] = []
        self.seeds: seeds.GraphSeeds | None = None
        self.records: list[tuple[torch.Tensor, str]] = []  # the capture's finite_guard records

    def __call__(
        self,
        ids: torch.Tensor,
        doc_ids: torch.Tensor | None,
        targets: torch.Tensor,
        loss_mask: torch.Tensor,
        grad_scale: torch.Tensor,
    ) -> torch.Tensor:
        """Forward + backward of one micro-batch; returns its loss (a new FP32 scalar tensor)."""
        batch = [ids, doc_ids, targets, loss_mask]
        if self.graph is None and self.eager_calls < self.warmup:
            self.eager_calls += 1
            with always_masked():  # the capture's kernels, so that they are autotuned here
                loss = self.loss_fn(*batch)
                (loss * grad_scale).backward()
            return loss.detach()
        if self.graph is None:
            self._capture(batch, grad_scale)
        self._check_grads()
        for buf, t in zip(self.inputs, batch, strict=True):
            if (buf is None) != (t is None) or (t is not None and t.shape != buf.shape):
                raise ValueError(
                    "GraphedMicroStep: a micro-batch of another shape than the captured one "
                    f"({_shapes(self.inputs)} captured, {_shapes(batch)} given); call reset() first"
                )
            if t is not None:
                buf.copy_(t, non_blocking=True)
        self.scale.copy_(grad_scale)
        self.seeds.before_replay()
        self.graph.replay()
        finite_guard.record_replay(self.records)
        return self.loss.clone()

    def zero_grad(self) -> None:
        """Zero the gradients in place under ``accumulate``; otherwise the next replay rewrites them."""
        if self.graph is None:
            for p in self.params:
                p.grad = None
        elif self.accumulate:
            torch._foreach_zero_(self.grads)

    def reset(self) -> None:
        """Forget the graph and its pool: the next calls warm up and capture anew. Without accumulation
        its gradients are dropped too (eager steps would add to them)."""
        if self.graph is not None and not self.accumulate:
            for p in self.params:
                p.grad = None
        self.graph, self.inputs, self.scale, self.loss, self.grads = None, [], None, None, []
        self.seeds, self.records, self.eager_calls = None, [], 0

    def _capture(self, batch: list[torch.Tensor | None], grad_scale: torch.Tensor) -> None:
        for p in self.params:  # accumulating: the backward adds into tensors that outlive the capture
            if self.accumulate and p.grad is None:
                p.grad = torch.zeros_like(p)
            elif not self.accumulate:  # it writes them (the warm-up's are dropped)
                p.grad = None
        self.inputs = [None if t is None else t.clone() for t in batch]
        self.scale = grad_scale.detach().clone().to(torch.float32).reshape(())
        device = self.scale.device
        torch.cuda.synchronize()
        graph, graph_seeds = torch.cuda.CUDAGraph(), seeds.GraphSeeds(device)
        with seeds.capturing(graph_seeds), always_masked(), quantized_graph(graph, device) as records:
            loss = self.loss_fn(*self.inputs)
            (loss * self.scale).backward()
        self.graph, self.loss, self.seeds, self.records = graph, loss.detach(), graph_seeds, records
        self.grads = [p.grad for p in self.params]  # the tensors every replay adds into or writes

    def _check_grads(self) -> None:
        for p, g in zip(self.params, self.grads, strict=True):
            if p.grad is not g:
                raise RuntimeError(
                    "GraphedMicroStep: a parameter's .grad was replaced or set to None since the graph "
                    "was captured, so the replayed backward would add into a dead tensor; zero gradients "
                    "with GraphedMicroStep.zero_grad() or optimizer.zero_grad(set_to_none=False)"
                )


def _shapes(batch: list[torch.Tensor | None]) -> str:
    return ", ".join("None" if t is None else "x".join(map(str, t.shape)) for t in batch)

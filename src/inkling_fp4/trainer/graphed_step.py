"""One micro-batch's forward and backward, captured once as a CUDA graph and then replayed.

Why: a training step of a small model is set by the host, not the GPU. Each of the ~1,400 kernels
of a hybrid-350m BF16 step costs the host between a few and tens of microseconds of Python, autograd
and driver work to launch, and at 158M parameters (8 x 2048 tokens) the GPU waits for it. A CUDA
graph records the launches of one forward + backward once; every later micro-batch is one replay,
whose host cost does not depend on how many kernels it holds.

What a replay may and may not do, and how this keeps to it:

- Static shapes and addresses. The inputs are copied into buffers made at capture time; a batch of
  another shape is refused (the trainer's micro-batches all have one shape). The loss scale
  (world size / tokens of the global batch) is a device scalar, copied in as well.
- Gradients stay where the capture put them. With several micro-batches per step (``accumulate``)
  the captured backward adds into the ``.grad`` tensors that exist at capture time, and
  :meth:`zero_grad` zeroes them in place. With one micro-batch per step there is nothing to add to:
  the capture starts without gradients, so the backward writes each gradient as eager autograd would
  (no zero fill, no add kernel per parameter) into tensors of the graph's pool, and every replay
  rewrites them; :meth:`zero_grad` then has nothing to do. Either way they must never be replaced
  (``optimizer.zero_grad(set_to_none=False)`` if not :meth:`zero_grad`); a replay whose gradients
  were swapped or dropped is refused instead of silently training nothing.
- No host reads inside, and nothing frozen that must change per step. Three things in the
  quantizers would be, and are handled at capture: stochastic rounding (NVFP4, MXFP4) draws a seed
  on the host per quantization, so inside the capture the kernels read a device word instead, which
  is rewritten from the generator before every replay (``numerics/kernels/seeds.py``): the replayed
  step rounds exactly as the eager step would. The amax words of the NVFP4 quantizers come from a
  never-recycled zeroed pool, so the capture starts a new pool buffer whose zero fill is part of the
  graph (``precision/graph_capture.py``). And the deferred NaN/Inf record of the quantized operands
  (``precision/finite_guard.py``) holds the graph's amax buffers, so each replay's amaxes are copied
  out for the step's check. Debug mode's eager finite checks read the device at every operand and
  are refused (``precision.graph_capture.graph_blocker``).
- Nothing may compile or autotune during capture: the first ``warmup`` calls run eagerly (real
  micro-steps, which also autotune every Triton kernel at these shapes) and only then is the graph
  captured. Packed batches take the masked path in both (``packing.always_masked``): a capture may
  not read the device to choose, and its kernels must serve every later batch. Capturing records
  without computing, so the capturing call replays once as well.
- One process. DDP all-reduces gradients from hooks inside the backward, outside this capture.

The graph owns a private memory pool holding the step's activations, as large as the eager peak.
Call :meth:`reset` after anything that changes the kernels a step runs (a precision switch, a
monitor fallback): the next calls warm up and capture again.
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
    into the ``.grad`` of ``model``'s parameters, as a replayed CUDA graph after ``warmup`` eager calls.

    ``loss_fn`` returns the micro-batch's summed FP32 loss (a scalar) and must be the whole step:
    autocast belongs inside it, since only what runs inside is captured. ``accumulate``: a step has
    several micro-batches, whose gradients add up (else each replay writes the step's gradients)."""

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
        """Zero the gradients in place where the captured backward adds into these very tensors
        (``accumulate``); without accumulation the next replay rewrites them: nothing to do."""
        if self.graph is None:
            for p in self.params:
                p.grad = None
        elif self.accumulate:
            torch._foreach_zero_(self.grads)

    def reset(self) -> None:
        """Forget the graph (its memory pool goes with it): the next calls warm up and capture anew.
        Without accumulation the gradients it wrote are dropped too (eager steps would add to them)."""
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

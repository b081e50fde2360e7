"""Delayed scaling for tensorwise FP8: each quantized activation, gradient and weight takes its scale from
the largest amax of the last few steps instead of its own.

Why: a current scale needs ``max|x|`` before the first byte can be written, so the quantizer reads x
twice (an amax pass, then the bytes). At hybrid-350m's shapes on an H200 the amax passes are 7 of
the fp8-tensorwise step's ~170 ms. With the scale known in advance, x is read once, and the same
read records this step's amax for later steps. This is Transformer Engine's ``DelayedScaling``
(amax history, ``max`` over it, margin 0), which scales the weights this way too: a weight's amax
pass is a separate launch per layer every step (0.9 ms of hybrid-350m's step, 66 small launches), and
an FP32 master moves by about the learning rate per step, so its largest element can outgrow the
history's by that much and saturate at fp8_max, as in Transformer Engine.

The state, one row per (quantized linear, operand) with operand 0 = x, 1 = dy, 2 = W, in one device
tensor ``state [layers, 3, 2 + history]``:

    slot 0        the amax the scale comes from: max of the history (0 → scale 1)
    slot 1        this step's running amax: the quantizers atomic-max into it; -1 = nothing recorded
    slots 2..     the history, newest first, one entry per optimizer step

:meth:`AmaxHistory.end_step` (once per optimizer step, after the last backward) rolls the recorded
amaxes into the history and recomputes slot 0; rows with nothing recorded (a layer running in BF16
during a monitor fallback) keep their history, and a skipped step discards what it recorded (a NaN
step must not poison the scales of the next ones). Everything stays on the device, so a step replayed
as a CUDA graph records into the same words. Until the first roll there is no history: the layers
quantize with current scaling (and record), which is what :attr:`ready` tells them.

Under data parallelism the recorded amaxes are max-reduced across ranks before the roll, so every
rank quantizes with the same scales and a checkpoint's history (rank 0's) is every rank's.

NaN/Inf: with a current scale a non-finite x gives an Inf scale_inv and a NaN output; a delayed scale
is finite, so x's bytes saturate and only the recorded amax (Inf) shows it. The trainer hands the
recorded amaxes to the step's deferred NaN/Inf check (:meth:`AmaxHistory.record_for_check`, the same
one device read as the NVFP4 operands') and skips the step, as for a NaN loss.
"""

from __future__ import annotations

import base64
from collections.abc import Callable

import torch

from inkling_fp4.errors import ConfigError
from inkling_fp4.precision import finite_guard

USED, CURRENT, HISTORY = 0, 1, 2
"""Slots of a row: the scale's amax, this step's running amax, the first (newest) history entry."""
OPERANDS = ("x", "dy", "W")
"""The operands of a layer's rows, in order."""


class AmaxHistory:
    """The delayed-scaling amaxes of ``layers`` quantized linears (x, dy and W each), ``length`` steps."""

    def __init__(self, layers: int, length: int, device: torch.device, names: list[str] | None = None):
        if length < 1:
            raise ValueError(f"the amax history needs at least one step, got {length}")
        names = names or [f"linear {i}" for i in range(layers)]
        self.labels = [f"{n} {op} (delayed FP8 scaling, amax history)" for n in names for op in OPERANDS]
        """One per row, [layer][operand] order: what a NaN/Inf error names."""
        self.length = length
        self.state = torch.zeros(layers, len(OPERANDS), HISTORY + length, dtype=torch.float32, device=device)
        self.state[..., CURRENT] = -1.0
        self.ready = False
        """Whether a step has been rolled in: before that, scales come from the tensors themselves."""

    @property
    def layers(self) -> int:
        return self.state.shape[0]

    def row(self, layer: int, operand: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the scale's amax word, the word to record into) of operand 0 (x), 1 (dy) or 2 (W) of a layer."""
        r = self.state[layer, operand]
        return r[USED : USED + 1], r[CURRENT : CURRENT + 1]

    def end_step(self, skipped: bool, reduce_max: Callable[[torch.Tensor], None] | None = None) -> None:
        """Roll this step's recorded amaxes into the history (or drop them if the step was skipped)."""
        current = self.state[..., CURRENT]  # [layers, 3]
        if not skipped:
            if reduce_max is not None:  # collectives need contiguous tensors; this is a strided view
                gathered = current.contiguous()
                reduce_max(gathered)  # in place, across ranks
                current.copy_(gathered)
            recorded = current >= 0
            # a non-finite amax only comes with a non-finite step, which is skipped; never keep one
            value = torch.where(torch.isfinite(current), current, 0.0)
            history = self.state[..., HISTORY:]  # [layers, 3, length], newest first
            rolled = torch.cat([value.unsqueeze(-1), history[..., :-1]], dim=-1)
            history.copy_(torch.where(recorded.unsqueeze(-1), rolled, history))
            self.state[..., USED] = history.amax(dim=-1)
            self.ready = True
        current.fill_(-1.0)

    def record_for_check(self) -> None:
        """Hand this step's recorded amaxes to :mod:`finite_guard`'s next check: the only sign of a
        non-finite x or dy on CUDA, whose bytes saturate under a finite delayed scale."""
        finite_guard.record(self.state[..., CURRENT].reshape(-1), self.labels)

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """JSON-serialisable and exact: the state's FP32 bytes in base64."""
        raw = self.state.detach().cpu().contiguous().numpy().tobytes()
        return {"shape": list(self.state.shape), "ready": self.ready, "state": base64.b64encode(raw).decode()}

    def load_state_dict(self, d: dict) -> None:
        shape = tuple(d["shape"])
        if shape != tuple(self.state.shape):
            raise ConfigError(
                f"the checkpoint's FP8 amax history has shape {list(shape)}, this run's is "
                f"{list(self.state.shape)} (layers, operands x / dy / W, 2 + precision.amax_history); "
                "resume with the same model and precision.amax_history (a checkpoint from before weights "
                "took delayed scales has 2 operands: resume it with precision.fp8_scaling=current)"
            )
        raw = bytearray(base64.b64decode(d["state"]))
        loaded = torch.frombuffer(raw, dtype=torch.float32).reshape(shape)
        self.state.copy_(loaded)
        self.ready = bool(d["ready"])

"""Delayed scaling for tensorwise FP8: x, dy and W take their scale from the largest amax of the last
few steps instead of their own.

Why: a current scale needs ``max|x|`` before the first byte is written, so x is read twice; a scale
known in advance reads x once and records this step's amax. This is Transformer Engine's
``DelayedScaling`` (``max`` over the history, margin 0), weights included: a weight may outgrow its
history by about one learning-rate step and saturate at fp8_max, as in TE.

State: one row per (quantized linear, operand 0 = x, 1 = dy, 2 = W), ``state [layers, 3, 2 + history]``:

    slot 0        the amax the scale comes from: max of the history (0 → scale 1)
    slot 1        this step's running amax: the quantizers atomic-max into it; -1 = nothing recorded
    slots 2..     the history, newest first, one entry per optimizer step

:meth:`AmaxHistory.end_step` rolls slot 1 into the history once per optimizer step (max-reduced over
ranks first, so all share scales); rows with nothing recorded (BF16 during a monitor fallback) keep
their history, and a skipped step discards its record, so a NaN step cannot poison later scales. The
state stays on the device, so CUDA graph replays record into the same words. Until the first roll
(:attr:`ready`) layers use current scaling. NOTE a delayed scale
is finite, so a non-finite x only saturates its bytes: the recorded amax (Inf) is the only sign, and
goes to the deferred NaN/Inf check (:meth:`record_for_check`).
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
    """The delayed-scaling amaxes of ``layers`` quantized linears, ``length`` steps of history."""

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
        """Hand this step's recorded amaxes to :mod:`finite_guard`'s next check (see the module NOTE)."""
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

"""Deferred finiteness check of quantized GEMM operands: NaN/Inf fail loudly without a host sync per
quantization.

Why: a NaN or Inf reaching an NVFP4 quantizer silently poisons a block scale, so every operand must be
checked, but reading ``bool(amax)`` at once stalls the CPU several times per layer and step. The
tensor amax the quantizer computes anyway is +Inf/NaN whenever the tensor is, so each quantization
records it and :func:`raise_if_non_finite` tests them all with one read, naming the first bad tensor.

The training loop checks once per step; the check also runs itself every ``MAX_PENDING`` records, so
a caller that never checks still gets the error. ``FP4TRAIN_EAGER_FINITE_CHECKS=1`` checks every
operand at once and names the first bad element, at the cost of the syncs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from inkling_fp4.errors import NumericsError

MAX_PENDING = 512
"""Recorded operands after which the check runs by itself (one host sync per this many)."""

_pending: list[tuple[torch.Tensor, list[str]]] = []  # (amaxes [k], their k labels)
_captures: list[list[tuple[torch.Tensor, str]]] = []
_eager = os.environ.get("FP4TRAIN_EAGER_FINITE_CHECKS", "0") not in ("", "0")


def eager_checks(enabled: bool) -> None:
    """Check each operand when it is quantized (debug mode: exact location, one sync per operand)."""
    global _eager
    _eager = enabled


def eager() -> bool:
    return _eager


def record(amax: torch.Tensor, label: str | list[str]) -> None:
    """Remember a quantized operand's amax (+Inf/NaN when it was not finite) for the next check; or
    several operands' at once: ``amax`` [k] with k labels."""
    labels = [label] if isinstance(label, str) else list(label)
    amaxes = amax.reshape(len(labels))
    if _captures:
        _captures[-1].extend(zip(amaxes.split(1), labels, strict=True))
        return
    _pending.append((amaxes, labels))
    if len(_pending) >= MAX_PENDING:
        raise_if_non_finite()


@contextlib.contextmanager
def capturing() -> Iterator[list[tuple[torch.Tensor, str]]]:
    """Records go to the returned list and no check runs (a CUDA graph capture forbids device reads)."""
    records: list[tuple[torch.Tensor, str]] = []
    _captures.append(records)
    try:
        yield records
    finally:
        _captures.pop()


def record_replay(records: list[tuple[torch.Tensor, str]]) -> None:
    """After a replay: copy the capture's amaxes (the next replay overwrites them) for the next check."""
    if not records:
        return
    _pending.append((torch.cat([a for a, _ in records]), [label for _, label in records]))
    if len(_pending) >= MAX_PENDING:
        raise_if_non_finite()


def raise_if_non_finite() -> None:
    """Raise NumericsError naming the first recorded operand that held NaN/Inf; clears the record."""
    if not _pending:
        return
    pending = list(_pending)
    _pending.clear()
    amaxes = torch.cat([a.to(pending[0][0].device) for a, _ in pending])  # [P]
    bad = ~torch.isfinite(amaxes)
    if not bool(bad.any()):
        return
    first = int(bad.nonzero()[0, 0])
    count = int(bad.sum())
    labels = [label for _, entry in pending for label in entry]
    raise NumericsError(
        f"{labels[first]} contains non-finite values (NaN/Inf): {count} quantized operand(s) since the "
        "last check were not finite, this one first; NaN/Inf cannot be quantized - look at what produced "
        "it (a diverged loss, too high a learning rate, an overflow); set FP4TRAIN_EAGER_FINITE_CHECKS=1 "
        "to stop at the exact element"
    )


def discard() -> None:
    """Forget what was recorded (e.g. when a step is skipped on purpose)."""
    _pending.clear()

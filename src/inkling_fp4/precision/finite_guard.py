"""Deferred finiteness check of quantized GEMM operands: NaN/Inf still fail loudly, without a host sync
per quantization.

Why: a NaN or Inf that reaches an NVFP4 quantizer poisons a block scale silently, so every operand
must be checked. Checking it at once means reading a device value on the host (``bool(amax)``),
which stalls the CPU until the GPU has caught up, several times per layer and step; the GPU then
idles while the next kernels are launched. The quantizer already computes the tensor amax, which is
+Inf whenever the tensor holds NaN or Inf, so checking can wait: each quantization records its amax
(no work on the device) and :func:`raise_if_non_finite` tests all recorded amaxes with one read,
naming the first tensor that was not finite.

When the check runs: whenever :func:`raise_if_non_finite` is called (the training loop calls it once
per optimizer step, and when a step's loss is not finite), and on its own after every
``MAX_PENDING`` recorded operands, so that a caller that never calls it still gets the error, a few
layers late. A NaN that slips past a quantizer until then only makes that step's loss NaN, which the
step's own check reports.

Inside a CUDA graph capture (:func:`capturing`) records go to the capture instead: their amaxes are
the graph's own buffers, which every replay rewrites, so after each replay :func:`record_replay`
copies them out (one device copy) for the next check.

Debug mode: ``eager_checks(True)`` (or ``FP4TRAIN_EAGER_FINITE_CHECKS=1`` in the environment) checks
every operand when it is quantized and reports the first bad element's index, at the cost of the
syncs.
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
    """Whether operands are checked when they are quantized."""
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
    """Within this context (a CUDA graph capture) records go to the returned list, and no check runs
    (a check reads the device, which a capture forbids)."""
    records: list[tuple[torch.Tensor, str]] = []
    _captures.append(records)
    try:
        yield records
    finally:
        _captures.pop()


def record_replay(records: list[tuple[torch.Tensor, str]]) -> None:
    """After a replay of a graph whose capture made ``records``: keep a copy of their amaxes (the next
    replay overwrites the graph's) for the next check."""
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

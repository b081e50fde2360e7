"""Input validation for the quantizers: bad tensors get a one-line NumericsError, never garbage.

Why: a NaN that reaches a quantizer silently spoils a whole block scale (and every later step), and a
last dim that is not a multiple of the block would surface as an opaque reshape error deep in a
kernel. Every message names the operation, the tensor (``name=``), its shape, and what to do.

The finiteness check is one scalar test when the caller has the tensor's amax (NaN and Inf show in
it); only on failure is the first bad element searched for.
"""

from __future__ import annotations

import torch

from inkling_fp4.errors import NumericsError

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _label(name: str | None) -> str:
    return f"tensor '{name}'" if name else "input tensor"


def check_dtype(x: torch.Tensor, *, op: str, name: str | None = None) -> None:
    """float32 / bfloat16 / float16 only."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise NumericsError(
            f"{op}: {_label(name)} of shape {tuple(x.shape)} has dtype {x.dtype}; supported dtypes are "
            "float32, bfloat16 and float16 - cast it first (e.g. x.float())"
        )


def check_block_shape(
    x: torch.Tensor, *, op: str, block: int, name: str | None = None, ndim: int | None = None
) -> None:
    """The last dim must be a multiple of ``block``; ``ndim`` demands an exact rank."""
    shape = tuple(x.shape)
    if ndim is not None and x.dim() != ndim:
        raise NumericsError(
            f"{op}: {_label(name)} of shape {shape} must be {ndim}-D for this mode; reshape it to "
            f"[rows, cols] first"
        )
    if x.dim() == 0 or shape[-1] % block != 0:
        last = shape[-1] if shape else "none"
        raise NumericsError(
            f"{op}: {_label(name)} of shape {shape} has last dim {last}, not a multiple of the block size "
            f"{block}; pad that dim to a multiple of {block} or keep this layer in BF16"
        )


def check_rows(x: torch.Tensor, *, op: str, block: int, what: str, name: str | None = None) -> None:
    """The first dim must be a multiple of ``block`` (it becomes the blocked dim after a transpose)."""
    if x.shape[0] % block != 0:
        raise NumericsError(
            f"{op}: {_label(name)} of shape {tuple(x.shape)} has first dim {x.shape[0]} ({what}), not a "
            f"multiple of the block size {block}; pad it to a multiple of {block}"
        )


def check_finite(
    x: torch.Tensor, *, op: str, name: str | None = None, amax: torch.Tensor | None = None
) -> None:
    """Raise if ``x`` holds NaN/Inf. Pass the tensor's ``amax`` (any reduction that propagates NaN
    and Inf) to make the passing case a single scalar test."""
    ok = torch.isfinite(amax).all() if amax is not None else torch.isfinite(x).all()
    if bool(ok):
        return
    bad = ~torch.isfinite(x)
    count = int(bad.sum())
    if count == 0:
        raise NumericsError(
            f"{op}: {_label(name)} of shape {tuple(x.shape)} overflowed to Inf inside {op} (its values are "
            "too large for the format's intermediate math); rescale the tensor"
        )
    first = tuple(int(i) for i in bad.nonzero()[0])
    value = float(x[first])
    raise NumericsError(
        f"{op}: {_label(name)} of shape {tuple(x.shape)} contains {count} non-finite value(s) "
        f"(first: {value} at index {first}); NaN/Inf cannot be quantized - look at what produced this "
        "tensor (a diverged loss, too high a learning rate, an overflow in low precision)"
    )


def check_input(
    x: torch.Tensor, *, op: str, block: int, name: str | None = None, ndim: int | None = None
) -> None:
    """dtype and block shape (finiteness is checked once the amax is known)."""
    check_dtype(x, op=op, name=name)
    check_block_shape(x, op=op, block=block, name=name, ndim=ndim)

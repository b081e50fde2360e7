"""The SSD scan of Mamba-2 on the GPU: Triton kernels with a hand-written backward.

Same arguments and results as ``model/ssd.py``'s :func:`ssd_reference`; the kernel pipeline is in
``model/ssd_kernels``. Only the inputs, the FP32 dt and its cumsum G are saved for the backward; the
chunk states are recomputed. ``chunk_size`` must be 16, 32, 64 or 128.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.function import once_differentiable

from inkling_fp4.errors import UserError
from inkling_fp4.model.ssd_kernels.chunk_cumsum import chunk_cumsum
from inkling_fp4.model.ssd_kernels.chunk_scan import chunk_scan
from inkling_fp4.model.ssd_kernels.chunk_states import chunk_states
from inkling_fp4.model.ssd_kernels.chunking import padded_segments
from inkling_fp4.model.ssd_kernels.scan_grads_bc import scan_grads_bc
from inkling_fp4.model.ssd_kernels.scan_grads_x import scan_grads_x
from inkling_fp4.model.ssd_kernels.state_grads import state_grads
from inkling_fp4.model.ssd_kernels.tuning import INTERPRET

CHUNK_SIZES = (16, 32, 64, 128)  # 256 would need [256, 256] tiles: out of registers and shared memory


class _SSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, initial_state, seg, chunk_size):
        dt_t, G = chunk_cumsum(dt, A, chunk_size)  # [b, h, L] each
        states, final = chunk_states(x, dt_t, G, B, initial_state, seg, chunk_size)  # [b, h, c, p, n]
        y = chunk_scan(x, dt_t, G, B, C, states, seg, chunk_size)  # [b, l, h, p]
        ctx.save_for_backward(x, dt_t, G, A, B, C, initial_state, seg)
        ctx.chunk_size = chunk_size
        ctx.dt_dtype = dt.dtype
        ctx.set_materialize_grads(False)
        return y, final

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dfinal):
        x, dt_t, G, A, B, C, initial_state, seg = ctx.saved_tensors
        q = ctx.chunk_size
        l = x.shape[1]
        dy = torch.zeros_like(x) if dy is None else _last_dim_contiguous(dy.to(x.dtype))
        if dfinal is not None:
            dfinal = dfinal.float().contiguous()
        states, _ = chunk_states(x, dt_t, G, B, initial_state, seg, q)
        dstates, dinit = state_grads(dy, G, C, dfinal, seg, q)  # dstates[:, :, c]: state leaving chunk c
        dx, ddt_t, dA_chunks = scan_grads_x(x, dt_t, G, A, B, C, dy, states, dstates, seg, q)
        dB, dC = scan_grads_bc(x, dt_t, G, B, C, dy, states, dstates, seg, q)
        ddt = ddt_t[:, :, :l].transpose(1, 2).to(ctx.dt_dtype)  # [b, l, h]
        dA = dA_chunks.sum((0, 2)).to(A.dtype)  # [h]
        return dx, ddt, dA, dB, dC, (dinit if initial_state is not None else None), None, None


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # The kernels take any strides except along the last dim (loads of whole rows).
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(x, dt, A, B, C, chunk_size, initial_state, doc_ids) -> None:
    if x.dim() != 4:
        raise ValueError(f"ssd_triton: x must be [b, l, h, p], got shape {tuple(x.shape)}")
    b, l, h, p = x.shape
    if B.dim() != 4 or B.shape != C.shape or B.shape[:2] != (b, l) or h % B.shape[2]:
        raise ValueError(
            f"ssd_triton: B and C must be [b, l, g, n] with g dividing h={h}; got B {tuple(B.shape)}, "
            f"C {tuple(C.shape)} for x {tuple(x.shape)}"
        )
    if dt.shape != (b, l, h) or A.shape != (h,):
        raise ValueError(
            f"ssd_triton: dt must be [{b}, {l}, {h}] and A [{h}]; got {tuple(dt.shape)}, {tuple(A.shape)}"
        )
    if initial_state is not None and initial_state.shape != (b, h, p, B.shape[3]):
        raise ValueError(
            f"ssd_triton: initial_state must be [{b}, {h}, {p}, {B.shape[3]}], "
            f"got {tuple(initial_state.shape)}"
        )
    if doc_ids is not None and doc_ids.shape != (b, l):
        raise ValueError(f"ssd_triton: doc_ids must be [{b}, {l}], got {tuple(doc_ids.shape)}")
    if l == 0:
        raise ValueError("ssd_triton: the sequence is empty (l = 0)")
    if chunk_size not in CHUNK_SIZES:
        raise UserError(
            f"model.chunk_size={chunk_size} is not supported by the Triton SSD kernel; "
            f"use one of {', '.join(map(str, CHUNK_SIZES))} (or model.ssd_impl=reference)"
        )
    if not (x.is_cuda or INTERPRET):
        raise UserError(
            f"ssd_triton needs CUDA tensors (got {x.device}); on CPU use ssd_reference "
            "(model.ssd_impl=reference)"
        )


@torch.compiler.disable  # Triton launches and a hand-written backward: a graph break, not a trace
def ssd_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes as :func:`ssd_reference`: x [b, l, h, p], dt [b, l, h], A [h], B, C [b, l, g, n] -> y in x's
    dtype (no D skip) and the final state [b, h, p, n] in FP32."""
    _check(x, dt, A, B, C, chunk_size, initial_state, doc_ids)
    x = _last_dim_contiguous(x)
    B = _last_dim_contiguous(B.to(x.dtype))  # matmul operands share x's dtype
    C = _last_dim_contiguous(C.to(x.dtype))
    A = A.contiguous()
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    seg = None if doc_ids is None else padded_segments(doc_ids, chunk_size)
    device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    with device:
        return _SSD.apply(x, dt, A, B, C, initial_state, seg, chunk_size)

"""The SSD scan of Mamba-2 (Dao & Gu, "Transformers are SSMs", 2024): reference, recurrence, dispatcher.

Per head h, with the head's group g = h // (H / G) providing B and C, the selective state space model is

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T        S: [P, N]
    y_t = S_t C_t                                      y: [P]

``ssd_reference`` is the paper's minimal chunked SSD: inside a chunk of Q tokens the quadratic form
``y = (L o C B^T) (dt x)`` with ``L[i, j] = exp(sum_{k=j+1..i} dt_k A)`` ("segsum"), between chunks a
short recurrence over chunk states. Pure PyTorch (FP32 or FP64), any length (padded with dt = 0, which
neither decays nor feeds the state); every fast path is tested against it. ``ssd_recurrent`` is the
literal recurrence, the test oracle.

Packed documents: the state is zeroed where ``doc_ids`` changes (every decay across a boundary masked).

Shape letters: b batch, l length, h heads, p head dim, g groups, r = h/g heads per group, n state,
c chunks, q chunk length (i, j index positions inside a chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inkling_fp4.errors import UserError
from inkling_fp4.model.packing import segment_ids


def segsum(a: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """a: [..., T] -> [..., T, T] with out[i, j] = sum_{k=j+1..i} a_k for j <= i (and keep[i, j]), else -inf.
    A masked cumsum: cumsum differences would cancel catastrophically as the decay grows."""
    T = a.shape[-1]
    a_rep = a[..., :, None].expand(*a.shape, T)  # a_rep[..., i, j] = a_i
    strict = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)
    out = a_rep.masked_fill(~strict, 0).cumsum(-2)  # [..., T, T]
    allowed = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(0)
    if keep is not None:
        allowed = allowed & keep
    return out.masked_fill(~allowed, float("-inf"))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # The scan always runs in FP32 (FP64 only when asked for, by the exactness tests).
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def ssd_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD. x: [b, l, h, p]; dt: [b, l, h] (> 0); A: [h] (< 0); B, C: [b, l, g, n];
    initial_state: [b, h, p, n]; doc_ids: [b, l]. Returns y: [b, l, h, p] (x's dtype, no D skip) and the
    final state [b, h, p, n] (FP32, FP64 for FP64 inputs)."""
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    Q = chunk_size
    pad = (-l) % Q
    c = (l + pad) // Q
    cdt = _compute_dtype(x)
    with torch.autocast(device_type=x.device.type, enabled=False):
        # Padding with dt = 0: exp(0 * A) = 1 and dt * x = 0, so padded steps leave the state unchanged.
        x_, dt_, B_, C_ = (F.pad(t.to(cdt), (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
        a = dt_ * A.to(cdt)  # [b, L, h] log decay per step
        X = (x_ * dt_[..., None]).view(b, c, Q, g, r, p)  # dt x: [b, c, q, g, r, p]
        a = a.view(b, c, Q, g, r).permute(0, 3, 4, 1, 2)  # [b, g, r, c, q]
        Bc = B_.view(b, c, Q, g, n)
        Cc = C_.view(b, c, Q, g, n)
        a_cs = a.cumsum(-1)  # [b, g, r, c, q] decay from the chunk start to position i (inclusive)

        seg = seg_start = None
        if doc_ids is not None:
            s = segment_ids(doc_ids)
            s = torch.cat([s, s[:, -1:].expand(b, pad)], 1).view(b, c, Q)  # padding joins the last doc
            # Segment of the state entering each chunk; the initial state belongs to the first document.
            seg_start = torch.cat([torch.zeros_like(s[:, :1, 0]), s[:, :-1, -1]], 1)  # [b, c]
            seg = s

        # 1. Inside each chunk: y_i = sum_{j<=i} (C_i . B_j) exp(a_{j+1..i}) dt_j x_j
        keep = None if seg is None else (seg[..., :, None] == seg[..., None, :])[:, None, None]
        Lmat = torch.exp(segsum(a, keep))  # [b, g, r, c, i, j]
        CB = torch.einsum("bcign,bcjgn->bgcij", Cc, Bc)  # [b, g, c, i, j]
        y = torch.einsum("bgcij,bgrcij,bcjgrp->bcigrp", CB, Lmat, X)  # [b, c, q, g, r, p]

        # 2. Each chunk's own contribution to its final state: sum_j exp(a_{j+1..end}) (dt_j x_j) B_j^T
        decay_to_end = torch.exp(a_cs[..., -1:] - a_cs)  # [b, g, r, c, q]
        if seg is not None:
            decay_to_end = decay_to_end * (seg == seg[..., -1:])[:, None, None]
        states = torch.einsum("bcjgn,bgrcj,bcjgrp->bcgrpn", Bc, decay_to_end, X)  # [b, c, g, r, p, n]

        # 3. Pass states from chunk to chunk: a recurrence of length c over chunk totals.
        if initial_state is None:
            init = torch.zeros(b, 1, g, r, p, n, dtype=cdt, device=x.device)
        else:
            init = initial_state.to(cdt).view(b, 1, g, r, p, n)
        states = torch.cat([init, states], 1)  # [b, c+1, g, r, p, n]
        chunk_a = F.pad(a_cs[..., -1], (1, 0))  # [b, g, r, c+1] total log decay of each chunk
        keep_c = None
        if seg is not None:
            seg_ends = torch.cat([seg_start, seg[:, -1:, -1]], 1)  # [b, c+1]
            keep_c = (seg_ends[:, :, None] == seg_ends[:, None, :])[:, None, None]
        decay_chunk = torch.exp(segsum(chunk_a, keep_c))  # [b, g, r, c+1, c+1]
        states = torch.einsum("bgrzc,bcgrpn->bzgrpn", decay_chunk, states)  # [b, c+1, g, r, p, n]
        states_in, final = states[:, :-1], states[:, -1]

        # 4. The state entering each chunk, decayed to position i, read out by C_i.
        decay_in = torch.exp(a_cs)  # [b, g, r, c, q]
        if seg is not None:
            decay_in = decay_in * (seg == seg_start[..., None])[:, None, None]
        y = y + torch.einsum("bcign,bcgrpn,bgrci->bcigrp", Cc, states_in, decay_in)

    y = y.reshape(b, c * Q, h, p)[:, :l]
    return y.to(x.dtype), final.reshape(b, h, p, n)


def ssd_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the recurrence. state: [b, h, p, n]; x: [b, h, p]; dt: [b, h]; B, C: [b, g, n].
    Returns y: [b, h, p] and the new state (in the state's dtype)."""
    h, g = x.shape[1], B.shape[1]
    cdt = state.dtype
    with torch.autocast(device_type=x.device.type, enabled=False):
        Bh = B.to(cdt).repeat_interleave(h // g, dim=1)  # [b, h, n]: head h reads group h // r
        Ch = C.to(cdt).repeat_interleave(h // g, dim=1)
        dt = dt.to(cdt)
        decay = torch.exp(dt * A.to(cdt))[..., None, None]  # [b, h, 1, 1]
        state = decay * state + (dt[..., None] * x.to(cdt))[..., None] * Bh[:, :, None, :]  # [b, h, p, n]
        y = torch.einsum("bhpn,bhn->bhp", state, Ch)
    return y, state


def ssd_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence, same arguments and results as :func:`ssd_reference` (no chunk_size)."""
    b, l, h, p = x.shape
    n = B.shape[-1]
    cdt = _compute_dtype(x)
    if initial_state is None:
        state = torch.zeros(b, h, p, n, dtype=cdt, device=x.device)
    else:
        state = initial_state.to(cdt)
    ys = []
    for t in range(l):
        if doc_ids is not None and t > 0:
            same = (doc_ids[:, t] == doc_ids[:, t - 1]).to(cdt)  # [b]: 0 resets at a boundary
            state = state * same[:, None, None, None]
        y, state = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(y)
    return torch.stack(ys, 1).to(x.dtype), state


def load_triton_ssd():
    """The Triton SSD kernel, or None when it cannot be imported here."""
    try:
        from inkling_fp4.model.ssd_triton import ssd_triton  # needs triton
    except ImportError:
        return None
    return ssd_triton


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan (shapes: :func:`ssd_reference`). ``impl``: 'auto' (the Triton kernel on CUDA when it
    imports), 'triton' or 'reference'."""
    if impl != "reference" and x.is_cuda:
        kernel = load_triton_ssd()
        if kernel is not None:
            return kernel(x, dt, A, B, C, chunk_size, initial_state=initial_state, doc_ids=doc_ids)
        if impl == "triton":
            raise UserError(
                "model.ssd_impl=triton but the Triton SSD kernel cannot be imported (is triton installed? "
                "pip install 'fp4train[gpu]'); set model.ssd_impl=auto or reference"
            )
    return ssd_reference(x, dt, A, B, C, chunk_size, initial_state=initial_state, doc_ids=doc_ids)

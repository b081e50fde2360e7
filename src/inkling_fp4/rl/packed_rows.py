"""Rollout rows packed end to end for the trainer's forward, and the way back to the padded layout.

Padded to the longest, every forward also computes the padding. Packed, sequences sit one after the
other in rows of ``row_len`` tokens, each its own document (``doc_ids``: the Mamba-2 state and the
attention mask reset at every boundary, as in SFT packing), so each sequence gets what its own forward
gives. Per-token results return to the padded layout [B, L] through ``index``, where the loss is
computed. Sequences are placed in order; a new row opens when the next one does not fit.

Shapes: B sequences, L the padded length, P packed rows, S their length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [P, S] int64
    targets: torch.Tensor  # [P, S] int64
    doc_ids: torch.Tensor  # [P, S] int64: sequence b's tokens carry b; a row's tail its own id
    index: torch.Tensor  # [B, L] int64: where (b, t) sits in the flattened [P * S]; -1 past b's tokens


def pack_rows(input_ids_BL: torch.Tensor, targets_BL: torch.Tensor, lengths_B: torch.Tensor, row_len: int,
         pad_id: int) -> PackedRows:  # fmt: skip
    """The rows ``input_ids_BL`` / ``targets_BL`` (``lengths_B`` real tokens each) packed into rows of
    ``max(row_len, longest)`` tokens, on their device."""
    B, L = input_ids_BL.shape
    lengths = [int(n) for n in lengths_B.tolist()]
    S = max(row_len, max(lengths, default=1))
    starts, row, offset = [], 0, 0
    for n in lengths:
        if offset + n > S:
            row, offset = row + 1, 0
        starts.append(row * S + offset)
        offset += n
    P = row + 1
    device = input_ids_BL.device
    t_L = torch.arange(L, device=device)
    real_BL = t_L[None, :] < lengths_B.to(device)[:, None]  # [B, L]
    index_BL = torch.where(real_BL, torch.tensor(starts, device=device)[:, None] + t_L[None, :], -1)
    flat = index_BL[real_BL]  # [tokens]
    ids = torch.full((P * S,), pad_id, dtype=torch.long, device=device)
    tgt = torch.full((P * S,), pad_id, dtype=torch.long, device=device)
    ids[flat], tgt[flat] = input_ids_BL[real_BL], targets_BL[real_BL]
    docs = (B + torch.arange(P * S, device=device) // S).long()  # a row's tail: an id no sequence has
    docs[flat] = torch.arange(B, device=device)[:, None].expand(B, L)[real_BL]
    return PackedRows(ids.view(P, S), tgt.view(P, S), docs.view(P, S), index_BL)


def unpack(values_PS: torch.Tensor, index_BL: torch.Tensor) -> torch.Tensor:
    """Per-token values of packed rows [P, S] in the padded layout [B, L] (0 past a row); differentiable."""
    picked = values_PS.reshape(-1)[index_BL.clamp(min=0)]  # [B, L]
    return torch.where(index_BL >= 0, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))

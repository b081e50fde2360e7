"""A held quantized weight operand, refreshed in place when the weight changes.

Why in place: a decode CUDA graph (``model/graphed_decoder.py``) replays captured addresses, held
weight operands included; an operand at new addresses would leave it reading stale or freed memory.
So a new operand of the same layout is copied into the held tensors; any other is held as is, and
``infer/decode_graphs.py`` captures again. Operands are walked generically, so new fields are covered.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def operand_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (dataclass fields, tuple and list items), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for child in _children(obj) for t in operand_tensors(child)]


def layout(obj: Any) -> Any:
    """``obj`` with each tensor replaced by (shape, dtype, device): equal layouts copy into each other."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype, obj.device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), tuple(layout(getattr(obj, f.name)) for f in dataclasses.fields(obj)))
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(layout(x) for x in obj))
    return obj


def refresh_in_place(held: Any, new: Any) -> bool:
    """Copy ``new``'s tensors into ``held``'s when their layouts match (True), else touch nothing
    (False). Afterwards ``held`` holds ``new``'s values bit for bit at its own addresses."""
    if held is None or layout(held) != layout(new):
        return False
    with torch.no_grad():
        for dst, src in zip(operand_tensors(held), operand_tensors(new), strict=True):
            dst.copy_(src)
    return True


def _children(obj: Any) -> list[Any]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, (tuple, list)):
        return list(obj)
    return []

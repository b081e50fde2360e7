"""Where a training step's GPU time goes, for the bench scripts: the kernel groups of
``inkling_fp4.trainer.kernel_groups`` (re-exported here), and which package line launched what
(:func:`top_sources`, ``bench_pretrain.py --sources``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from inkling_fp4.trainer.kernel_groups import (  # noqa: E402, F401  (the bench scripts' names)
    CATEGORIES,
    OTHER,
    breakdown,
    category,
    device_us,
    format_breakdown,
    format_rows,
    format_top,
    top_kernels,
)


def _frames(event) -> list[str]:
    """The package's Python functions around a profiler event, innermost first ("file(line): name",
    the line being where the function starts). With ``with_stack=True`` the profiler records Python
    calls as events, so they are the op's ancestors."""
    out, node = [], getattr(event, "cpu_parent", None)
    while node is not None:
        if "inkling_fp4/" in node.name:
            out.append(node.name.split("inkling_fp4/")[-1])
        node = node.cpu_parent
    return out


def where(event, forward_frames: dict[int, list[str]]) -> str:
    """Where an op that launched kernels comes from: its innermost two package functions; for an op
    of autograd's backward (no Python caller), the backward node and its forward op's functions
    (matched by the autograd sequence number)."""
    node = event
    while node is not None:
        if node.name.startswith("autograd::engine::evaluate_function: "):
            fwd = forward_frames.get(getattr(node, "sequence_nr", -1), [])
            return f"{node.name.split(': ', 1)[1]} of " + (" <- ".join(fwd[:2]) or "(no forward frame)")
        if "inkling_fp4/" in node.name:
            break
        node = node.cpu_parent
    frames = _frames(event)
    return " <- ".join(frames[:2]) if frames else "(no package frame)"


def top_sources(events, steps: int, n: int = 30) -> list[tuple[str, str, float, int]]:
    """The ``n`` (op, source) pairs with the most device time: (op, where, ms per step, calls per step).

    ``events``: the raw events (``profiler.events()``) of a profile with CPU and CUDA activities and
    ``with_stack=True``. Why: a kernel name says "a strided FP8 copy"; this says which line of the
    package asked for it, including the backward of an op autograd differentiates itself."""
    forward_frames: dict[int, list[str]] = {}
    for e in events:
        seq = getattr(e, "sequence_nr", -1)
        if seq is not None and seq >= 0 and seq not in forward_frames and not e.name.startswith("autograd"):
            frames = _frames(e)
            if frames:
                forward_frames[seq] = frames
    totals: dict[tuple[str, str], list] = {}
    for e in events:
        if str(getattr(e, "device_type", "")).endswith("CUDA") or "inkling_fp4/" in e.name:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if not us:
            continue
        entry = totals.setdefault((e.name, where(e, forward_frames)), [0.0, 0])
        entry[0] += us / 1e3 / steps
        entry[1] += 1
    rows = [(op, src, ms, round(c / steps)) for (op, src), (ms, c) in totals.items()]
    return sorted(rows, key=lambda r: -r[2])[:n]


def format_sources(rows: list[tuple[str, str, float, int]], width: int = 150) -> str:
    """The top-sources table (:func:`top_sources`), places cut to ``width`` characters."""
    return format_rows("top ops by source (ms per step, calls per step, op, where)", rows, 28, width)

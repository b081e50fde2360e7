"""Where a step's device time goes: the profiler's CUDA kernels grouped by what they do.

Why: a recipe's step time against bf16 says how far it is from a target, not which part to make
faster. Grouping the kernels of a few profiled steps (GEMMs, our Triton quantizers, the SSD scan, the
fused glue, attention, the optimizer, the eager elementwise ops between them) gives device time per
group and launches per step; busy time well below the wall-clock step means the GPU waited on the
host (Python, launches) rather than on any kernel.

Kernel names are matched by substring, first group wins: our Triton kernels by their function names
(numerics/kernels, model/ssd_kernels, model/conv_triton.py), torch.compile's by inductor's
``triton_poi/red/per`` prefixes, cuBLAS / CUTLASS GEMMs by their library prefixes. Used by
``log.profile_steps`` (step_profiler.py) and the bench scripts (scripts/step_profile.py).
"""

from __future__ import annotations

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("all-reduce (NCCL)", ("nccl",)),
    (
        "quantize, GEMM epilogue (Triton)",
        (
            "_quantize_rows_kernel",
            "_quantize_rows_whole_kernel",
            "_scaled_gemm_kernel",
            "_scaled_gemm_tma_kernel",
            "_quantize_fp8_kernel",
            "_rht_kernel",
            "_abs_max_kernel",
            "_block_values",
            "_scale_to_bf16",
        ),
    ),
    (
        "SSD scan (Triton)",
        ("_chunk_cumsum", "_chunk_scan", "_chunk_states", "_scan_grads", "_state_grads"),
    ),
    ("conv (Triton)", ("_conv_silu", "_conv_pre")),
    (
        "glue (our Triton)",
        ("_norm_fwd", "_norm_bwd", "_gated_fwd", "_gated_bwd", "_squared_relu", "_dt_softplus"),
    ),
    ("decode step (Triton: Mamba-2 step, GQA decode)", ("_mamba_decode", "_gqa_decode")),
    ("fused glue (torch.compile)", ("triton_poi", "triton_red", "triton_per")),
    ("attention", ("flash", "fmha", "attention")),
    ("GEMM (cuBLAS / CUTLASS)", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "sm80_")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss")),
)
OTHER = "other (eager elementwise, casts, copies)"


def category(kernel: str) -> str:
    """The group of a CUDA kernel, by its name."""
    lower = kernel.lower()
    for name, fragments in CATEGORIES:
        if any(f in lower for f in fragments):
            return name
    return OTHER


def device_us(event) -> float:
    """A profiler event's device time in microseconds (the attribute's name changed across torch)."""
    for attr in ("device_time_total", "cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def breakdown(events, steps: int) -> dict[str, tuple[float, int]]:
    """group -> (device ms per step, launches per step) over ``steps`` profiled steps, from the
    key-averaged events of a CUDA-only profile."""
    out: dict[str, tuple[float, int]] = {}
    for event in events:
        ms, n = out.get(category(event.key), (0.0, 0))
        out[category(event.key)] = (ms + device_us(event) / 1e3 / steps, n + event.count)
    return {k: (ms, round(n / steps)) for k, (ms, n) in out.items()}


def top_kernels(events, steps: int, n: int = 20) -> list[tuple[str, str, float, int]]:
    """The ``n`` kernels with the most device time: (name, group, ms per step, launches per step).

    Why: a group says which part to look at; within "other" only the kernel names say which eager
    op (a cast, a copy, a fill) is worth fusing away."""
    rows = [(e.key, category(e.key), device_us(e) / 1e3 / steps, round(e.count / steps)) for e in events]
    return sorted(rows, key=lambda r: -r[2])[:n]


def format_rows(header: str, rows, label_width: int, width: int) -> str:
    """rows of (label, text, ms, count) -> the indented table under ``header``, text cut to ``width``."""
    lines = [f"  {header}:"]
    for label, text, ms, n in rows:
        lines.append(f"    {ms:8.2f} ms {n:5d}  {label:<{label_width}} {text[:width]}")
    return "\n".join(lines)


def format_top(rows: list[tuple[str, str, float, int]], width: int = 200) -> str:
    """The top-kernels table, names cut to ``width`` characters."""
    short = [(group.split(" (")[0], name, ms, n) for name, group, ms, n in rows]
    return format_rows("top kernels (ms per step, launches per step, group)", short, 12, width)


def format_breakdown(title: str, groups: dict[str, tuple[float, int]], wall_ms: float) -> str:
    """The table: groups by device time, then GPU busy time against the wall-clock step."""
    lines = [f"{title}: GPU time per step by kernel group"]
    for name, (ms, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {name:<42}{ms:9.2f} ms {n:6d} launches")
    busy = sum(ms for ms, _ in groups.values())
    lines.append(f"  {'GPU busy':<42}{busy:9.2f} ms {sum(n for _, n in groups.values()):6d} launches")
    lines.append(f"  {'wall-clock step':<42}{wall_ms:9.2f} ms (GPU idle {max(0.0, wall_ms - busy):.2f} ms)")
    return "\n".join(lines)

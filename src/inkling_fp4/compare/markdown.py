"""Markdown pieces every comparison report uses."""

from __future__ import annotations


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def cell(text: str) -> str:
    """Text inside a markdown table cell (a bare | would end the cell: |Δ log p|)."""
    return text.replace("|", "\\|")


def monitor_section(data: dict) -> list[str]:
    """What the noise monitor did in each run: a skipped update or a BF16 stretch changes what a
    gap compares, so the reader must see them."""
    runs = {f"{data['baseline']['label']} (baseline)": data["baseline"]} | data["runs"]
    lines = ["", "## Noise monitor", ""]
    if not any(r["monitor"]["skipped_updates"] or r["monitor"]["fallback_spans"] for r in runs.values()):
        return lines + ["The noise monitor skipped no update and moved no run to BF16."]
    lines += [
        "Updates the noise monitor skipped (a loss or grad-norm spike, or a non-finite value) and the "
        "stretches it ran in BF16 after repeated triggers (logged steps). Within such a stretch a gap "
        "compares against BF16, not against the run's recipe.",
        "",
    ]
    rows = []
    for label, r in runs.items():
        skips, spans = r["monitor"]["skipped_updates"], r["monitor"]["fallback_spans"]
        steps = ", ".join(map(str, skips[:12])) + (f", ... ({len(skips)} in all)" if len(skips) > 12 else "")
        bf16 = ", ".join(f"{a}-{b}" for a, b in spans) or "none"
        rows.append([label, str(len(skips)), steps or "-", bf16])
    return lines + table(["run", "updates skipped", "at steps", "BF16 fallback (steps)"], rows)

"""Which two runs may be compared: the same model, data, seed and schedule, different precision.

Runs with different seeds see different batches from different initial weights, which moves the loss
by more than the paper's < 1% gap; a different schedule or data changes the curve itself. So a pair
that differs in any compared key is refused, naming every such key. A key missing from an older
run's ``config.yaml`` counts as its default value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inkling_fp4.config import RunConfig, to_dict
from inkling_fp4.errors import UserError
from inkling_fp4.runs.directory import flatten, recorded_config_data

COMPARED_SECTIONS = ("model", "data", "optim", "sft")
"""Sections compared key by key (minus IGNORED_KEYS)."""
STAGE_SECTIONS = {"rollout": ("rl", "sampler")}
"""Sections compared only where a run is of that stage (the other stages never read them)."""
COMPARED_KEYS = (
    "stage",
    "init_from",
    "train.seed",
    "train.init_seed",
    "train.steps",
    "train.batch_size",
    "train.warmup_steps",
    "train.decay_fraction",
    "train.decay_shape",
    "train.min_lr_ratio",
    "eval.batches",
)
"""Single keys compared outside those sections: the seeds, the WSD schedule, the validation set size."""
IGNORED_KEYS = (
    "model.ssd_impl",
    "model.chunk_size",
    "data.cache_dir",
    "data.shard_tokens",
    "data.verify_checksums",
    "sampler.check_every",
    "sampler.device",
    "sampler.cuda_graph",
)
"""Keys that change speed or where files live, not the numbers."""


def _compared(flat: dict[str, Any], sections: tuple[str, ...]) -> dict[str, Any]:
    keep = {}
    for key, value in flat.items():
        section = key.split(".", 1)[0]
        if key in IGNORED_KEYS:
            continue
        if section in sections or key in COMPARED_KEYS:
            keep[key] = value
    return keep


def _same(a: Any, b: Any) -> bool:
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if number(a) and number(b):  # 10 and 10.0 are the same warmup
        return float(a) == float(b)
    return a == b


def config_differences(config_a: dict, config_b: dict) -> list[tuple[str, Any, Any]]:
    """``(key, value_a, value_b)`` for every compared key whose values differ (plain config data)."""
    defaults = flatten(to_dict(RunConfig()))
    flat_a, flat_b = {**defaults, **flatten(config_a)}, {**defaults, **flatten(config_b)}
    sections = COMPARED_SECTIONS
    for stage in dict.fromkeys((flat_a.get("stage"), flat_b.get("stage"))):
        sections += STAGE_SECTIONS.get(stage, ())
    a, b = _compared(flat_a, sections), _compared(flat_b, sections)
    missing = object()
    diffs = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va is missing or vb is missing or not _same(va, vb):
            diffs.append((key, None if va is missing else va, None if vb is missing else vb))
    return diffs


def read_config_data(run_dir: str | Path) -> dict:
    """The plain data of ``<run_dir>/config.yaml`` with the run's amendments (``amendments.jsonl``)."""
    data = recorded_config_data(Path(run_dir))
    if data is None:
        raise UserError(f"no config.yaml in {run_dir}: pass a run directory written by `fp4train pretrain`")
    return data


def describe_differences(diffs: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{key} ({va!r} vs {vb!r})" for key, va, vb in diffs)


def check_comparable(run_a: str | Path, run_b: str | Path, allow: tuple[str, ...] = ()) -> None:
    """Raise a UserError naming the differing keys unless the runs differ only in precision and ``allow``."""
    diffs = config_differences(read_config_data(run_a), read_config_data(run_b))
    diffs = [d for d in diffs if d[0] not in allow]
    if diffs:
        first_key, _, first_b = diffs[0]
        raise UserError(
            f"{run_a} and {run_b} cannot be compared: they differ in {describe_differences(diffs)}; "
            "a loss gap needs the same model, data, seed and schedule, so rerun one of them with the "
            f"other's values (e.g. {first_key}={first_b})"
        )

"""The comparison report from hand-made runs: valid PNGs, report.md and report.json with the same numbers."""

import json
import sys
import types

import numpy as np
import pytest

from inkling_fp4.compare.loss_report import render_markdown, wandb_summary
from inkling_fp4.compare.loss_summary import summarize
from inkling_fp4.compare.report import write_report
from metrics_fixture import make_pair

GAPS = {"warmup": 0.03, "stable": 0.005, "decay": 0.012}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("report")
    a, b = make_pair(tmp_path, GAPS, precision_penalty=0.01)
    out = write_report(
        summarize({"nvfp4": a}, b, window=1, about={"nvfp4": "the recipe"}), tmp_path / "report", wandb=False
    )
    return out, json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def test_report_files_exist_and_plots_are_png(report):
    out, data, _ = report
    for name in ("loss.png", "gap.png"):
        w, h = _png_size(out / name)
        assert w > 400 and h > 300
    assert data["plots"] == {"loss": "loss.png", "gap": "gap.png"}


def test_report_json_numbers(report):
    _, data, _ = report
    assert data["baseline"]["label"] == "fp8" and data["baseline"]["recipe"] == "fp8"
    r = data["runs"]["nvfp4"]
    assert r["recipe"] == "nvfp4"
    assert r["boundaries"] == {"total_steps": 100, "warmup_end": 11, "decay_start": 81, "switch_step": 81}
    for phase in ("warmup", "stable", "decay", "after_switch"):
        assert r["phases"]["train"][phase]["mean_gap"] == pytest.approx(
            GAPS["decay" if phase == "after_switch" else phase]
        )
    assert r["phases"]["train"]["end"]["end_gap"] == pytest.approx(GAPS["decay"])
    assert r["final"]["train"]["step"] == 100 and r["final"]["train"]["gap"] == pytest.approx(GAPS["decay"])
    assert r["final"]["val"]["step"] == 100 and r["final"]["val"]["gap"] == pytest.approx(GAPS["decay"])
    in_precision = (1 + GAPS["decay"]) * 1.01 - 1  # the run's own-precision eval is 1% above its BF16 one
    assert r["final"]["val_in_training_precision"]["gap"] == pytest.approx(in_precision)
    assert r["about"] == "the recipe"
    assert r["verdict"]["within"] is True
    assert [c["ok"] for c in r["verdict"]["checks"]] == [True, True]
    assert data["verdict"] == r["verdict"]["line"]
    assert len(r["series"]["train"]["gap"]) == 100 and len(r["series"]["val"]["gap"]) == 6


def test_report_md_shows_the_json_numbers(report):
    _, data, md = report
    r = data["runs"]["nvfp4"]
    assert f"**Verdict:** {data['verdict']}" in md
    assert "![relative gap](gap.png)" in md and "![loss curves](loss.png)" in md
    # the summary row: stable mean, stable max, decay max, after switch end, final train, final val
    assert "| nvfp4 | +0.50% | +0.50% | +1.20% | +1.20% | +1.20% | +1.20% | +2.21% | within |" in md
    assert "| nvfp4 | nvfp4 | the recipe |" in md
    assert "| stable | 11-80 | 352-2.56K | +0.50% | +0.50% | +0.50% | +0.50% | +0.50% | +0.50% |" in md
    assert f"{r['final']['val']['loss']:.4f}" in md
    assert "warmup until step 10, stable from step 11, decay from step 81; BF16 GEMMs: from step 81" in md


def test_markdown_renders_missing_phases_as_na(report):
    data = json.loads(json.dumps(report[1]))
    data["runs"]["nvfp4"]["phases"]["train"]["decay"] = None
    md = render_markdown(data)
    assert "| decay | n/a | n/a | n/a | n/a | n/a | n/a |" in md


def test_several_runs_get_one_row_each_and_one_curve_each(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 30))  # the same baseline losses for both pairs
    a, b = make_pair(tmp_path, GAPS, seed=seed)
    c_dir, _ = make_pair(tmp_path / "mx", {"warmup": 0.05, "stable": 0.02, "decay": 0.03}, seed=seed)
    out = write_report(summarize({"nvfp4": a, "mxfp4": c_dir}, b, window=1), tmp_path / "rep", wandb=False)
    data = json.loads((out / "report.json").read_text())
    assert list(data["runs"]) == ["nvfp4", "mxfp4"]
    assert data["runs"]["mxfp4"]["verdict"]["within"] is False
    assert data["verdict"].startswith("nvfp4 vs fp8: within")
    md = (out / "report.md").read_text()
    assert "| mxfp4 | +2.00% | +2.00% | +3.00% |" in md


def test_wandb_gets_the_same_numbers(tmp_path, monkeypatch):
    calls = {"log": [], "summary": {}}

    class FakeRun:
        summary = calls["summary"]

        def log(self, row, step=None):
            calls["log"].append((step, row))

        def finish(self):
            calls["finished"] = True

    fake = types.SimpleNamespace(
        init=lambda **kw: calls.update(init=kw) or FakeRun(), Image=lambda path: ("image", path)
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    a, b = make_pair(tmp_path, GAPS)
    out = write_report(summarize({"nvfp4": a}, b, window=1), tmp_path / "rep", wandb=True)
    data = json.loads((out / "report.json").read_text())
    assert calls["init"]["mode"] == "offline" and calls["finished"]
    assert (
        calls["summary"]["compare/nvfp4/phases/train/stable/max_gap"]
        == data["runs"]["nvfp4"]["phases"]["train"]["stable"]["max_gap"]
    )
    assert calls["summary"] == {**wandb_summary(data), "compare/verdict": data["verdict"]}
    step_rows = dict(calls["log"][:-1])
    assert step_rows[50]["compare/nvfp4/gap_train"] == pytest.approx(0.005)
    assert step_rows[100]["compare/nvfp4/gap_val"] == pytest.approx(0.012)
    assert calls["log"][-1][1]["compare/gap"] == ("image", str(out / "gap.png"))


def test_report_lists_what_the_noise_monitor_did(tmp_path):
    """Skipped updates (event rows) and BF16 fallback stretches (the steps logged as bf16-fallback)
    of every run, the baseline included; none at all is said in one line."""
    a, b = make_pair(tmp_path, GAPS)
    rows = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if 30 <= r.get("step", 0) <= 39 or r.get("step", 0) in (60, 61):
            r["precision"] = "bf16-fallback"
    events = [
        {"step": s, "event": e, "message": "m", "loss": 9.0}
        for s, e in ((29, "grad_spike"), (45, "loss_spike"), (29, "grad_spike"))
    ]
    (b / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows + events) + "\n")
    data = json.loads(
        (
            write_report(summarize({"nvfp4": a}, b, window=1), tmp_path / "rep", wandb=False) / "report.json"
        ).read_text()
    )
    monitor = data["baseline"]["monitor"]
    assert monitor == {"skipped_updates": [29, 45], "fallback_spans": [[30, 39], [60, 61]]}
    assert data["runs"]["nvfp4"]["monitor"] == {"skipped_updates": [], "fallback_spans": []}
    md = render_markdown(data)
    assert "| fp8 (baseline) | 2 | 29, 45 | 30-39, 60-61 |" in md and "| nvfp4 | 0 | - | none |" in md
    clean = json.loads(json.dumps(data))
    clean["baseline"]["monitor"] = {"skipped_updates": [], "fallback_spans": []}
    assert "skipped no update and moved no run to BF16" in render_markdown(clean)

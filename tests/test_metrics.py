"""metrics.jsonl stays strict JSON: non-finite numbers become null and are named; the console line and
wandb cope; truncating on resume survives garbage and invalid UTF-8."""

import json
import math

import numpy as np
import pytest

from inkling_fp4.runs.metrics import MetricsLogger, sanitize, step_line, truncate_metrics


def _strict(line: str) -> dict:
    def refuse(name):
        raise AssertionError(f"bare {name} in {line!r}")

    return json.loads(line, parse_constant=refuse)


def _record(**changes):
    r = {
        "step": 3, "tokens": 96, "loss": 3.25, "lr": 1e-3, "grad_norm": 0.5, "precision": "nvfp4",
        "tokens_per_s": 1234.0, "mfu": None, "eta_s": 12.0,
    }  # fmt: skip
    return {**r, **changes}


def test_sanitize_names_every_nonfinite_field_at_any_depth():
    out = sanitize(
        {
            "step": 1,
            "loss": math.nan,
            "gnorm": -math.inf,
            "layers": [1.0, math.inf],
            "eval": {"l": np.float32("nan")},
        }
    )
    assert out["loss"] is None and out["gnorm"] is None and out["layers"] == [1.0, None]
    assert out["eval"] == {"l": None}
    assert out["nonfinite"] == ["loss", "gnorm", "layers[1]", "eval.l"]
    assert "nonfinite" not in sanitize({"step": 1, "loss": 2.0, "ok": True, "n": np.int64(3)})


def test_logged_lines_are_strict_json(tmp_path):
    log = MetricsLogger(tmp_path, run_name="t", total_steps=10, progress=False)
    log.log_step(_record(loss=math.nan, grad_norm=math.inf))
    log.event(4, "spike", "monitor: spike", loss=-math.inf)
    log.log({"step": 5, "val_loss": 2.0})
    log.close()
    rows = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] is None and rows[0]["grad_norm"] is None
    assert rows[0]["nonfinite"] == ["loss", "grad_norm"] and rows[0]["lr"] == 1e-3
    assert rows[1]["loss"] is None and rows[1]["nonfinite"] == ["loss"]
    assert rows[2] == {"step": 5, "val_loss": 2.0}


def test_console_line_renders_nonfinite_and_missing_values(capsys, tmp_path):
    line = step_line(
        3, 100, _record(loss=math.nan, grad_norm=-math.inf, tokens_per_s=math.inf, eta_s=math.nan)
    )
    assert "loss nan" in line and "gnorm -inf" in line and "tok/s inf" in line and "mfu n/a" in line
    assert "eta ?" in line
    written = sanitize(_record(loss=math.nan))  # a record already sanitized: None named nonfinite
    assert "loss nan" in step_line(3, 100, written)
    assert "gnorm n/a" in step_line(3, 100, _record(grad_norm=None, eta_s=None))
    assert step_line(3, 100, _record(mfu=0.25)).startswith(
        "step   3/100 | loss 3.2500 | lr 1.00e-03 | gnorm 0.500"
    )
    log = MetricsLogger(tmp_path, run_name="t", total_steps=100, progress=False)
    log.log_step(_record(loss=math.nan))
    log.close()
    assert "loss nan" in capsys.readouterr().out


def test_wandb_gets_only_finite_numbers(tmp_path):
    class FakeWandb:
        rows = []

        def log(self, row, step):
            self.rows.append((step, row))

        def finish(self):
            pass

    log = MetricsLogger(tmp_path, run_name="t", total_steps=10, progress=False)
    log._wandb = FakeWandb()
    log.log_step(_record(loss=math.nan, grad_norm=math.inf))
    ((step, row),) = FakeWandb.rows
    assert step == 3 and "loss" not in row and "grad_norm" not in row and row["lr"] == 1e-3
    assert all(math.isfinite(v) for v in row.values())
    log._wandb = None
    log.close()


def test_truncate_survives_garbage_and_invalid_utf8(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        b'{"step": 1, "loss": 3.0}',
        b'{"step": 2, "loss": \xff\xfe}',  # invalid UTF-8
        b"\x00\x00garbage",
        b'{"step": 3, "loss": NaN}',  # written by an older version: kept, made strict
        b'["not", "a", "record"]',
        b'{"step": "x"}',
        b'{"step": 4, "loss": 2.5}',
        b'{"step": 9, "loss": 1.0}',
        b'{"step": 10, "lo',  # cut short by a crash
    ]
    path.write_bytes(b"\n".join(lines))
    truncate_metrics(path, 4)
    rows = [_strict(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3, 4]
    assert rows[1] == {"step": 3, "loss": None, "nonfinite": ["loss"]}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary left


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_resume_appends_strict_lines(tmp_path, value):
    log = MetricsLogger(tmp_path, run_name="t", total_steps=10, progress=False)
    log.log_step(_record(step=1, loss=value))
    log.log_step(_record(step=2))
    log.close()
    log = MetricsLogger(tmp_path, run_name="t", total_steps=10, start_step=1, progress=False)
    log.log_step(_record(step=2, loss=value))
    log.close()
    rows = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] is None for r in rows)

"""compare-baseline end to end on CPU: the tiny recipe in FP8 and NVFP4, then the report files;
and the command line for comparing two existing runs."""

import json
import sys

import pytest

from inkling_fp4.cli import main
from inkling_fp4.config import load_config
from inkling_fp4.errors import ConfigError, UserError
from inkling_fp4.train.compare_baseline import compare_runs, plan_runs, run_compare, trained_steps
from metrics_fixture import make_pair, write_run

TINY = [
    "train.steps=6",
    "train.log_every=1",
    "train.warmup_steps=1",
    "train.batch_size=2",
    "train.checkpoint_every=0",
    "eval.every=3",
    "eval.batches=1",
    "data.seq_len=32",
    "data.max_documents=20",
    "log.progress=false",
]


@pytest.mark.slow
def test_tiny_comparison_trains_both_runs_and_writes_the_report(tmp_path):
    cfg = load_config("tiny", TINY)
    lines = []
    report = run_compare(cfg, tmp_path, echo=lines.append)
    assert report == tmp_path / "report"
    for name in ("loss.png", "gap.png", "report.md", "report.json"):
        assert (report / name).is_file()
    assert (report / "gap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((report / "report.json").read_text())
    assert data["baseline"]["recipe"] == "fp8" and list(data["runs"]) == ["nvfp4"]
    r = data["runs"]["nvfp4"]
    assert r["boundaries"] == {"total_steps": 6, "warmup_end": 2, "decay_start": 6, "switch_step": 6}
    assert r["series"]["train"]["steps"] == [1, 2, 3, 4, 5, 6]
    assert r["final"]["val"]["step"] == 6 and r["final"]["train"]["step"] == 6
    # the gap in the report is the gap of the logged losses
    base = [json.loads(x) for x in (tmp_path / "fp8" / "metrics.jsonl").read_text().splitlines()]
    run = [json.loads(x) for x in (tmp_path / "nvfp4" / "metrics.jsonl").read_text().splitlines()]
    val_b = [x["val_loss_bf16"] for x in base if "val_loss_bf16" in x][-1]
    val_a = [x["val_loss_bf16"] for x in run if "val_loss_bf16" in x][-1]
    assert r["final"]["val"]["gap"] == pytest.approx((val_a - val_b) / val_b, rel=1e-12)
    # the baseline is the paper's FP8 one (no switch), the NVFP4 run logged its live gap to it
    assert {x["precision"] for x in base if "loss" in x and "event" not in x} == {"fp8"}
    live = [x for x in run if "gap" in x and "event" not in x]
    assert len(live) == 6 and all(x["baseline_loss"] is not None for x in live)
    assert data["verdict"] in (report / "report.md").read_text()
    # a second call reuses the finished runs and only rewrites the report
    lines.clear()
    assert run_compare(cfg, tmp_path, echo=lines.append) == report
    assert sum("reusing" in line for line in lines) == 2


def test_plan_of_runs_with_extra_recipes_and_ablations():
    cfg = load_config("tiny", ["train.steps=100"])
    plan = plan_runs(cfg, ["bf16", "mxfp4"], ["rht", "sr", "2d", "bf16-layers", "switch"])
    labels = [p.label for p in plan]
    assert labels == [
        "fp8",
        "nvfp4",
        "bf16",
        "mxfp4",
        "nvfp4-no-rht",
        "nvfp4-no-sr",
        "nvfp4-no-2d",
        "nvfp4-no-bf16-layers",
        "nvfp4-no-switch",
    ]
    by = {p.label: p.cfg for p in plan}
    assert by["fp8"].precision.recipe == "fp8" and by["fp8"].precision.switch_to_bf16 == "never"
    assert by["fp8"].precision.bf16_first_layers is None  # the FP8 recipe's own default layers
    assert by["nvfp4"].precision == cfg.precision
    assert by["nvfp4-no-rht"].precision.rht is False and by["nvfp4-no-rht"].precision.stochastic_rounding
    assert by["nvfp4-no-sr"].precision.stochastic_rounding is False
    assert by["nvfp4-no-2d"].precision.weight_2d is False
    assert (
        by["nvfp4-no-bf16-layers"].precision.bf16_first_layers,
        by["nvfp4-no-bf16-layers"].precision.bf16_last_layers,
    ) == (0, 0)
    assert by["nvfp4-no-switch"].precision.switch_to_bf16 == "never"
    no_switch = plan[-1]
    assert (no_switch.branch_from, no_switch.branch_step) == ("nvfp4", 80)  # the decay starts at step 81
    for p in plan:  # everything but precision is the recipe's
        assert (p.cfg.model, p.cfg.data, p.cfg.train, p.cfg.optim) == (
            cfg.model,
            cfg.data,
            cfg.train,
            cfg.optim,
        )
        assert p.cfg.name == f"tiny-{p.label}"


@pytest.mark.parametrize(
    "overrides, withs, ablate, match",
    [
        (["precision.recipe=fp8"], [], [], "baseline itself"),
        ([], ["fp4"], [], "--with fp4"),
        ([], [], ["dropout"], "--ablate dropout"),
        (["precision.recipe=mxfp4"], [], ["2d"], "no such piece"),
        (["precision.switch_to_bf16=never"], [], ["switch"], "never switches"),
        (["train.stop_after=3"], [], [], "stop_after"),
    ],
)
def test_plan_refuses_what_makes_no_sense(overrides, withs, ablate, match):
    with pytest.raises(ConfigError, match=match):
        plan_runs(load_config("tiny", overrides), withs, ablate)


def test_a_run_directory_holding_another_run_is_not_reused(tmp_path):
    cfg = load_config("tiny", TINY)
    write_run(tmp_path / "fp8", {1: 3.0}, precision="fp8")  # the fixture's config, not this one
    with pytest.raises(UserError, match="holds a different run"):
        run_compare(cfg, tmp_path, echo=lambda _: None)


def test_compare_runs_of_existing_directories(tmp_path):
    a, b = make_pair(tmp_path, {"warmup": 0.03, "stable": 0.005, "decay": 0.012})
    out = compare_runs(a, b, tmp_path / "out")
    data = json.loads((out / "report.json").read_text())
    assert list(data["runs"]) == ["nvfp4"] and data["baseline"]["label"] == "fp8"
    assert (out / "gap.png").is_file() and (out / "report.md").is_file()


def _cli(monkeypatch, capsys, *args):
    """Run the command line in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["fp4train", *args])
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_cli_compares_two_runs_and_refuses_mismatched_ones(tmp_path, monkeypatch, capsys):
    a, b = make_pair(tmp_path, {"warmup": 0.03, "stable": 0.005, "decay": 0.012})
    code, out, err = _cli(monkeypatch, capsys, "compare-baseline", "--run", str(a), "--baseline", str(b))
    assert code == 0, err
    assert (a / "report" / "report.md").is_file() and "report:" in out
    other = write_run(tmp_path / "other", {1: 3.0}, overrides=["train.seed=5"])
    code, _, err = _cli(monkeypatch, capsys, "compare-baseline", "--run", str(other), "--baseline", str(b))
    assert code == 2 and "train.seed (5 vs 0)" in err
    code, _, err = _cli(monkeypatch, capsys, "compare-baseline", "--run", str(a))
    assert code == 2 and "--run and --baseline go together" in err
    code, _, err = _cli(monkeypatch, capsys, "compare-baseline", "--ablate", "dropout")
    assert code == 2 and "--ablate dropout" in err


class FakeTrainer:
    """Stands in for train.stages.run_stage: logs a loss per step (the recipe shifts it), writes a checkpoint
    where it stops, resumes from the newest one, and can be told to stop early (an interrupt)."""

    OFFSET = {"fp8": 0.0, "nvfp4": 0.01, "bf16": -0.005}

    def __init__(self):
        self.calls = []
        self.interrupt_at = None

    def __call__(self, cfg, run_dir, resume=False, baseline=None):
        from inkling_fp4.config import save_config
        from inkling_fp4.runs.metrics import truncate_metrics

        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        ckpts = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")) if resume else []
        start = ckpts[-1] if ckpts else 0
        self.calls.append((cfg.name, cfg.train.stop_after, start, baseline))
        truncate_metrics(run_dir / "metrics.jsonl", start)
        end = min(cfg.train.stop_after or cfg.train.steps, self.interrupt_at or cfg.train.steps)
        switch = 10**9 if cfg.precision.switch_to_bf16 == "never" else 81
        with open(run_dir / "metrics.jsonl", "a" if start else "w") as f:
            for step in range(start + 1, end + 1):
                recipe = "bf16" if step >= switch else cfg.precision.recipe
                loss = 5.0 - 0.01 * step + self.OFFSET.get(recipe, 0.02)
                f.write(
                    json.dumps({"step": step, "tokens": 32 * step, "loss": loss, "precision": recipe}) + "\n"
                )
                if step % 50 == 0 or step == cfg.train.steps:
                    f.write(
                        json.dumps({"step": step, "tokens": 32 * step, "val_loss_bf16": loss + 0.1}) + "\n"
                    )
        (run_dir / "checkpoints" / f"step_{end}").mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints" / f"step_{end}" / "state.json").write_text("{}")
        return run_dir


def test_orchestration_branches_the_no_switch_run_and_resumes_interrupted_runs(tmp_path, monkeypatch):
    import inkling_fp4.train.stages as stages

    fake = FakeTrainer()
    monkeypatch.setattr(stages, "run_stage", fake)
    cfg = load_config("tiny", ["train.steps=100", "train.log_every=1", "train.warmup_steps=10"])
    fake.interrupt_at = 30  # every run stops at step 30 (an interrupt): no report yet
    assert run_compare(cfg, tmp_path, ablate=["switch"], echo=lambda _: None) is None
    assert fake.calls == [("tiny-fp8", None, 0, None)]
    fake.interrupt_at = None
    report = run_compare(cfg, tmp_path, ablate=["switch"], echo=lambda _: None)
    fp8 = tmp_path / "fp8"
    assert fake.calls[1:] == [
        ("tiny-fp8", None, 30, None),  # resumed
        ("tiny-nvfp4", 80, 0, fp8),  # to the step before the switch, logging its live gap to fp8
        ("tiny-nvfp4", None, 80, fp8),  # then on to the end
        ("tiny-nvfp4-no-switch", None, 80, fp8),  # from nvfp4's checkpoint at step 80
    ]
    data = json.loads((report / "report.json").read_text())
    nvfp4, no_switch = data["runs"]["nvfp4"], data["runs"]["nvfp4-no-switch"]
    assert nvfp4["series"]["train"]["gap"][:80] == no_switch["series"]["train"]["gap"][:80]
    assert no_switch["boundaries"]["switch_step"] is None and nvfp4["boundaries"]["switch_step"] == 81
    base = 5.0 - 0.01 * 98  # the baseline's loss at step 100, mean over the 5-step window 96-100
    assert nvfp4["final"]["train"]["gap"] == pytest.approx(
        -0.005 / base, rel=1e-9
    )  # in BF16 after the switch
    assert no_switch["final"]["train"]["gap"] == pytest.approx(0.01 / base, rel=1e-9)
    assert no_switch["about"] == "no switch to BF16 before the decay"
    # everything finished: a third call trains nothing
    n = len(fake.calls)
    assert run_compare(cfg, tmp_path, ablate=["switch"], echo=lambda _: None) == report
    assert len(fake.calls) == n


def test_trained_steps_counts_a_checkpoint_past_the_last_logged_step(tmp_path):
    """A run stopped at the BF16 switch (1221 of hybrid-125m's 100M-token run, logging every 10)
    checkpoints a step it never logged: that step, not 1220, is where it stands."""
    rows = [{"step": s, "tokens": s * 100, "loss": 5.0} for s in (10, 20)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert trained_steps(tmp_path) == 20
    (tmp_path / "checkpoints" / "step_23").mkdir(parents=True)
    assert trained_steps(tmp_path) == 20  # no state.json yet: an unfinished write does not count
    (tmp_path / "checkpoints" / "step_23" / "state.json").write_text("{}")
    assert trained_steps(tmp_path) == 23


@pytest.mark.slow
def test_cli_noise_trains_the_baseline_from_other_weights(tmp_path, monkeypatch, capsys):
    """--noise on the tiny recipe: a third run, the fp8 baseline from train.init_seed = seed + 1 (its
    first loss differs from the baseline's: other weights), and the report reads the gap against it."""
    code, out, err = _cli(
        monkeypatch, capsys, "compare-baseline", "--noise", "--run-dir", str(tmp_path), *TINY, "train.seed=3"
    )
    assert code == 0, err
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert list(data["runs"]) == ["nvfp4", "fp8-reinit"] and data["noise_floor"]["label"] == "fp8-reinit"
    assert data["runs"]["nvfp4"]["verdict"]["beyond_noise"] is not None
    repeat = load_config(str(tmp_path / "fp8-reinit" / "config.yaml"))
    assert repeat.train.init_seed == 4 and repeat.train.seed == 3 and repeat.precision.recipe == "fp8"
    first = {
        label: next(json.loads(x) for x in (tmp_path / label / "metrics.jsonl").read_text().splitlines())
        for label in ("fp8", "fp8-reinit")
    }
    assert first["fp8"]["loss"] != first["fp8-reinit"]["loss"]
    code, _, err = _cli(monkeypatch, capsys, "compare-baseline", "--noise-run", str(tmp_path / "fp8"))
    assert code == 2 and "--noise-run go with --run / --baseline" in err

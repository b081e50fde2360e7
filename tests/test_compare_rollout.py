"""compare-baseline --stage rollout: the RL report's numbers on hand-made runs, the rl and sampler
sections in the comparability check, and the tiny RL comparison end to end on CPU (fp8, nvfp4, bf16)
with every reported number recomputed from the runs' own metrics.jsonl."""

import json
import math

import numpy as np
import pytest

from inkling_fp4.compare.compat import config_differences
from inkling_fp4.compare.metrics import metrics_from_rows
from inkling_fp4.compare.report import write_report
from inkling_fp4.compare.rl_gap import FIGURES, RL_KEYS, Figure, summarize_values, tail_window
from inkling_fp4.compare.rl_summary import summarize_rl
from inkling_fp4.config import RunConfig, apply_overrides, from_dict, load_config, save_config, to_dict
from inkling_fp4.errors import ConfigError
from inkling_fp4.runs.directory import flatten
from inkling_fp4.train.compare_baseline import compare_runs, plan_runs
from test_rollout import RL, base  # noqa: F401  (the tiny pretrain run every RL test starts from)
from test_run_dir import cli, one_line

# ----------------------------------------------------------------------------------------------
# the numbers, on hand-made runs


def write_rl_run(run_dir, lines, precision="nvfp4", steps=8):
    """A run directory with an RL config (``steps`` steps) and these metrics lines (dicts or text)."""
    run_dir.mkdir(parents=True)
    data = apply_overrides({}, ["stage=rollout", f"train.steps={steps}", f"precision.recipe={precision}"])
    save_config(from_dict(RunConfig, data), run_dir / "config.yaml")
    text = [x if isinstance(x, str) else json.dumps(x) for x in lines]
    (run_dir / "metrics.jsonl").write_text("\n".join(text) + "\n")
    return run_dir


def step_row(step, reward, **more):
    row = {"step": step, "loss": 0.0, "reward_mean": reward, "rl_step": step, "mismatch_k3": 1e-4 * step,
           "mismatch_abs_max": 0.01, "mismatch_ratio_min": 0.99, "time_train_s": float(step > 1) * step,
           "gen_tokens_per_s": 100.0 * step}  # fmt: skip
    return {**row, **more}


def hand_made_pair(tmp_path):
    """fp8: reward 0.1 s at step s; nvfp4: 0.11 s. Evaluations at steps 4 and 8. The baseline logs
    step 5 twice (a resume: the last row counts) and a skipped update at step 6 whose event repeats
    a reward (left out of the curves); nvfp4 ran steps 5-6 in the monitor's BF16 fallback."""
    base_lines = [step_row(s, 0.1 * s) for s in range(1, 9)]
    base_lines[4:4] = [step_row(5, 9.0)]  # the earlier row of step 5, replaced by the next
    base_lines += [{"step": 6, "event": "loss_spike", "reward_mean": 42.0}, "{not json",
                   {"step": 4, "eval_accuracy": 0.2}, {"step": 8, "eval_accuracy": 0.5}]  # fmt: skip
    run_lines = [step_row(s, 0.11 * s) for s in range(1, 9)]
    run_lines[6] = step_row(7, 0.77, mismatch_abs_max=0.3, mismatch_ratio_min=0.9)
    run_lines[0] = step_row(1, 0.11, mismatch_abs_max=5.0, mismatch_ratio_min=0.1, entropy=math.nan)
    for i in (4, 5):  # steps 5 and 6 ran in the monitor's BF16 fallback
        run_lines[i]["precision"] = "bf16-fallback"
    run_lines += [{"step": 4, "eval_accuracy": 0.25}, {"step": 8, "eval_accuracy": 0.5}]
    baseline = write_rl_run(tmp_path / "fp8", base_lines, precision="fp8")
    return write_rl_run(tmp_path / "nvfp4", run_lines), baseline


def test_rl_metrics_keep_a_steps_last_row_and_leave_out_events_junk_and_nan(tmp_path):
    run, baseline = hand_made_pair(tmp_path)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    m = metrics_from_rows(run, rows, RL_KEYS)
    assert "entropy" not in m.curves and m.nonfinite == 1  # the NaN entropy of step 1
    assert m.curve("reward_mean").steps.tolist() == list(range(1, 9))
    b = summarize_rl({"nvfp4": run}, baseline).baseline.metrics
    assert b.skipped_lines == 1
    assert b.curve("reward_mean").values.tolist() == pytest.approx([0.1 * s for s in range(1, 9)])


def test_tail_window_is_a_quarter_of_the_run_within_1_and_10_steps():
    assert [tail_window(n) for n in (1, 3, 4, 5, 8, 40, 41, 1000)] == [1, 1, 1, 2, 2, 10, 10, 10]


def test_summaries_reduce_over_the_tail_and_timings_leave_the_first_step_out():
    steps, values = np.arange(1, 6), np.array([10.0, 1.0, 2.0, 3.0, 4.0])
    mean = summarize_values(steps, values, Figure("x", "x"), window=3)
    assert (mean.value, mean.final, mean.points, mean.first_step) == (3.0, 4.0, 3, 3)
    assert summarize_values(steps, values, Figure("x", "x", reduce="min"), 3).value == 2.0
    assert summarize_values(steps, values, Figure("x", "x", reduce="max"), 5).value == 10.0
    warm = summarize_values(steps, values, Figure("x", "x", warm=True), window=100)
    assert (warm.value, warm.points) == (2.5, 4)
    assert summarize_values(steps, values, Figure("x", "x", over="all"), window=1).value == 4.0
    assert summarize_values(steps[:0], values[:0], Figure("x", "x"), 3) is None


def test_gap_and_figures_of_hand_made_runs(tmp_path):
    run, baseline = hand_made_pair(tmp_path)
    c = summarize_rl({"nvfp4": run}, baseline, about={"nvfp4": "the recipe"})
    assert c.window == 2  # 8 steps: a quarter
    s, b = c.runs["nvfp4"], c.baseline
    assert s.figures["reward_mean"].value == pytest.approx((0.77 + 0.88) / 2)
    assert s.figures["reward_mean"].final == pytest.approx(0.88)
    assert b.figures["reward_mean"].value == pytest.approx(0.75)
    assert s.gaps["reward_mean"].value == pytest.approx(0.075)  # steps 7 and 8: 0.07, 0.08
    assert s.gaps["reward_mean"].final == pytest.approx(0.08)
    assert s.differences["reward_mean"].gap == pytest.approx([0.01 * k for k in range(1, 9)])
    assert s.figures["eval_accuracy"].value == pytest.approx(0.375)  # the mean of all evaluations
    assert s.gaps["eval_accuracy"].final == pytest.approx(0.0)
    assert s.gaps["eval_accuracy"].value == pytest.approx(0.025)
    assert s.gaps["eval_accuracy"].points == 2
    assert s.figures["mismatch_k3"].value == pytest.approx(7.5e-4)
    assert s.figures["mismatch_abs_max"].value == 0.3  # step 1's 5.0 lies outside the tail
    assert s.figures["mismatch_ratio_min"].value == 0.9
    assert s.figures["time_train_s"].value == pytest.approx(7.5)
    whole = summarize_rl({"nvfp4": run}, baseline, window=8).runs["nvfp4"]  # the first step is a warm-up
    assert whole.figures["time_train_s"].value == pytest.approx(sum(range(2, 9)) / 7)
    assert s.figures["entropy"] is None
    assert "nvfp4 vs fp8: reward gap +0.075 over the last 2 steps (0.825 vs 0.750)" in s.headline
    assert "eval accuracy gap +0.000 at step 8 (0.500 vs 0.500), +0.025 over 2 evaluations" in s.headline

    out = write_report(c, tmp_path / "report")
    for name in ("reward.png", "gap.png", "mismatch.png", "report.md", "report.json"):
        assert (out / name).is_file()
    data = json.loads((out / "report.json").read_text())
    assert (data["stage"], data["baseline"]["label"], data["tail"]["window_steps"]) == ("rollout", "fp8", 2)
    r = data["runs"]["nvfp4"]
    assert r["gaps"]["reward_mean"]["value"] == s.gaps["reward_mean"].value
    assert r["gaps"]["eval_accuracy"]["series"]["diff"] == pytest.approx([0.05, 0.0])
    assert r["figures"]["gen_tokens_per_s"]["value"] == pytest.approx(750.0)
    assert [f["key"] for f in data["figures"]] == [f.key for f in FIGURES]
    md = (out / "report.md").read_text()
    assert s.headline in md
    assert data["seeds"] is None and "seeds" not in data["plots"] and "## Seeds" not in md
    assert not (out / "seeds.png").exists() and "| run | reward (last 2 steps) |" in md  # no seeds: no vs
    assert "| max \\|Δ log p\\| (max over the last 2 steps) | 1.00e-02 | 3.00e-01 |" in md
    assert "| nvfp4 | +0.075 | +0.080 | +0.000 | +0.025 | 2 |" in md
    assert data["baseline"]["monitor"] == {"skipped_updates": [6], "fallback_spans": []}
    assert r["monitor"] == {"skipped_updates": [], "fallback_spans": [[5, 6]]}
    assert (
        "## Noise monitor" in md
        and "| fp8 (baseline) | 1 | 6 | none |" in md
        and "| nvfp4 | 0 | - | 5-6 |" in md
    )


def test_rl_runs_compare_their_rl_and_sampler_sections_and_other_stages_do_not():
    rl = {"stage": "rollout", "rl": {"group_size": 4}, "sampler": {"temperature": 0.7, "device": "cpu"}}
    other = {"stage": "rollout", "rl": {"group_size": 8},
             "sampler": {"temperature": 1.0, "check_every": 2, "cuda_graph": False}}  # fmt: skip
    assert [d[0] for d in config_differences(rl, other)] == ["rl.group_size", "sampler.temperature"]
    sft = {**rl, "stage": "sft"}
    assert config_differences(sft, {**other, "stage": "sft"}) == []


def test_plan_of_an_rl_comparison_with_noise_repeats_each_precision_with_the_next_seed():
    cfg = load_config("rl-tiny", ["init_from=x", "train.seed=4", "sampler.seed=9"])
    assert [p.label for p in plan_runs(cfg, ["bf16"])] == ["fp8", "nvfp4", "bf16"]
    plan = {p.label: p.cfg for p in plan_runs(cfg, ["nvfp4-row"], ["sr"], noise=True)}
    assert list(plan) == ["fp8", "nvfp4", "nvfp4-row", "nvfp4-no-sr", "fp8-seed1", "nvfp4-seed1",
                          "nvfp4-row-seed1"]  # fmt: skip
    for label in ("fp8", "nvfp4", "nvfp4-row"):
        a, b = flatten(to_dict(plan[label])), flatten(to_dict(plan[f"{label}-seed1"]))
        assert {k: (a[k], b[k]) for k in a if a[k] != b[k]} == {
            "name": (f"rl-tiny-{label}", f"rl-tiny-{label}-seed1"),
            "train.seed": (4, 5),
            "sampler.seed": (9, 10),
        }
    assert (plan["nvfp4-row"].precision.recipe, plan["nvfp4-row"].precision.activation_scale) == (
        "nvfp4",
        "row",
    )


def test_nvfp4_row_is_a_precision_of_every_stage_and_a_row_recipe_is_labelled_so():
    pre = {p.label: p.cfg.precision for p in plan_runs(load_config("tiny", []), ["nvfp4-row"], noise=True)}
    assert list(pre) == ["fp8", "nvfp4", "nvfp4-row", "fp8-reinit"]  # pretraining's noise run unchanged
    assert (pre["nvfp4-row"].activation_scale, pre["nvfp4"].activation_scale) == ("row", "tensor")
    row = load_config("tiny", ["precision.activation_scale=row"])
    plan = {p.label: p.cfg.precision for p in plan_runs(row, ["nvfp4", "bf16"])}
    assert list(plan) == ["fp8", "nvfp4-row", "nvfp4", "bf16"]
    assert [x.activation_scale for x in plan.values()] == ["tensor", "row", "tensor", "tensor"]
    with pytest.raises(
        ConfigError, match="--with mxfp5: choose among bf16, fp8-tensorwise, mxfp4, nvfp4-row$"
    ):
        plan_runs(load_config("tiny", []), ["mxfp5"])


# ----------------------------------------------------------------------------------------------
# end to end on CPU

TINY_RL = [*RL, "train.steps=3", "eval.every=2", "sampler.max_new_tokens=8", "rl.reward=len_reward:reward"]
"""Three RL steps of 2 prompts x 4 completions; a reward of the completion's length (an untrained
model never answers right, and rewards of 0 everywhere would make every gap 0)."""
LABELS = ("fp8", "nvfp4", "bf16")


@pytest.fixture(scope="module")
def compared(base, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("rlcmp")
    (root / "len_reward.py").write_text("def reward(prompt, completion, answer):\n"
                                        "    return (len(completion) % 5) / 4\n")  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        code, out, err = cli(["compare-baseline", "--stage", "rollout", "--from", str(base), "--with", "bf16",
                              "--run-dir", str(root / "cmp"), *TINY_RL])  # fmt: skip
    assert code == 0, err
    return root / "cmp", out


def logged(run_dir, key):
    """{step: value} of the rows that have ``key`` (events left out, a step's last row kept)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r and "event" not in r}


def tail(values: dict, window: int, skip_first: bool = False) -> list[float]:
    steps = sorted(values)[1:] if skip_first else sorted(values)
    return [values[s] for s in steps if s > steps[-1] - window]


@pytest.mark.slow
def test_rl_comparison_reports_what_its_runs_logged(compared):
    cmp, out = compared
    report = cmp / "report"
    assert f"report: {report}" in out
    for name in ("reward.png", "gap.png", "mismatch.png", "report.md", "report.json"):
        assert (report / name).is_file()
    assert (report / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((report / "report.json").read_text())
    assert data["baseline"]["label"] == "fp8" and list(data["runs"]) == ["nvfp4", "bf16"]
    configs = {label: load_config(str(cmp / label / "config.yaml")) for label in LABELS}
    assert [configs[x].precision.recipe for x in LABELS] == list(LABELS)
    for label in LABELS:  # the same start, prompts, groups and sampling; only the precision differs
        c = configs[label]
        assert (c.init_from, c.train.seed, c.rl, c.sampler) == (
            configs["fp8"].init_from, configs["fp8"].train.seed, configs["fp8"].rl, configs["fp8"].sampler
        )  # fmt: skip
        assert not logged(cmp / label, "gap")  # no live loss gap for RL
    window = data["tail"]["window_steps"]
    assert window == tail_window(3)
    runs = {"fp8": data["baseline"], **data["runs"]}
    for label, r in runs.items():
        reward, evals = logged(cmp / label, "reward_mean"), logged(cmp / label, "eval_accuracy")
        assert sorted(reward) == [1, 2, 3] and sorted(evals) == [0, 2, 3]  # eval.at_start: step 0 too
        fig = r["figures"]
        assert fig["reward_mean"]["value"] == pytest.approx(np.mean(tail(reward, window)), abs=1e-12)
        assert fig["reward_mean"]["final"] == reward[3]
        assert fig["eval_accuracy"]["value"] == pytest.approx(np.mean(list(evals.values())), abs=1e-12)
        assert fig["eval_accuracy"]["final"] == evals[3]
        for key, reduce in (("mismatch_k3", np.mean), ("mismatch_abs_mean", np.mean),
                            ("mismatch_abs_max", np.max), ("mismatch_ratio_min", np.min)):  # fmt: skip
            assert fig[key]["value"] == pytest.approx(reduce(tail(logged(cmp / label, key), window)))
        for key in ("gen_tokens_per_s", "time_sample_s", "time_score_s", "time_train_s", "time_refresh_s"):
            assert fig[key]["value"] == pytest.approx(np.mean(tail(logged(cmp / label, key), window, True)))
    for label, r in data["runs"].items():
        for key, kind in (("reward_mean", "tail"), ("eval_accuracy", "all")):
            a, b = logged(cmp / label, key), logged(cmp / "fp8", key)
            diff = {s: a[s] - b[s] for s in sorted(a)}
            gap = r["gaps"][key]
            assert gap["series"]["diff"] == pytest.approx(list(diff.values()), abs=1e-15)
            assert gap["final"] == pytest.approx(diff[max(diff)], abs=1e-15)
            picked = tail(diff, window) if kind == "tail" else list(diff.values())
            assert gap["value"] == pytest.approx(np.mean(picked), abs=1e-12)
    assert data["headline"] == data["runs"]["nvfp4"]["headline"]
    assert data["headline"] in (report / "report.md").read_text()
    # two of its runs compared as existing directories: the same numbers
    again = json.loads((compare_runs(cmp / "nvfp4", cmp / "fp8", cmp / "again") / "report.json").read_text())
    assert again["runs"]["nvfp4"]["gaps"] == data["runs"]["nvfp4"]["gaps"]


@pytest.mark.slow
def test_rl_comparison_refusals_are_one_line(compared, base, tmp_path, monkeypatch):  # noqa: F811
    cmp, _ = compared
    monkeypatch.chdir(tmp_path)  # no runs/ here: nothing to start from
    cases = [
        (["--stage", "rollout", *TINY_RL], "no sft or pretrain run with a checkpoint under runs/"),
        (["--stage", "rollout", "--from", str(cmp / "fp8"), *TINY_RL], "a rollout run"),
        (["--stage", "rollout", "--from", str(tmp_path / "missing")], "no such directory"),
        (["--stage", "rollout", "--from", str(base), "--noise", "--with", "bf17", *TINY_RL], "--with bf17"),
        (["--stage", "rollout", "--from", str(base), *TINY_RL, "rl.group_size=3"], "train.batch_size"),
        (["--stage", "grpo"], "choose pretrain, sft or rollout"),
        (["--from", str(base)], "--from goes with --stage sft or rollout"),
    ]
    for args, match in cases:
        code, _, err = cli(["compare-baseline", *args])
        assert code == 2 and match in one_line(err), (args, err)
    assert not (tmp_path / "runs").exists()

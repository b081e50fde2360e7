"""compare-baseline --stage rollout --noise --with nvfp4-row on CPU: every precision repeated with the
next seed, the seed repeats' configs, --only of a seed repeat, and the report's seed figures, gaps,
spreads and verdicts recomputed from the runs' own metrics.jsonl."""

import json

import numpy as np
import pytest

from inkling_fp4.compare.compat import check_comparable, read_config_data
from inkling_fp4.compare.metrics import metrics_from_rows
from inkling_fp4.compare.report import write_report
from inkling_fp4.compare.rl_gap import RL_KEYS, tail_window
from inkling_fp4.compare.rl_seeds import BY_KEY
from inkling_fp4.compare.rl_seeds import seed_value as read_seed_value
from inkling_fp4.compare.rl_summary import summarize_rl
from inkling_fp4.errors import UserError
from inkling_fp4.runs.directory import flatten
from test_compare_rollout import TINY_RL, logged, step_row, write_rl_run
from test_rollout import base  # noqa: F401  (the tiny pretrain run every RL test starts from)
from test_run_dir import cli, one_line

SEEDS_RL = [*TINY_RL, "train.steps=5", "rl.eval_samples=2"]
"""Five steps (a tail of two), evaluations at steps 0, 2, 4 and 5 with two samples per problem."""
PRECISIONS = ("fp8", "nvfp4", "nvfp4-row")
RUNS = {p: [p, f"{p}-seed1"] for p in PRECISIONS}


@pytest.fixture(scope="module")
def seeded(base, tmp_path_factory):  # noqa: F811
    """The comparison's fp8-seed1 alone (--only), then the whole comparison (reusing it)."""
    root = tmp_path_factory.mktemp("rlseeds")
    (root / "len_reward.py").write_text("def reward(prompt, completion, answer):\n"
                                        "    return (len(completion) % 5) / 4\n")  # fmt: skip
    cmp = root / "cmp"
    args = ["compare-baseline", "--stage", "rollout", "--from", str(base), "--noise", "--with", "nvfp4-row",
            "--run-dir", str(cmp), *SEEDS_RL]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        code, only_out, err = cli([*args, "--only", "fp8-seed1"])
        assert code == 0, err
        after_only = sorted(p.name for p in cmp.iterdir())
        code, out, err = cli(args)
    assert code == 0, err
    return cmp, only_out, after_only, out


@pytest.mark.slow
def test_only_a_seed_repeat_trains_that_run_alone_and_the_full_command_reuses_it(seeded):
    cmp, only_out, after_only, out = seeded
    assert after_only == ["fp8-seed1"] and "report:" not in only_out
    assert sorted(logged(cmp / "fp8-seed1", "reward_mean")) == [1, 2, 3, 4, 5]
    assert f"{cmp / 'fp8-seed1'}: already trained to step 5, reusing it" in out
    assert sorted(p.name for p in cmp.iterdir()) == sorted(
        [*(r for rs in RUNS.values() for r in rs), "report"]
    )


@pytest.mark.slow
def test_seed_repeats_differ_from_their_runs_in_the_two_seed_keys_only(seeded):
    cmp = seeded[0]
    for label in PRECISIONS:
        a, b = flatten(read_config_data(cmp / label)), flatten(read_config_data(cmp / f"{label}-seed1"))
        assert set(a) == set(b)
        differ = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert differ == {"name": (f"rl-tiny-{label}", f"rl-tiny-{label}-seed1"), "train.seed": (0, 1),
                          "sampler.seed": (0, 1)}  # fmt: skip
    row, plain = flatten(read_config_data(cmp / "nvfp4-row")), flatten(read_config_data(cmp / "nvfp4"))
    assert {k for k in row if row[k] != plain[k]} == {"name", "precision.activation_scale"}
    assert (row["precision.recipe"], row["precision.activation_scale"]) == ("nvfp4", "row")
    check_comparable(cmp / "nvfp4-row-seed1", cmp / "fp8", allow=("train.seed", "sampler.seed"))
    with pytest.raises(UserError, match=r"differ in sampler\.seed \(1 vs 0\); "):
        check_comparable(cmp / "nvfp4-row-seed1", cmp / "fp8", allow=("train.seed",))


def seed_value(run_dir, key, at, window):
    """A figure of one run as the seeds section reads it, from metrics.jsonl."""
    values = logged(run_dir, key)
    if not values:
        return None
    last = max(values)
    if at == "last":
        return values[last]
    if at == "change":
        return values[last] - values[0]
    return float(np.mean([values[s] for s in values if s > last - window]))


def test_seed_value_reads_a_change_only_from_an_evaluation_at_step_0(tmp_path):
    rows = [{"step": 2, "eval_accuracy": 0.5}, {"step": 4, "eval_accuracy": 0.75}]
    m = metrics_from_rows(tmp_path, rows, RL_KEYS)
    assert read_seed_value(m, BY_KEY["eval_accuracy_change"], 2) == (None, 4)
    m = metrics_from_rows(tmp_path, [{"step": 0, "eval_accuracy": 0.25}, *rows], RL_KEYS)
    assert read_seed_value(m, BY_KEY["eval_accuracy_change"], 2) == (0.5, 4)
    assert read_seed_value(m, BY_KEY["eval_pass_at_k"], 2) == (None, None)


def test_gaps_beyond_the_seeds_spread_are_stated_with_their_size(tmp_path):
    """fp8: reward 0.1 / 0.2 over the tail (spread 0.1), eval accuracy 0.5 at both seeds (spread 0);
    nvfp4: 0.4 / 0.5 and 0.25; bf16 (one seed): reward 0.15, eval accuracy 0.5."""

    def run(label, reward, acc, precision):
        lines = [step_row(s, reward) for s in range(1, 9)] + [{"step": 8, "eval_accuracy": acc}]
        return write_rl_run(tmp_path / label, lines, precision)

    fp8 = run("fp8", 0.1, 0.5, "fp8")
    runs = {
        "nvfp4": run("nvfp4", 0.4, 0.25, "nvfp4"),
        "bf16": run("bf16", 0.15, 0.5, "bf16"),
        "fp8-seed1": run("fp8-seed1", 0.2, 0.5, "fp8"),
        "nvfp4-seed1": run("nvfp4-seed1", 0.5, 0.25, "nvfp4"),
    }
    c = summarize_rl(runs, fp8)
    assert c.runs["nvfp4-seed1"].against == "fp8-seed1" and c.runs["bf16"].against == "fp8"
    assert c.runs["nvfp4-seed1"].gaps["reward_mean"].value == pytest.approx(0.3)
    nv, bf = c.seeds.precisions["nvfp4"], c.seeds.precisions["bf16"]
    assert (nv.gaps["reward_mean"].gap, nv.gaps["reward_mean"].spread) == (
        pytest.approx(0.3),
        pytest.approx(0.1),
    )
    assert nv.gaps["reward_mean"].within is False and nv.gaps["reward_mean"].times_spread == pytest.approx(
        3.0
    )
    assert nv.verdict == (
        "nvfp4 vs fp8 over 2 seeds: eval accuracy (last evaluation) -0.250 (0.250 vs 0.500), beyond the "
        "seeds' spread 0.000; reward (mean over the last 2 steps) +0.300 (0.450 vs 0.150), beyond the "
        "seeds' spread 0.100 (3.0x)"
    )
    assert bf.runs == ["bf16"] and bf.figures["reward_mean"].spread is None
    assert bf.verdict == (
        "bf16 vs fp8 over 1 and 2 seeds: eval accuracy (last evaluation) +0.000 (0.500 vs 0.500), within the "
        "seeds' spread 0.000; reward (mean over the last 2 steps) +0.000 (0.150 vs 0.150), within the seeds' "
        "spread 0.100"
    )
    assert nv.figures["eval_accuracy_change"].values == (None, None)  # no evaluation at step 0
    data = json.loads((write_report(c, tmp_path / "report") / "report.json").read_text())
    assert data["seeds"]["precisions"]["nvfp4"]["gaps"]["eval_accuracy"] == {
        "gap": -0.25, "spread": 0.0, "within": False, "times_spread": None
    }  # fmt: skip
    md = (tmp_path / "report" / "report.md").read_text()
    row = "| eval accuracy (last evaluation) | nvfp4 | nvfp4, nvfp4-seed1 | 0.250, 0.250 | 0.250 | 0.000 |"
    assert f"{row} -0.250 | 0.000 | beyond |" in md
    assert "| 0.450 | 0.100 | +0.300 | 0.100 | beyond (3.0x) |" in md
    assert "eval accuracy change" not in md and "KL to the start" not in md  # not logged: no rows


def sign3(x):
    """A signed number as the report prints it (one that rounds to 0 is +0.000)."""
    return f"{round(x, 3) + 0.0:+.3f}"


def verdict_part(text, gap, means, spread):
    g = f"{text} {sign3(gap)} ({means[0]:.3f} vs {means[1]:.3f}), "
    if abs(gap) <= spread:
        return g + f"within the seeds' spread {spread:.3f}"
    return g + f"beyond the seeds' spread {spread:.3f}" + (f" ({abs(gap) / spread:.1f}x)" if spread else "")


@pytest.mark.slow
def test_seed_report_is_the_runs_logged_numbers(seeded):
    cmp = seeded[0]
    report = cmp / "report"
    data = json.loads((report / "report.json").read_text())
    assert (report / "seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["plots"]["seeds"] == "seeds.png"
    assert list(data["runs"]) == ["nvfp4", "nvfp4-row", "fp8-seed1", "nvfp4-seed1", "nvfp4-row-seed1"]
    window = data["tail"]["window_steps"]
    assert window == tail_window(5) == 2
    # each run's per-step gaps: to the baseline's run of the same seed
    for label, r in data["runs"].items():
        twin = "fp8-seed1" if label.endswith("-seed1") and label != "fp8-seed1" else "fp8"
        assert r["against"] == twin and r["headline"].startswith(f"{label} vs {twin}:")
        a, b = logged(cmp / label, "reward_mean"), logged(cmp / twin, "reward_mean")
        assert r["gaps"]["reward_mean"]["series"]["diff"] == pytest.approx([a[s] - b[s] for s in sorted(a)])

    seeds = data["seeds"]
    assert (seeds["keys"], seeds["baseline"], seeds["window_steps"]) == (
        ["train.seed", "sampler.seed"],
        "fp8",
        2,
    )
    assert list(seeds["precisions"]) == list(PRECISIONS)
    at = {f["key"]: (f["source"], f["at"]) for f in seeds["figures"]}
    assert at == {
        "eval_accuracy": ("eval_accuracy", "last"),
        "eval_accuracy_change": ("eval_accuracy", "change"),
        "reward_mean": ("reward_mean", "tail"),
        "eval_pass1_sampled": ("eval_pass1_sampled", "last"),
        "eval_pass_at_k": ("eval_pass_at_k", "last"),
        "eval_kl_to_start": ("eval_kl_to_start", "last"),
        "adv_abs_mean": ("adv_abs_mean", "tail"),
        "zero_var_frac": ("zero_var_frac", "tail"),
    }
    expected = {}
    for p, runs in RUNS.items():
        got = seeds["precisions"][p]
        assert got["runs"] == runs
        assert got["k"] == [logged(cmp / r, "eval_k")[5] for r in runs] == [2, 2]
        for key, (source, how) in at.items():
            values = [seed_value(cmp / r, source, how, window) for r in runs]
            assert None not in values, (p, key)  # every run logged every figure
            fig = got["figures"][key]
            assert fig["seeds"] == pytest.approx(values, abs=1e-12)
            assert fig["steps"] == [5, 5]
            assert fig["mean"] == pytest.approx(np.mean(values), abs=1e-12)
            assert fig["spread"] == pytest.approx(max(values) - min(values), abs=1e-12)
            expected[p, key] = (float(np.mean(values)), max(values) - min(values))
    md = (report / "report.md").read_text()
    describe = {f["key"]: f["describe"] for f in seeds["figures"]}
    assert describe["reward_mean"] == "reward (mean over the last 2 steps)"
    assert describe["eval_accuracy"] == "eval accuracy (last evaluation)"
    for p in PRECISIONS[1:]:
        got, parts = seeds["precisions"][p], []
        for key in at:
            (mean, spread), (base_mean, base_spread) = expected[p, key], expected["fp8", key]
            gap, band = mean - base_mean, max(spread, base_spread)
            g = got["gaps"][key]
            assert g["gap"] == pytest.approx(gap, abs=1e-12)
            assert g["spread"] == pytest.approx(band, abs=1e-12)
            assert g["within"] == (abs(gap) <= band)
            assert g["times_spread"] == (pytest.approx(abs(gap) / band) if band else None)
            if key in seeds["verdict_figures"]:
                parts.append(verdict_part(describe[key], gap, (mean, base_mean), band))
        assert seeds["verdict_figures"] == ["eval_accuracy", "reward_mean"]
        assert got["verdict"] == f"{p} vs fp8 over 2 seeds: " + "; ".join(parts)
        assert f"- {got['verdict']}" in md
        reward = got["gaps"]["reward_mean"]
        cell = "within" if reward["within"] else "beyond"
        row = (f"| reward (mean over the last 2 steps) | {p} | {p}, {p}-seed1 | "
               + ", ".join(f"{v:.3f}" for v in got["figures"]["reward_mean"]["seeds"]))  # fmt: skip
        assert row in md and f"| {sign3(reward['gap'])} | {reward['spread']:.3f} | {cell}" in md
    assert data["headline"] == seeds["headline"] == seeds["precisions"]["nvfp4"]["verdict"]
    assert f"**Headline:** {data['headline']}" in md
    kl = seeds["precisions"]["fp8"]["figures"]["eval_kl_to_start"]
    assert (
        "| eval KL to the start (last evaluation) | fp8 | fp8, fp8-seed1 | "
        + ", ".join(f"{v:.2e}" for v in kl["seeds"])
        in md
    )
    assert "| eval pass@k (last evaluation) (k = 2) | nvfp4 |" in md


@pytest.mark.slow
def test_a_bad_with_is_refused_in_one_line_naming_nvfp4_row(seeded, base):  # noqa: F811
    cmp = seeded[0]
    before = {p: p.read_bytes() for p in sorted(cmp.rglob("*")) if p.is_file()}
    for stage in (["--stage", "rollout", "--from", str(base), "--noise"], []):
        code, out, err = cli(["compare-baseline", *stage, "--with", "nvfp4-rows", "--run-dir", str(cmp),
                              *(SEEDS_RL if stage else [])])  # fmt: skip
        assert code == 2 and not out
        assert "--with nvfp4-rows: choose among bf16, fp8-tensorwise, mxfp4, nvfp4-row" in one_line(err)
    assert {p: p.read_bytes() for p in sorted(cmp.rglob("*")) if p.is_file()} == before

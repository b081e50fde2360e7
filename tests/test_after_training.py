"""The commands after training as a new user meets them: each stage says what to run next, every
command without --from takes the newest run of any stage it can use, and generate / eval prompt a
run in the chat template whenever its weights were trained on it."""

import os
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

import inkling_fp4.infer.sampler as sampler_module
from inkling_fp4.data.chat import encode_prompt
from inkling_fp4.data.tokenizer import Tokenizer
from model_helpers import SMALL_RUN
from test_run_dir import cli, one_line, tree_hash

pytestmark = pytest.mark.slow

SFT = ["train.steps=1", "eval.every=0", "data.seq_len=64", "sft.builtin_examples=20", "train.batch_size=2",
       "log.progress=false", "train.checkpoint_every=0"]  # fmt: skip
RL = ["train.steps=1", "rl.prompts_per_step=1", "rl.group_size=2", "train.batch_size=2",
      "train.micro_batch_size=2", "sampler.max_new_tokens=4", "rl.eval_prompts=1", "eval.every=0",
      "log.progress=false", "train.checkpoint_every=0"]  # fmt: skip
QUICK = ["sampler.max_new_tokens=2"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A directory holding runs/pre, runs/sft (from pre) and runs/rl (from sft), each made by its
    command as a user runs it; returns (directory, each stage's stdout, the corpus cache)."""
    work = tmp_path_factory.mktemp("work")
    cache = tmp_path_factory.mktemp("cache")
    logs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        for stage, args in [
            ("pretrain", ["--run-dir", "runs/pre", *SMALL_RUN, f"data.cache_dir={cache}", "train.steps=2",
                          "eval.every=0"]),
            ("sft", ["--from", "runs/pre", "--run-dir", "runs/sft", *SFT]),
            ("rollout", ["--from", "runs/sft", "--run-dir", "runs/rl", *RL]),
        ]:  # fmt: skip
            code, out, err = cli([stage, *args])
            assert code == 0, err
            logs[stage] = out
    return work, logs, cache


def _last_checkpoint_at(run: Path, when: float) -> None:
    for state in (run / "checkpoints").glob("step_*/state.json"):
        os.utime(state, (when, when))


def _next_lines(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("next: "))
    return [line.removeprefix("next:").strip() for line in lines[start:]]


def test_each_stage_ends_with_the_commands_to_run_next_and_they_run(work, monkeypatch):
    root, logs, _ = work
    monkeypatch.chdir(root)
    run_dirs = {"pretrain": "runs/pre", "sft": "runs/sft", "rollout": "runs/rl"}
    expected = {
        "pretrain": ["fp4train sft --from runs/pre",
                     "fp4train generate --from runs/pre --prompt 'def fibonacci(n):'"],
        "sft": ["fp4train rollout --from runs/sft", "fp4train generate --from runs/sft --prompt",
                "fp4train eval --from runs/sft --task arithmetic"],
        "rollout": ["fp4train generate --from runs/rl --prompt",
                    "fp4train eval --from runs/rl --task arithmetic",
                    "fp4train export --from runs/rl --format hf --out exports/rl-hf"],
    }  # fmt: skip
    for stage, out in logs.items():
        assert out.splitlines()[-len(expected[stage]) - 1] == f"run directory: {run_dirs[stage]}"
        got = _next_lines(out)
        assert len(got) == len(expected[stage]), out
        assert all(line.startswith(want) for line, want in zip(got, expected[stage], strict=True)), got
    # the commands are real: each one that reads a run runs as printed (kept short)
    for line in [*_next_lines(logs["pretrain"])[1:], *_next_lines(logs["rollout"])]:
        argv = shlex.split(line)[1:]
        extra = {"generate": QUICK, "eval": ["--problems", "1", *QUICK], "export": []}[argv[0]]
        code, out, err = cli([*argv, *extra])
        assert code == 0, (line, err)
    assert (root / "exports" / "rl-hf" / "config.json").is_file()


def test_a_run_stopped_at_stop_after_is_told_to_resume_first(work, tmp_path, monkeypatch):
    _, _, cache = work
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(["pretrain", "--run-dir", "runs/part", *SMALL_RUN, f"data.cache_dir={cache}",
                          "train.steps=2", "train.stop_after=1", "eval.every=0"])  # fmt: skip
    assert code == 0, err
    first, *rest = _next_lines(out)
    assert first == "fp4train pretrain --resume --run-dir runs/part"
    assert rest[0] == "fp4train sft --from runs/part"
    code, out, err = cli(shlex.split(first)[1:])
    assert code == 0, err
    assert "step 2/2" in out and _next_lines(out)[0] == "fp4train sft --from runs/part"


def test_without_from_every_command_takes_the_newest_run_of_any_stage(work, tmp_path, monkeypatch):
    root, _, _ = work
    for name in ("pre", "sft", "rl"):
        shutil.copytree(root / "runs" / name, tmp_path / "runs" / name)
    now = 1.9e9
    for i, name in enumerate(("pre", "sft", "rl")):  # the rollout run's checkpoint is the newest
        _last_checkpoint_at(tmp_path / "runs" / name, now + i)
    monkeypatch.chdir(tmp_path)
    before = tree_hash(tmp_path / "runs")
    picked = "--from: runs/rl (rollout run, step 1), the run under runs/ whose last checkpoint is the newest"
    for argv in (["generate", "--prompt", "Hi", *QUICK], ["sft", "--print-config", *SFT],
                 ["rollout", "--print-config", *RL], ["info"]):  # fmt: skip
        code, out, err = cli(argv)
        assert code == 0, (argv, err)
        assert out.splitlines()[0 if argv[0] != "info" else -4] == picked, (argv, out)
        if argv[0] in ("sft", "rollout"):
            cfg = yaml.safe_load(out.split("\n", 1)[1])
            assert cfg["init_from"] == "runs/rl/checkpoints/step_1", argv
    assert tree_hash(tmp_path / "runs") == before  # none of them wrote anything
    code, out, err = cli(["eval", "--task", "arithmetic", "--problems", "1", *QUICK])
    assert code == 0, err
    assert out.splitlines()[0] == picked and "appended to runs/rl/metrics.jsonl" in out
    after = tree_hash(tmp_path / "runs")
    assert {k for k in after if after[k] != before.get(k)} == {"rl/metrics.jsonl"}
    code, out, err = cli(["export", "--format", "hf", "--out", str(tmp_path / "hf")])
    assert code == 0, err
    assert out.splitlines()[0] == picked and "export hf: runs/rl/checkpoints/step_1" in out

    # compare-baseline: --stage sft may start from any run; an RL comparison from an sft or pretrain run
    import inkling_fp4.train.compare_baseline as compare

    started = []
    monkeypatch.setattr(compare, "run_compare", lambda cfg, *a, **k: started.append(cfg.init_from))
    code, out, err = cli(["compare-baseline", "--stage", "sft", *SFT])
    assert code == 0, err
    assert out.splitlines()[0] == picked
    code, out, err = cli(["compare-baseline", "--stage", "rollout", *RL])
    assert code == 0, err
    assert out.splitlines()[0] == (
        "--from: runs/sft (sft run, step 1), the sft or pretrain run under runs/ whose last checkpoint is "
        "the newest"
    )
    assert started == ["runs/rl/checkpoints/step_1", "runs/sft/checkpoints/step_1"]


def test_without_any_run_each_command_says_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    commands = (["generate", "--prompt", "Hi"], ["eval", "--task", "arithmetic"], ["sft"], ["rollout"],
                ["export", "--format", "hf", "--out", "hf"],
                ["compare-baseline", "--stage", "sft"])  # fmt: skip
    for argv in commands:
        code, _, err = cli(argv)
        line = one_line(err)
        assert code == 2 and "no run with a checkpoint under runs/" in line, argv
        assert "run `fp4train pretrain` first, or pass --from RUN" in line, argv
        assert list(tmp_path.iterdir()) == [], argv
    code, out, err = cli(["info"])  # info has nothing to describe: the device only
    assert code == 0 and "--from" not in out and list(tmp_path.iterdir()) == []


@pytest.fixture()
def prompts(monkeypatch):
    """The token lists every Sampler.generate call of this test is given."""
    seen = []
    generate = sampler_module.Sampler.generate

    def recording(self, batch, *args, **kwargs):
        seen.extend(list(p) for p in batch)
        return generate(self, batch, *args, **kwargs)

    monkeypatch.setattr(sampler_module.Sampler, "generate", recording)
    return seen


def _templated(run: Path, text: str) -> list[int]:
    return encode_prompt(Tokenizer.from_file(run / "tokenizer.json"), [{"role": "user", "content": text}])


def test_rollout_runs_and_runs_from_sft_get_the_chat_template(work, tmp_path, monkeypatch, prompts):
    root, _, cache = work
    monkeypatch.chdir(root)
    rl = tmp_path / "rl"
    shutil.copytree(root / "runs" / "rl", rl)  # eval appends to the metrics: a copy
    code, out, err = cli(["generate", "--from", str(rl), "--prompt", "Compute 1 + 2.", *QUICK])
    assert code == 0, err
    assert "(rollout)" in out and "prompts in the chat template" in out
    assert prompts == [_templated(rl, "Compute 1 + 2.")]
    prompts.clear()
    code, out, err = cli(["eval", "--from", str(rl), "--task", "arithmetic", "--problems", "1", *QUICK])
    assert code == 0, err
    assert "prompts in the chat template" in out
    roles = Tokenizer.from_file(rl / "tokenizer.json").role_ids
    assert prompts and all(p[1] == roles["user"] and p[-1] == roles["assistant"] for p in prompts)

    # continued pretraining of the sft run: its weights learnt the template, so it keeps it
    more = tmp_path / "more"
    code, _, err = cli(["pretrain", "--from", "runs/sft", "--run-dir", str(more), *SMALL_RUN, "train.steps=1",
                        "eval.every=0", f"data.cache_dir={cache}"])  # fmt: skip
    assert code == 0, err
    assert (more / "chat_template.jinja").is_file()
    prompts.clear()
    code, out, err = cli(["generate", "--from", str(more), "--prompt", "Hi", *QUICK])
    assert code == 0, err
    assert "(pretrain)" in out and "prompts in the chat template" in out
    assert prompts == [_templated(more, "Hi")]
    # a pretrain run started from a chat-trained run before it stored the template: the chain decides
    (more / "chat_template.jinja").unlink()
    prompts.clear()
    code, out, err = cli(["generate", "--from", str(more), "--prompt", "Hi", *QUICK])
    assert code == 0, err
    assert "prompts in the chat template" in out and prompts == [_templated(more, "Hi")]

    # a pretrain run from random weights reads raw text, as it was trained
    prompts.clear()
    code, out, err = cli(["generate", "--from", "runs/pre", "--prompt", "Hi", *QUICK])
    assert code == 0, err
    tok = Tokenizer.from_file(root / "runs" / "pre" / "tokenizer.json")
    assert "prompts as raw text" in out and prompts == [[tok.bos, *tok.encode("Hi")]]

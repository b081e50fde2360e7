"""fp4train generate and eval end to end on a tiny pretrain run, and their refusals of bad input."""

import json
import shutil

import pytest
import yaml

from inkling_fp4.data.chat import encode_prompt
from inkling_fp4.infer.evaluate import pass_rates
from inkling_fp4.infer.from_run import load_run_sampler
from test_run_dir import cli, one_line, pretrained

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A pretrain run of 2 steps (data.seq_len=32: the context generation allows)."""
    return pretrained(tmp_path_factory, 2)


def test_generate_prints_completions_and_writes_jsonl(run, tmp_path):
    out = tmp_path / "out.jsonl"
    code, stdout, err = cli(["generate", "--from", str(run), "--prompt", "The cat", "--prompt", "A", "--out",
                             str(out), "sampler.max_new_tokens=5", "sampler.temperature=0"])  # fmt: skip
    assert code == 0, err
    assert "new tokens/s" in stdout and "[0] The cat" in stdout and "[1] A" in stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["The cat", "A"]
    for r in rows:
        assert 1 <= len(r["tokens"]) == len(r["logprobs"]) <= 5 and r["finish_reason"] in ("eos", "length")
        assert all(lp <= 0 for lp in r["logprobs"])
    # greedy is reproducible, and a prompts file gives the same completions
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The cat\n\nA\n")
    out2 = tmp_path / "out2.jsonl"
    code, _, err = cli(["generate", "--from", str(run), "--prompts", str(prompts), "--out", str(out2),
                        "sampler.max_new_tokens=5", "sampler.temperature=0"])  # fmt: skip
    assert code == 0, err
    assert [json.loads(x)["tokens"] for x in out2.read_text().splitlines()] == [r["tokens"] for r in rows]


def test_one_prompt_is_streamed_as_it_would_be_printed(run, monkeypatch):
    """One prompt without --out streams: the text is written in pieces as it is decoded, and the
    output is line for line that of --no-stream (but for the timing)."""
    import inkling_fp4.infer.generate as gen

    pieces = []

    class Recording(gen.TextStream):
        def __init__(self, tokenizer, stop, write):
            super().__init__(tokenizer, stop, lambda text: (pieces.append(text), write(text)))

    monkeypatch.setattr(gen, "TextStream", Recording)
    args = ["generate", "--from", str(run), "--prompt", "The cat", "sampler.max_new_tokens=6",
            "sampler.temperature=0"]  # fmt: skip
    code, streamed, err = cli(args)
    assert code == 0, err
    code, printed, err = cli([*args, "--no-stream"])
    assert code == 0, err
    assert len(pieces) > 1 and f"  -> {''.join(pieces)}\n" in printed

    def lines(out):
        return [line for line in out.splitlines() if "new tokens/s" not in line]

    assert lines(streamed) == lines(printed)


def test_generate_without_from_takes_the_newest_run(run, tmp_path, monkeypatch):
    shutil.copytree(run, tmp_path / "runs" / "pre")
    monkeypatch.chdir(tmp_path)
    code, stdout, err = cli(["generate", "--prompt", "Hello", "sampler.max_new_tokens=3"])
    assert code == 0, err
    assert "--from: runs/pre (pretrain run, step 2), the run under runs/ whose last checkpoint" in stdout


def test_sft_runs_get_the_chat_template(run, tmp_path):
    sft = tmp_path / "sft"
    shutil.copytree(run, sft)
    cfg = yaml.safe_load((sft / "config.yaml").read_text())
    cfg["stage"] = "sft"
    (sft / "config.yaml").write_text(yaml.safe_dump(cfg))
    rs = load_run_sampler(sft, echo=lambda _: None)
    tok = rs.tokenizer
    assert rs.encode("2 + 2?") == encode_prompt(tok, [{"role": "user", "content": "2 + 2?"}])
    assert rs.sampler.eos_ids == [tok.eos, tok.end] and rs.sampler.context == 32


def test_eval_scores_a_task_and_appends_to_the_metrics(run, tmp_path):
    target = tmp_path / "pre"
    shutil.copytree(run, target)
    args = ["--problems", "3", "--samples", "2", "sampler.max_new_tokens=4", "sampler.max_context=96"]
    code, stdout, err = cli(["eval", "--from", str(target), "--task", "arithmetic", *args])
    assert code == 0, err
    assert "pass@1 greedy" in stdout and "pass@2" in stdout
    row = json.loads((target / "metrics.jsonl").read_text().splitlines()[-1])
    assert (
        row["event"] == "eval" and row["task"] == "arithmetic" and row["problems"] == 3 and row["step"] == 2
    )
    assert 0 <= row["pass@1"] <= 1 and 0 <= row["pass@1_sampled"] <= row["pass@2"] <= 1
    problems = tmp_path / "qa.jsonl"
    problems.write_text(
        json.dumps({"question": "1 + 1?", "answer": 2}) + "\n" + json.dumps({"prompt": "3?", "answer": "3"})
    )
    code, stdout, err = cli(
        ["eval", "--from", str(target), "--task", str(problems), "sampler.max_new_tokens=3"]
    )
    assert code == 0, err
    assert json.loads((target / "metrics.jsonl").read_text().splitlines()[-1])["problems"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "  "], "empty"),
        (["--prompt", "word " * 40], "the model's context is 32"),
        (["sampler.top_p=1.5"], "sampler.top_p must lie in"),
        (["sampler.temperature=-1"], "sampler.temperature must be >= 0"),
        (["model.d_model=8"], "generation takes sampler.* and precision.* overrides"),
        ([], "give --prompt TEXT"),
        (["--stream", "--prompt", "a", "--prompt", "b"], "--stream shows one completion"),
    ],
)
def test_generate_refuses_bad_input_in_one_line(run, args, message):
    argv = ["generate", "--from", str(run), *args]
    if "--prompt" not in args and args:
        argv += ["--prompt", "hi"]
    code, _, err = cli(argv)
    assert code == 2 and message in one_line(err)


def test_from_must_be_a_run(tmp_path):
    code, _, err = cli(["generate", "--from", str(tmp_path), "--prompt", "hi"])
    assert code == 2 and "not a run directory" in one_line(err)
    code, _, err = cli(["eval", "--from", str(tmp_path / "nope"), "--task", "arithmetic"])
    assert code == 2 and "no such directory" in one_line(err)


def test_eval_refuses_bad_input_in_one_line(run, tmp_path):
    code, _, err = cli(["eval", "--from", str(run), "--task", "sudoku"])
    assert code == 2 and "--task sudoku" in one_line(err)
    code, _, err = cli(
        ["eval", "--from", str(run), "--task", "arithmetic", "--samples", "3", "sampler.temperature=0"]
    )
    assert code == 2 and "sampler.temperature > 0" in one_line(err)


def test_pass_rates_count_only_right_answers():
    """Countdown's 0.1 for a well-formed wrong equation is not a pass; pass@K is any right of K."""
    assert pass_rates([[0.1, 0.1], [1.0, 0.0], [0.0, 0.1]]) == (0.5 / 3, 1 / 3)
    assert pass_rates([[1.0], [0.1]]) == (0.5, 0.5)

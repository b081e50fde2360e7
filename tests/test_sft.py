"""fp4train sft end to end on CPU: from a pretrain run, exact resume, refusals, load_run, the live gap
and compare-baseline --stage sft, token accounting."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from inkling_fp4.errors import UserError
from inkling_fp4.interop.load_run import load_run
from inkling_fp4.runs.find import newest_run
from inkling_fp4.train import sft
from inkling_fp4.train.from_run_config import from_run_config
from test_run_dir import cli, one_line, pretrained, tree_hash

pytestmark = pytest.mark.slow

SFT = ["train.log_every=1", "eval.every=5", "eval.batches=2", "data.seq_len=64", "sft.builtin_examples=300",
       "train.warmup_steps=2", "log.progress=false", "train.checkpoint_every=0"]  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A pretrain run of 6 steps (the model every test here fine-tunes)."""
    return pretrained(tmp_path_factory, 6)


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_sft(base, run_dir, *overrides, resume=False):
    cfg = from_run_config(None, [*SFT, *overrides], base, stage="sft", default_recipe=sft.DEFAULT_RECIPE)
    sft.run(cfg, run_dir, resume=resume)
    return rows(run_dir)


def test_sft_learns_from_the_pretrain_checkpoint(base, tmp_path):
    got = train_sft(base, tmp_path / "sft", "train.steps=20")
    steps = [r for r in got if "loss" in r]
    evals = [r for r in got if "val_loss_bf16" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert evals[-1]["val_loss_bf16"] < evals[0]["val_loss_bf16"] - 0.1  # the validation loss falls
    cfg = load_run(tmp_path / "sft")[0]
    assert cfg.stage == "sft" and cfg.init_from.endswith("step_6") and cfg.precision.recipe == "nvfp4"
    assert (tmp_path / "sft" / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    # real tokens (padding excluded) per step, trained tokens (answers) fewer still
    for r in steps:
        assert r["trained_tokens"] < r["tokens"] <= r["step"] * 8 * 64
    assert steps[0]["tokens"] > 0.8 * 8 * 64  # packing fills the rows


def test_first_sft_step_starts_from_the_base_weights(base, tmp_path):
    """The model that takes SFT's first step is the base checkpoint's, bit for bit."""
    from safetensors.torch import load_file

    _, model, _ = load_run(base)
    saved = load_file(base / "checkpoints" / "step_6" / "model.safetensors")
    assert all(torch.equal(t, saved[k]) for k, t in model.state_dict().items() if k in saved)
    # a checkpoint directory loads the same model as its run directory
    _, model2, tok = load_run(base / "checkpoints" / "step_6")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    assert tok.vocab_size == 512


def test_sft_resume_is_bit_exact(base, tmp_path):
    straight = train_sft(base, tmp_path / "a", "train.steps=20")
    train_sft(base, tmp_path / "b", "train.steps=20", "train.stop_after=10")
    parted = train_sft(base, tmp_path / "b", "train.steps=20", resume=True)

    def losses(rs):
        return [(r["step"], r["loss"], r["grad_norm"]) for r in rs if "loss" in r]

    assert losses(straight) == losses(parted)  # floats compared exactly
    assert [r for r in straight if "val_loss" in r] == [r for r in parted if "val_loss" in r]


def test_model_section_or_tokenizer_that_disagrees_is_refused(base, tmp_path):
    with pytest.raises(UserError, match=r"model.d_model=64 disagrees .* \(model.d_model=32\)"):
        from_run_config(None, ["model.d_model=64"], base, stage="sft", default_recipe=sft.DEFAULT_RECIPE)
    from_run_config(
        None, ["model.d_model=32"], base, stage="sft", default_recipe=sft.DEFAULT_RECIPE
    )  # the same value is fine
    from inkling_fp4.data.tokenizer import Tokenizer

    other = Tokenizer.train_bpe([f"w{i} x{i * 7}" for i in range(300)], vocab_size=300, show_progress=False)
    other.save(tmp_path / "other.json")
    with pytest.raises(UserError, match="another tokenizer"):
        from_run_config(
            None,
            [f"data.tokenizer={tmp_path / 'other.json'}"],
            base,
            stage="sft",
            default_recipe=sft.DEFAULT_RECIPE,
        )


def test_cli_without_from_takes_the_newest_pretrain_run(base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(["sft", *SFT])
    assert code == 2 and "fp4train pretrain" in one_line(err) and not (tmp_path / "runs").exists()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "pre").symlink_to(base)
    assert newest_run(tmp_path / "runs", ("pretrain",)) == tmp_path / "runs" / "pre"
    code, out, err = cli(["sft", *SFT, "train.steps=2"])
    assert code == 0, err
    assert "--from: runs/pre (pretrain run, step 6), the run under runs/" in out
    assert "run directory: runs/sft-tiny" in out
    # --resume continues from the run's own checkpoint; --from then is a mistake
    before = tree_hash(tmp_path / "runs" / "sft-tiny")
    code, _, err = cli(["sft", "--resume", "--from", str(base)])
    assert code == 2 and "drop --from" in one_line(err)
    assert tree_hash(tmp_path / "runs" / "sft-tiny") == before
    code, _, err = cli(["sft", "--resume", "train.steps=3"])
    assert code == 0, err


def test_sft_bad_data_is_refused_before_any_write(base, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1", "reply": "2"}) + "\n")
    code, _, err = cli(["sft", "--from", str(base), "--run-dir", str(tmp_path / "r"), *SFT,
                        f"data.source={bad}"])  # fmt: skip
    line = one_line(err)
    assert code == 2 and "question" in line and "messages" in line
    assert not (tmp_path / "r").exists()


def _chat(answer):
    return {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": answer}]}


def _write_bad_source(path):
    """Files whose records are wrong at one place, and the words of the line that names it."""
    if path.name == "mixed.jsonl":  # "0" in record 5 is text; 7 in record 9 is not
        records = [_chat("2")] * 5 + [_chat("0")] + [_chat("2")] * 3 + [_chat(7)]
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return "chat record 9 (from 0) of", "content is int, not text"
    if path.name == "broken.jsonl":
        path.write_text(json.dumps(_chat("2")) + "\n" + '{"messages": [\n')
        return "record 1 (from 0, line 2) is not JSON", "check the files' format"
    if path.name == "ragged.csv":
        path.write_text("prompt,completion\n1+1,2\n2+2,4\n3+3,6,7\n")
        return "record 2 (from 0, line 4) has 3 fields where the header has 2", "quote the fields"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+1", "2+2"], "completion": [2, 4]}), path)  # a typed column
    return "chat record 0 (from 0)", "'completion' is int, not text; store it as a string"


@pytest.mark.parametrize("name", ["mixed.jsonl", "broken.jsonl", "ragged.csv", "typed.parquet"])
def test_sft_data_errors_name_the_record_and_the_fix(base, tmp_path, name):
    source = tmp_path / name
    words = _write_bad_source(source)
    before, data = tree_hash(base), source.read_bytes()
    code, _, err = cli(["sft", "--from", str(base), "--run-dir", str(tmp_path / "r"), *SFT,
                        f"data.source={source}"])  # fmt: skip
    line = one_line(err)
    assert code == 2 and all(w in line for w in words), line
    assert not (tmp_path / "r").exists() and tree_hash(base) == before and source.read_bytes() == data


def test_sft_trains_on_a_csv_of_numeric_completions(base, tmp_path):
    source = tmp_path / "sums.csv"
    source.write_text("prompt,completion\n" + "".join(f"{i}+{i},{2 * i}\n" for i in range(40)))
    before = tree_hash(base)
    code, out, err = cli(["sft", "--from", str(base), "--run-dir", str(tmp_path / "r"), *SFT,
                          f"data.source={source}", "train.steps=2"])  # fmt: skip
    assert code == 0, err
    assert f"csv files '{source}' (1 file, 40 rows): 40 records" in out
    assert [r["step"] for r in rows(tmp_path / "r") if "loss" in r] == [1, 2] and tree_hash(base) == before


def test_datasets_logs_nothing_above_the_one_line_error(base, tmp_path):
    """A parquet file that is not one: datasets logs its failure to stderr before raising, which an
    in-process run cannot see (its handler holds the stderr of the time it was imported)."""
    source = tmp_path / "broken.parquet"
    source.write_bytes(b"PAR1" + b"\0" * 100)
    argv = [sys.executable, "-m", "inkling_fp4", "sft", "--from", str(base), "--run-dir", str(tmp_path / "r"),
            *SFT, f"data.source={source}"]  # fmt: skip
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    line = one_line(proc.stderr)
    assert proc.returncode == 2 and f"could not read '{source}' as parquet" in line
    assert not (tmp_path / "r").exists()


def test_live_gap_and_compare_baseline_stage_sft(base, tmp_path):
    base_rows = train_sft(base, tmp_path / "fp8", "train.steps=6", "precision.recipe=fp8",
                          "precision.switch_to_bf16=never")  # fmt: skip
    assert base_rows
    live = train_sft(base, tmp_path / "nvfp4", "train.steps=6")
    code, _, err = cli(["sft", "--from", str(base), "--run-dir", str(tmp_path / "live"), *SFT,
                        "train.steps=6", "--baseline", str(tmp_path / "fp8")])  # fmt: skip
    assert code == 0, err
    gaps = [r["gap"] for r in rows(tmp_path / "live") if "gap" in r]
    assert gaps and any(g is not None and math.isfinite(g) for g in gaps)
    assert live
    out = tmp_path / "cmp"
    code, text, err = cli(["compare-baseline", "--stage", "sft", "--from", str(base), "--run-dir", str(out),
                           *SFT, "train.steps=6"])  # fmt: skip
    assert code == 0, err
    report = json.loads((out / "report" / "report.json").read_text())
    assert set(report["runs"]) == {"nvfp4"} and (out / "report" / "report.md").is_file()
    assert (out / "fp8" / "config.yaml").is_file() and load_run(out / "fp8")[0].stage == "sft"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sft_cuda_graph_trains_as_eager(base, tmp_path):
    """Packed rows of many examples replay as a CUDA graph (the masked path in both), and the graphed
    run's losses follow the eager run's; the run logs that the graph is on."""
    common = ("train.steps=12", "train.device=cuda", "precision.switch_to_bf16=never")
    eager = [r for r in train_sft(base, tmp_path / "eager", *common) if "loss" in r]
    graphed_rows = train_sft(base, tmp_path / "graphed", *common, "train.cuda_graph=true")
    graphed = [r for r in graphed_rows if "loss" in r]
    assert any(e.get("event") == "cuda_graph" and "on:" in e["message"] for e in graphed_rows)
    for a, b in zip(eager, graphed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3), a["step"]

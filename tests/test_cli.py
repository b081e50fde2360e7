"""The pretrain command's user errors: exit code 2 and one line naming the problem and the fix."""

import subprocess
import sys

import pytest

from inkling_fp4.cli import main


def _cli(args, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fp4train", *args])
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code, out.err.strip()


def _one_line_error(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("error: ")
    return lines[0]


def test_unknown_recipe_key(monkeypatch, capsys, tmp_path):
    code, err = _cli(["pretrain", "--run-dir", str(tmp_path / "r"), "train.stepz=3"], monkeypatch, capsys)
    line = _one_line_error(err)
    assert code == 2
    assert "train.stepz" in line and "steps" in line  # the bad key and the valid ones


def test_unknown_key_in_recipe_file(monkeypatch, capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  learning_rate: 0.1\n")
    code, err = _cli(["pretrain", "--recipe", str(recipe)], monkeypatch, capsys)
    line = _one_line_error(err)
    assert code == 2 and "optim.learning_rate" in line and "lr" in line


def test_wrong_type(monkeypatch, capsys, tmp_path):
    code, err = _cli(["pretrain", "--run-dir", str(tmp_path / "r"), "train.steps=many"], monkeypatch, capsys)
    line = _one_line_error(err)
    assert code == 2 and "train.steps" in line and "integer" in line


def test_missing_recipe_file(monkeypatch, capsys, tmp_path):
    code, err = _cli(["pretrain", "--recipe", str(tmp_path / "nope.yaml")], monkeypatch, capsys)
    line = _one_line_error(err)
    assert code == 2 and "nope.yaml" in line and "tiny" in line  # what is missing, what exists


def test_run_dir_with_a_checkpoint_needs_resume(monkeypatch, capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "checkpoints" / "step_5").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_5" / "state.json").write_text("{}")
    code, err = _cli(["pretrain", "--run-dir", str(tmp_path)], monkeypatch, capsys)
    line = _one_line_error(err)
    assert code == 2 and "--resume" in line and "--run-dir" in line


def test_real_process_exit_code_and_no_traceback(tmp_path):
    """The installed entry point as a user runs it (``python -m inkling_fp4``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "inkling_fp4", "pretrain", "--run-dir", str(tmp_path / "r"), "log.wandb=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    line = _one_line_error(proc.stderr.strip())
    assert "log.wandb" in line and "true or false" in line


def test_tokenizer_command_trains_and_saves(monkeypatch, capsys, tmp_path):
    """`fp4train tokenizer` trains a BPE on local files; the saved file loads with that vocabulary."""
    from inkling_fp4.data.tokenizer import Tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(300)))
    monkeypatch.setattr(sys, "argv", ["fp4train", "tokenizer", str(tmp_path / "tok"), "--source",
                                      str(corpus), "--vocab-size", "600"])  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code in (0, None)
    tok = Tokenizer.load(str(tmp_path / "tok" / "tokenizer.json"))
    assert 256 < tok.vocab_size <= 600
    assert tok.decode(tok.encode("def f7(x):")) == "def f7(x):"


def test_tokenizer_command_missing_source(monkeypatch, capsys, tmp_path):
    code, err = _cli(["tokenizer", str(tmp_path / "t"), "--source", str(tmp_path / "nope.jsonl")],
                     monkeypatch, capsys)  # fmt: skip
    line = _one_line_error(err)
    assert code == 2 and "nope.jsonl" in line


def test_info_lists_every_recipe_with_its_backend(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fp4train", "info"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert "device: CPU only" in out or "device: NVIDIA" in out
    for recipe in ("bf16", "fp8", "fp8-tensorwise", "nvfp4", "mxfp4"):
        assert f"  {recipe}: " in out
    if not __import__("torch").cuda.is_available():
        assert "  nvfp4: emulated" in out  # no FP4 or FP8 hardware: exact emulation

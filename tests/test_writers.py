"""Writers never replace what they did not write: export, tokenizer, generate --out, compare-baseline
--out and a stage's --run-dir refuse, in one line and before any work, a run directory, an input,
the current directory or a file they did not write; --force replaces only their own earlier output.
A full disk while writing a tokenizer or the run lock is one line and exit 1."""

import errno
import json
import os
import stat

import pytest

from model_helpers import SMALL_RUN
from test_run_dir import cli, copy_run, one_line, pretrained, tree_hash

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A pretrain run of 2 steps; tests copy it before anything could touch it."""
    return pretrained(tmp_path_factory, 2)


def refused(argv, *untouched, code=2):
    """Run ``fp4train argv``; assert the exit code, one line without a traceback, and every path in
    ``untouched`` (file or directory) byte for byte as it was. Returns the line."""
    before = [_snapshot(p) for p in untouched]
    got, out, err = cli(argv)
    assert got == code, (out, err)
    line = one_line(err)
    assert [_snapshot(p) for p in untouched] == before
    return line


def _snapshot(path):
    return tree_hash(path) if path.is_dir() else path.read_bytes()


# ----------------------------------------------------------------------------------------------
# export


@pytest.mark.parametrize(
    "target, named",
    [
        ("other", "is a run directory"),
        ("source", "is --from"),
        ("checkpoints", "part of the run directory"),
        ("parent", "holds --from"),
    ],
)
def test_export_force_never_replaces_a_run_or_its_source(run, tmp_path, target, named):
    source = copy_run(run, tmp_path / "runs")
    other = copy_run(run, tmp_path / "elsewhere")
    out = {"other": other, "source": source, "checkpoints": source / "checkpoints", "parent": source.parent}
    line = refused(["export", "--from", str(source), "--format", "hf", "--out", str(out[target]), "--force"],
                   source, other)  # fmt: skip
    assert named in line and str(out[target]) in line


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_export_to_the_current_directory_is_refused(run, tmp_path, monkeypatch, force):
    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text("mine\n")
    monkeypatch.chdir(here)
    line = refused(["export", "--from", str(run), "--format", "hf", "--out", ".", *force], here)
    assert "--out . is the current directory" in line


def test_export_force_replaces_only_an_earlier_export_and_files_follow_the_umask(run, tmp_path):
    out = tmp_path / "hf"
    old = os.umask(0o022)
    try:
        code, stdout, err = cli(["export", "--from", str(run), "--format", "hf", "--out", str(out)])
    finally:
        os.umask(old)
    assert code == 0, err
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}
    assert json.loads((out / "fp4train_export.json").read_text())["format"] == "hf"
    line = refused(["export", "--from", str(run), "--format", "hf", "--out", str(out)], out)
    assert "exists" in line and "--force" in line
    code, stdout, err = cli(["export", "--from", str(run), "--format", "hf", "--out", str(out), "--force"])
    assert code == 0, err
    assert f"replacing {out}, an earlier fp4train export output" in stdout
    (out / "notes.txt").write_text("my notes\n")  # no longer only the export: --force leaves it
    line = refused(["export", "--from", str(run), "--format", "hf", "--out", str(out), "--force"], out)
    assert "notes.txt" in line
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.bin").write_bytes(b"\x00\x01")
    line = refused(["export", "--from", str(run), "--format", "hf", "--out", str(mine), "--force"], mine)
    assert "fp4train_export.json" in line
    line = refused(["export", "--from", str(run), "--format", "hf", "--out", str(mine / "data.bin"),
                    "--force"], mine)  # fmt: skip
    assert "is a file" in line


# ----------------------------------------------------------------------------------------------
# tokenizer


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A small text source; the tokenizer cache (~/.cache/fp4train) under tmp_path."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(200)))
    return path


def tokenizer_cli(out, corpus, *extra):
    return ["tokenizer", str(out), "--source", str(corpus), "--vocab-size", "512", *extra]


@pytest.mark.parametrize("where", ["dir", "file"])
def test_tokenizer_never_writes_into_a_run(run, tmp_path, corpus, where):
    target = copy_run(run, tmp_path)
    out = target if where == "dir" else target / "tokenizer.json"
    line = refused(tokenizer_cli(out, corpus, "--force"), target)
    assert "part of the run directory" in line and "tokenizer.json" in line


def test_tokenizer_replaces_an_existing_file_only_with_force_and_only_its_own(tmp_path, corpus):
    mine = tmp_path / "notes.txt"
    mine.write_text("not a tokenizer\n")
    line = refused(tokenizer_cli(mine, corpus), mine)
    assert "notes.txt is a file" in line
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}\n')
    line = refused(tokenizer_cli(other, corpus, "--force"), other)
    assert "not an earlier fp4train tokenizer output" in line
    out = tmp_path / "tok.json"
    code, stdout, err = cli(tokenizer_cli(out, corpus))
    assert code == 0, err
    line = refused(tokenizer_cli(out, corpus), out)
    assert "exists" in line and "--force" in line
    code, stdout, err = cli(tokenizer_cli(out, corpus, "--force"))
    assert code == 0 and f"replacing {out}" in stdout, err


def test_a_full_disk_while_saving_a_tokenizer_is_exit_1_and_leaves_nothing(tmp_path, corpus, monkeypatch):
    from inkling_fp4.data import tokenizer as module

    real_open = open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f) if "w" in mode else f

    code, _, err = cli(tokenizer_cli(tmp_path / "first", corpus))  # trained and cached: only OUT is left
    assert code == 0, err
    monkeypatch.setattr(module, "open", full_open, raising=False)
    out = tmp_path / "out"
    out.mkdir()
    line = refused(tokenizer_cli(out, corpus), out, code=1)
    assert f"no room on the disk for {out / 'tokenizer.json'}" in line
    assert not list(out.iterdir())  # neither the file nor its temporary


def test_a_full_disk_at_the_run_lock_is_exit_1(run, tmp_path, monkeypatch):
    target = copy_run(run, tmp_path)

    def no_room(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "link", no_room)
    line = refused(["pretrain", "--run-dir", str(target), "--resume"], target, code=1)
    assert "no room on the disk for the lock file" in line


# ----------------------------------------------------------------------------------------------
# generate --out


GEN = ["sampler.max_new_tokens=3", "sampler.temperature=0"]


def test_generate_out_refuses_what_it_did_not_write_before_generating(run, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The cat\nA\n")
    mine = tmp_path / "notes.jsonl"
    mine.write_text('{"note": "mine"}\n')
    argv = ["generate", "--from", str(run), "--prompts", str(prompts), *GEN]
    line = refused([*argv, "--out", str(prompts), "--force"], prompts)
    assert "is --prompts" in line
    for force in ([], ["--force"]):
        line = refused([*argv, "--out", str(mine), *force], mine)
        assert "notes.jsonl" in line
    folder = tmp_path / "folder"
    folder.mkdir()
    code, stdout, err = cli([*argv, "--out", str(folder)])
    assert code == 2 and "is a directory" in one_line(err) and "new tokens/s" not in stdout
    target = copy_run(run, tmp_path / "copy")
    line = refused([*argv, "--out", str(target / "metrics.jsonl"), "--force"], target)
    assert "part of the run directory" in line


def test_generate_out_force_replaces_an_earlier_output(run, tmp_path):
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--from", str(run), "--prompt", "The cat", *GEN, "--out", str(out)]
    code, _, err = cli(argv)
    assert code == 0, err
    assert "exists" in refused(argv, out)
    code, stdout, err = cli([*argv, "--force"])
    assert code == 0 and f"replacing {out}, an earlier fp4train generate output" in stdout, err
    assert [json.loads(x)["prompt"] for x in out.read_text().splitlines()] == ["The cat"]


def test_generate_prompts_of_a_binary_file_is_one_line(run, tmp_path):
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"hello\n\xff\xfe\x00binary\n")
    line = refused(["generate", "--from", str(run), "--prompts", str(binary), *GEN], binary)
    assert "not UTF-8" in line and "offset 6" in line


# ----------------------------------------------------------------------------------------------
# compare-baseline --out


def test_compare_out_replaces_only_an_earlier_report(run, tmp_path):
    a, b = copy_run(run, tmp_path / "a"), copy_run(run, tmp_path / "b")
    argv = ["compare-baseline", "--run", str(a), "--baseline", str(b)]
    line = refused([*argv, "--out", str(b)], a, b)
    assert "is --baseline" in line
    other = copy_run(run, tmp_path / "c")
    assert "is a run directory" in refused([*argv, "--out", str(other)], a, b, other)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "paper.md").write_text("draft\n")
    assert "report.json" in refused([*argv, "--out", str(mine), "--force"], a, b, mine)
    out = tmp_path / "report"
    code, _, err = cli([*argv, "--out", str(out)])
    assert code == 0, err
    assert "exists" in refused([*argv, "--out", str(out)], a, b, out)
    code, stdout, err = cli([*argv, "--out", str(out), "--force"])
    assert code == 0 and f"replacing {out}" in stdout, err


# ----------------------------------------------------------------------------------------------
# run directories


def test_run_dir_is_never_the_current_directory_a_source_or_inside_a_run(run, tmp_path, monkeypatch):
    source = copy_run(run, tmp_path / "runs")
    line = refused(["sft", "--from", str(source), "--run-dir", str(source.parent), "train.steps=1"], source)
    assert "holds --from" in line
    line = refused(["pretrain", "--run-dir", str(source / "checkpoints"), *SMALL_RUN], source)
    assert "part of the run directory" in line
    here = tmp_path / "empty"
    here.mkdir()
    monkeypatch.chdir(here)
    argv = ["pretrain", "--run-dir", ".", *SMALL_RUN, "train.steps=1", f"data.cache_dir={tmp_path}"]
    line = refused(argv, here)
    assert "is the current directory" in line

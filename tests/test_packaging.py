"""fp4train as a package: --version, recipes, --print-config (which writes nothing), and a
non-editable install (and its wheel) that carries the built-in recipes, so `fp4train pretrain
--print-config` works from an empty directory of a fresh virtual environment."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import yaml

from inkling_fp4 import __version__
from inkling_fp4.config import RECIPES_DIR
from test_run_dir import cli

REPO = Path(__file__).resolve().parents[1]


def test_version_and_recipes():
    code, out, _ = cli(["--version"])
    assert code == 0 and out.strip() == f"fp4train {__version__}"
    code, out, _ = cli(["recipes"])
    names = [line.split()[0] for line in out.splitlines()]
    assert code == 0 and names == sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) and "tiny" in names
    assert all(len(line.split()) > 1 for line in out.splitlines())  # a summary on every line


def test_print_config_prints_the_resolved_config_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(["pretrain", "--print-config", "model.d_model=48", "train.steps=7"])
    assert code == 0, err
    data = yaml.safe_load(out)
    assert data["model"]["d_model"] == 48 and data["train"]["steps"] == 7 and data["stage"] == "pretrain"
    assert list(tmp_path.iterdir()) == []


def test_sft_print_config_names_its_base(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(["sft", "--print-config"])  # no pretrain run under runs/: refused, nothing written
    assert code == 2 and "fp4train pretrain" in err and list(tmp_path.iterdir()) == []


def _setuptools_major() -> int:
    """The installed setuptools' major version (0 when there is none): pyproject.toml needs 77."""
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


def _fresh_venv(root: Path) -> Path:
    """A virtual environment that sees this interpreter's installed packages (torch, ...) through a
    .pth line, but not the editable fp4train (whose .pth is not processed from there)."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "parent-site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.slow
def test_non_editable_install_and_wheel_carry_the_recipes(tmp_path):
    src = tmp_path / "src-copy"  # the build writes build/ and egg-info: not into the repository
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    skip = shutil.ignore_patterns("*.egg-info", "__pycache__")
    shutil.copytree(REPO / "src", src / "src", symlinks=True, ignore=skip)  # recipes: a link, as in git
    shutil.copytree(REPO / "recipes", src / "recipes")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # offline when a new enough setuptools is here; else pip fetches one into a build environment
    isolation = ["--no-build-isolation"] if _setuptools_major() >= 77 else []
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", *isolation, "-w", wheels, src], capture_output=True, text=True
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("fp4train-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"inkling_fp4/recipes/{p.name}" for p in RECIPES_DIR.glob("*.yaml")} <= set(names)

    python = _fresh_venv(tmp_path / "venv")
    install = subprocess.run(
        [*pip, "--python", python, "install", "--no-deps", *isolation, src], capture_output=True, text=True
    )
    assert install.returncode == 0, install.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    fp4train = tmp_path / "venv" / "bin" / "fp4train"
    run = subprocess.run(
        [fp4train, "pretrain", "--print-config"], cwd=empty, capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr
    assert yaml.safe_load(run.stdout)["name"] == "tiny" and list(empty.iterdir()) == []
    where = subprocess.run(
        [python, "-c", "import inkling_fp4.config as c; print(c.RECIPES_DIR)"],
        cwd=empty,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.strip()
    assert where.startswith(str(tmp_path / "venv")) and not Path(where).is_symlink()

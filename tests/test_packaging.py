"""fp4train as a package: --version, recipes, --print-config (which writes nothing), and a
non-editable install (and its wheel) that carries the built-in recipes, so `fp4train pretrain
--print-config` works from an empty directory of a fresh virtual environment."""

import importlib.metadata
import os
import re
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


def docker_ignored(path: str, patterns: list[str]) -> bool:
    """Whether ``docker build`` leaves ``path`` (relative to the context) out under these .dockerignore
    patterns: the last pattern that matches the path or a folder above it decides; ``!`` keeps."""
    parts = path.split("/")
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        glob = pattern.removeprefix("!").strip("/")
        regex = "".join(
            {"**": ".*", "*": "[^/]*", "?": "[^/]"}.get(tok, re.escape(tok))
            for tok in re.findall(r"\*\*|\*|\?|[^*?]+", glob)
        ).replace(".*/", "(.*/)?")
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            ignored = not keep
    return ignored


def dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [x.strip() for x in lines if x.strip() and not x.startswith("#")]


def git_ignored(paths: list[str]) -> set[str]:
    """Which of ``paths`` (relative to the repository) its .gitignore files leave out."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    check = ["git", "check-ignore", "--no-index", *paths]
    got = subprocess.run(check, cwd=REPO, capture_output=True, text=True)
    return set(got.stdout.split())


def test_the_docker_context_is_what_the_dockerfile_copies():
    copied = [
        word
        for line in (REPO / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
        for word in line.split()[1:-1]
    ]
    assert copied == ["pyproject.toml", "README.md", "src", "recipes"]
    patterns = dockerignore()
    tracked = [str(p.relative_to(REPO)) for name in copied for p in [REPO / name, *(REPO / name).rglob("*")]]
    kept = [p for p in tracked if "__pycache__" not in p and ".egg-info" not in p]
    assert not [p for p in kept if docker_ignored(p, patterns)]
    local = [".venv/bin/python", "venv/lib/site.py", "runs/tiny/config.yaml", "build/lib/inkling_fp4/cli.py",
             "dist/fp4train-0.1.0.whl", "exports/tiny-hf/model.safetensors", ".git/HEAD", "wandb/run/x",
             ".pytest_cache/v", "src/inkling_fp4/__pycache__/cli.cpython-311.pyc",
             "src/fp4train.egg-info/PKG-INFO", "tests/test_cli.py"]  # fmt: skip
    assert [p for p in local if not docker_ignored(p, patterns)] == []
    outputs = ["build/lib/inkling_fp4/cli.py", "dist/fp4train-0.1.0.whl", "exports/tiny-hf/config.json",
               "runs/tiny/config.yaml"]  # fmt: skip
    assert git_ignored(outputs) == set(outputs)


@pytest.mark.slow
def test_non_editable_install_and_wheel_carry_the_recipes(tmp_path):
    src = tmp_path / "src-copy"  # the build writes build/ and egg-info: not into the repository
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    skip = shutil.ignore_patterns("*.egg-info", "__pycache__")
    shutil.copytree(REPO / "src", src / "src", symlinks=True, ignore=skip)  # recipes: a link, as in git
    shutil.copytree(REPO / "recipes", src / "recipes")
    sources = {p for p in src.rglob("*")}
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
    # what the build leaves beside the sources is left out of git and of the docker context
    left = sorted(str(p.relative_to(src)) for p in set(src.rglob("*")) - sources if p.is_file())
    assert any(p.startswith("build/") for p in left), left
    assert git_ignored(left) == set(left)
    assert [p for p in left if not docker_ignored(p, dockerignore())] == []
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

"""What a new user reads first: `fp4train --help`, each command's --help and `fp4train recipes`, at 80
columns, whole: no truncated summaries, no words broken at a hyphen, no type labels for flags."""

import inspect

import typer

import inkling_fp4.config as config
from inkling_fp4.cli import app
from test_run_dir import cli

WIDTH = 80


def _words(text: str) -> str:
    return " ".join(text.split())


def _render(argv: list[str], monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    code, out, err = cli(argv)
    assert code == 0, err
    assert all(len(line) <= WIDTH for line in out.splitlines()), out
    return out


def test_every_help_reads_whole_at_80_columns(monkeypatch):
    group = typer.main.get_command(app)
    top = _render(["--help"], monkeypatch)
    listed = top.split("Commands:")[1].strip().splitlines()
    rows = {line.split()[0]: line.split(None, 1)[1] for line in listed}
    assert set(rows) == set(group.commands)
    for name, command in group.commands.items():
        summary = _words(inspect.cleandoc(command.help).split("\n\n")[0])
        assert rows[name] == summary, name  # the first paragraph, not cut
        out = _render([name, "--help"], monkeypatch)
        assert "<bool>" not in out and "[default: no-" not in out, out
        assert _words(inspect.cleandoc(command.help)) in _words(out), name
        for param in command.params:
            if getattr(param, "help", None):
                assert _words(param.help) in _words(out), (name, param.name)  # never broken at a hyphen
            if getattr(param, "is_bool_flag", False) and param.secondary_opts:
                assert f"{param.opts[0]} / {param.secondary_opts[0]}" in out, (name, param.name)


def test_recipes_prints_each_recipes_first_sentence_whole(monkeypatch, tmp_path):
    out = _render(["recipes"], monkeypatch)
    paths = sorted(config.RECIPES_DIR.glob("*.yaml"))
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == [p.stem for p in paths]  # one line each at 80 columns
    for line in lines:
        text = line.split(None, 1)[1]
        assert text[0].isupper() and text.endswith("."), line
    # a description whose first sentence runs over two comment lines is printed whole, and only it
    (tmp_path / "mine.yaml").write_text(
        "# mine: a recipe whose first sentence goes on\n# past its line (v1.5 of it). More after it.\n"
        "name: mine\n"
    )
    monkeypatch.setattr(config, "RECIPES_DIR", tmp_path)
    out = _render(["recipes"], monkeypatch)
    assert _words(out) == "mine A recipe whose first sentence goes on past its line (v1.5 of it)."

"""The ``fp4train`` command line: one thin function per command, wiring only.

Each command loads its config and calls an importable ``run(cfg)``. A :class:`UserError` anywhere
below prints one line and exits with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

import typer

from inkling_fp4.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Train hybrid Mamba-Transformer language models with NVFP4 4-bit forward passes.",
)


@app.callback()
def _root() -> None:
    """Train hybrid Mamba-Transformer language models with NVFP4 4-bit forward passes."""


@app.command()
def info() -> None:
    """Show the devices, precision backends and kernels available here."""
    import torch

    typer.echo(f"torch {torch.__version__}")
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        typer.echo(f"cuda: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
    else:
        typer.echo("cuda: not available (CPU only; NVFP4 and FP8 are emulated)")


def main() -> None:
    try:
        app()
    except UserError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()

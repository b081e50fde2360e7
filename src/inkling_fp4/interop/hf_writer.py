"""The ``hf`` export: a directory that transformers loads as ``NemotronHForCausalLM``.

    config.json              model_type nemotron_h, plus ``quantization_config`` for NVFP4 exports
    model.safetensors        transformers' names; FP32 master weights, or the NVFP4 writers' tensors
    generation_config.json   bos / eos (``<|end|>`` and ``<|endoftext|>``) / pad ids
    tokenizer.json           the run's tokenizer, and tokenizer_config.json for ``AutoTokenizer``
    fp4train_export.json     the format and the files written: how ``--force`` recognises an
                             earlier export, the only thing it replaces

Every file is a function of the model and the tokenizer only (sorted JSON keys, no timestamps), so
exporting an imported export gives the same bytes. The directory is written next to ``out`` and
renamed into place: a failed export leaves nothing that looks complete. Files follow the umask.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from inkling_fp4.data.chat import CHAT_TEMPLATE_JINJA
from inkling_fp4.data.tokenizer import END, PAD, Tokenizer
from inkling_fp4.interop.nemotron_h import hf_config, to_hf_tensors
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.output_guard import check_output
from inkling_fp4.runs.checkpoint import model_tensors

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
EXPORT_MARKER = "fp4train_export.json"


def hf_tensors(model: HybridLM) -> dict[str, torch.Tensor]:
    """The model's FP32 tensors under transformers' names, on the CPU."""
    own = {k: t.detach().float().cpu() for k, t in model_tensors(model)}
    return to_hf_tensors(model.cfg, own)


def _json(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def model_config_json(cfg: ModelConfig, tokenizer: Tokenizer, max_len: int) -> dict:
    return hf_config(cfg, bos=tokenizer.bos, eos=tokenizer.end, pad=tokenizer.pad, max_len=max_len)


def tokenizer_files(tokenizer: Tokenizer, max_len: int) -> dict[str, str]:
    bos = tokenizer.token(tokenizer.bos)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE_JINJA,
    }
    return {"tokenizer.json": tokenizer.hf.to_str(pretty=True), "tokenizer_config.json": _json(config)}


def not_an_export(path: Path) -> str | None:
    """Why the directory ``path`` is not an earlier export (None: it is one, and holds nothing else)."""
    try:
        written = set(json.loads((path / EXPORT_MARKER).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"it has no readable {EXPORT_MARKER}"
    other = sorted(p.name for p in path.iterdir() if p.name not in written | {EXPORT_MARKER})
    if other:
        more = f" and {len(other) - 1} more" if len(other) > 1 else ""
        return f"it also holds {other[0]}{more}, which the export did not write"
    return None


def check_export_target(out: str | Path, force: bool, source: str | Path | None = None) -> str | None:
    """Refuse ``--out`` unless it is new or empty, or an earlier export and ``force``; returns the line
    saying what is replaced."""
    return check_output(out, "--out", "export", kind="directory", force=force, not_own=not_an_export,
                        inputs=[("--from", source)])  # fmt: skip


def _umask() -> int:
    mask = os.umask(0o022)  # NOTE: the only way to read it is to set it; restored at once
    os.umask(mask)
    return mask


def write_hf(
    out: str | Path,
    cfg: ModelConfig,
    tokenizer: Tokenizer,
    tensors: dict[str, torch.Tensor],
    *,
    max_len: int,
    quantization_config: dict | None = None,
    extra_files: dict[str, str] | None = None,
    force: bool = False,
    fmt: str = "hf",
) -> list[Path]:
    """Write an ``hf`` export of ``tensors`` (transformers' names) into ``out``; returns the files.

    ``quantization_config`` goes into config.json and ``extra_files`` (name -> text) beside it, for
    the NVFP4 formats; ``fmt`` names the format in the marker."""
    out = Path(out)
    check_export_target(out, force)
    config = model_config_json(cfg, tokenizer, max_len)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    generation = {
        "bos_token_id": tokenizer.bos,
        "eos_token_id": [tokenizer.end, tokenizer.eos],
        "pad_token_id": tokenizer.pad,
    }
    texts = {CONFIG_FILE: _json(config), "generation_config.json": _json(generation)}
    texts.update(tokenizer_files(tokenizer, max_len))
    texts.update(extra_files or {})
    texts[EXPORT_MARKER] = _json({"format": fmt, "files": sorted([*texts, WEIGHTS_FILE])})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(tmp / WEIGHTS_FILE),
            metadata={"format": "pt"},
        )
        os.chmod(tmp / WEIGHTS_FILE, 0o666 & ~_umask())  # safetensors writes it 0600
        for name, text in texts.items():
            (tmp / name).write_text(text)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(out.iterdir())

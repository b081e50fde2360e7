"""A Nemotron-H directory in transformers' layout as fp4train's (RunConfig, model, tokenizer).

``config.json`` becomes the model section (:func:`~.nemotron_h.model_config` refuses what fp4train's
model cannot express), the weights are every ``*.safetensors`` file cast to FP32 master weights, and
the tokenizer is its ``tokenizer.json`` (fp4train's special tokens appended when it lacks them). The
config and the weights' headers are checked first (:mod:`~.nemotron_h_check`), so a bad directory
fails with one line before anything is written. A hub id (``org/name``) is fetched into the local
hub cache first. Quantized checkpoints are refused: import the BF16/FP32 one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from inkling_fp4.config import RunConfig
from inkling_fp4.data.config import DataConfig
from inkling_fp4.data.hub import require_hub
from inkling_fp4.data.tokenizer import Tokenizer, check_vocab
from inkling_fp4.errors import UserError
from inkling_fp4.interop.nemotron_h import MODEL_TYPE, from_hf_tensors, model_config
from inkling_fp4.interop.nemotron_h_check import check_config, check_finite, check_weights
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.runs.checkpoint import build_model

CONFIG_FILE = "config.json"


def read_hf_config(path: str | Path) -> dict | None:
    """The directory's config.json as a dict, or None when there is none or it is not JSON."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_nemotron_h_dir(path: str | Path) -> bool:
    data = read_hf_config(path)
    return data is not None and data.get("model_type") == MODEL_TYPE


def looks_like_hub_id(spec: str | Path) -> bool:
    """``org/name`` where neither the path nor its first part exists here (``runs/x`` stays a path)."""
    text = str(spec)
    if text.count("/") != 1 or text.startswith((".", "/", "~")) or Path(text).exists():
        return False
    return not Path(text.split("/")[0]).exists()


def resolve(spec: str | Path) -> Path:
    """A local Nemotron-H directory for ``spec``: the path itself, or a hub id's cached snapshot."""
    if not looks_like_hub_id(spec):
        return Path(spec)
    require_hub(f"--from {spec}", "pass a local Nemotron-H directory")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja"]
    try:
        return Path(snapshot_download(str(spec), allow_patterns=patterns))
    except Exception as e:  # the hub client raises many types; one line says which
        raise UserError(
            f"--from {spec}: could not fetch it from the hub ({str(e).splitlines()[0]})"
        ) from None


def _weights(path: Path, cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's checked files, each file's values checked as it is read."""
    tensors: dict[str, torch.Tensor] = {}
    for f in check_weights(path, cfg.model):
        try:
            loaded = load_file(str(f))
        except (SafetensorError, OSError) as e:  # the header checked out: the data is unreadable
            raise UserError(
                f"{f.name}: unreadable ({str(e).splitlines()[0]}); copy or export it again"
            ) from None
        check_finite(f, loaded)
        tensors.update(loaded)
    return tensors


def imported_config(path: str | Path) -> tuple[RunConfig, Tokenizer]:
    """(RunConfig around the directory's model, its tokenizer): config.json and the weights' headers
    checked, the weights' values not read yet."""
    path = Path(path)
    hf = read_hf_config(path)
    if hf is None or hf.get("model_type") != MODEL_TYPE:
        raise UserError(f"--from {path}: no config.json of model_type {MODEL_TYPE}")
    if hf.get("quantization_config") is not None:
        quant = hf["quantization_config"]
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise UserError(
            f"--from {path}: a quantized checkpoint (quantization_config, {method}); import the "
            "unquantized one (fp4train export --format hf)"
        )
    try:
        check_config(hf)
        mcfg = model_config(hf)
        check_weights(path, mcfg)
    except UserError as e:
        raise UserError(f"--from {path}: {e}") from None
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise UserError(f"--from {path}: no tokenizer.json; fp4train needs the checkpoint's tokenizer")
    tokenizer = Tokenizer.from_file(tokenizer_file)
    check_vocab(tokenizer, mcfg.vocab_size)
    seq_len = max(2, int(hf.get("max_position_embeddings") or DataConfig().seq_len))
    data = DataConfig(
        tokenizer=str(tokenizer_file), vocab_size=max(512, tokenizer.vocab_size), seq_len=seq_len
    )
    return RunConfig(name=path.name, model=mcfg, data=data), tokenizer


def imported_tensors(path: str | Path, cfg: RunConfig) -> dict[str, torch.Tensor]:
    """The directory's weights under fp4train's names, FP32 (checked against ``cfg``, finite)."""
    path = Path(path)
    try:
        hf_tensors = _weights(path, cfg)
    except UserError as e:
        raise UserError(f"--from {path}: {e}") from None
    return {k: v.float() for k, v in from_hf_tensors(cfg.model, hf_tensors).items()}


def load_nemotron_h(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[RunConfig, HybridLM, Tokenizer]:
    """(config, model with the directory's weights on ``device``, tokenizer) of a Nemotron-H directory."""
    path = resolve(path)
    cfg, tokenizer = imported_config(path)
    return cfg, build_model(cfg.model, device, imported_tensors(path, cfg), source=path), tokenizer

"""``fp4train export``: a run's weights as a directory other tools load.

    hf                        transformers' NemotronHForCausalLM, FP32 (:mod:`~.hf_writer`)
    nvfp4-modelopt            the hf directory with ModelOpt's NVFP4 weights (:mod:`~.modelopt_writer`)
    nvfp4-compressed-tensors  the hf directory with compressed-tensors' NVFP4 weights
                              (:mod:`~.compressed_tensors_writer`)

The NVFP4 formats quantize the layers the run's recipe quantizes (:mod:`~.nvfp4_weights`) and
calibrate their input scales (:mod:`~.calibration`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from inkling_fp4 import __version__
from inkling_fp4.errors import UserError
from inkling_fp4.interop import compressed_tensors_writer, modelopt_writer
from inkling_fp4.interop.calibration import ExportConfig, calibration_batches, input_amaxes
from inkling_fp4.interop.hf_writer import check_export_target, hf_tensors, write_hf
from inkling_fp4.interop.load_run import load_run_checkpoint
from inkling_fp4.interop.nvfp4_weights import nvfp4_recipe, quantized_modules

NVFP4_LAYOUTS = {
    "nvfp4-modelopt": modelopt_writer.LAYOUT,
    "nvfp4-compressed-tensors": compressed_tensors_writer.LAYOUT,
}
FORMATS = ("hf", *NVFP4_LAYOUTS)
ALWAYS_EXCLUDED = ["backbone.embeddings", "lm_head"]
"""Kept in high precision by every recipe (paper: embeddings and the LM head are never quantized)."""


def source_path(source: Path, step: int | None) -> Path:
    if step is None:
        return source
    ckpt = Path(source) / "checkpoints" / f"step_{step}"
    if not ckpt.is_dir():
        raise UserError(f"--step {step}: {source} has no checkpoints/step_{step}; drop --step for the newest")
    return ckpt


def run_export(
    source: Path,
    fmt: str,
    out: Path,
    *,
    step: int | None = None,
    options: ExportConfig | None = None,
    force: bool = False,
    echo: Callable[[str], None] = print,
) -> list[Path]:
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    options = options or ExportConfig()
    replacing = check_export_target(out, force, source)
    cfg, model, tokenizer, ckpt = load_run_checkpoint(source_path(source, step))
    echo(f"export {fmt}: {ckpt.path} (step {ckpt.step}), pattern {cfg.model.pattern}, -> {out}")
    if replacing:
        echo(replacing)
    base = hf_tensors(model)
    max_len = cfg.data.seq_len
    if fmt == "hf":
        files = write_hf(out, model.cfg, tokenizer, base, max_len=max_len, force=force, fmt=fmt)
        _summary(echo, out, files, f"{len(base)} FP32 tensors")
        return files
    policy, _ = nvfp4_recipe(cfg)
    quantized, kept = quantized_modules(model, cfg)
    excluded = kept + ALWAYS_EXCLUDED
    run_dir = ckpt.path.parent.parent if ckpt.path.parent.name == "checkpoints" else None
    echo(
        f"calibrating input scales: {options.calibration_batches} batches of {options.calibration_batch_size}"
    )
    batches = calibration_batches(cfg, tokenizer, options, run_dir)
    by_layer = input_amaxes(model, policy, batches)
    input_amax = {module: by_layer[layer] for module, (_, layer) in quantized.items()}
    weights = {module: w for module, (w, _) in quantized.items()}
    layout = NVFP4_LAYOUTS[fmt]
    tensors = layout.tensors(base, weights, input_amax)
    quant_config, extra = layout.metadata(excluded, __version__)
    files = write_hf(
        out,
        model.cfg,
        tokenizer,
        tensors,
        max_len=max_len,
        quantization_config=quant_config,
        extra_files=extra,
        force=force,
        fmt=fmt,
    )
    _summary(echo, out, files, f"{len(weights)} linear modules NVFP4, {len(excluded)} excluded (BF16)")
    return files


def _summary(echo, out: Path, files: list[Path], what: str) -> None:
    size = sum(f.stat().st_size for f in files)
    echo(f"wrote {out}: {len(files)} files, {size / 1e6:.1f} MB; {what}")

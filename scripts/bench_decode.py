"""Benchmark generation's decode step on CUDA: new tokens/s and ms per step against the memory floor.

Why: RL rollouts are generation, and a decode step of a small model reads its weights and its
recurrent state once and does little else, so its floor is bytes over bandwidth. This times the
step and sets it beside that floor and beside Hugging Face transformers' NemotronH ``generate()`` on
the same configuration, in one run on one GPU.

Per preset, batch and prompt length (random weights, random prompts of that length, greedy):
  - prefill once, then ``--new-tokens`` decode steps, fed back by argmax on the device;
  - eager: ``HybridLM.decode_step`` (the fused Mamba-2 kernel and the GQA decode kernel, one launch
    per op otherwise), timed over ``--eager-steps`` steps; at batch 64 also with the torch twins
    (``reference_glue``: every fused kernel replaced by its eager reference);
  - graphed: the step as one CUDA graph (``model/graphed_decoder.py``), timed over every new token;
    new tokens/s = batch / ms per step (the prefill excluded, as in the issue's numbers);
  - floor: bytes read or written per step (the GEMM weights in BF16, the FP32 SSM state read and
    written, the conv window read and written, the KV cache read at the mean length plus the new
    entries written) over the device-to-device copy bandwidth measured in the same run;
  - transformers (when it imports): ``NemotronHForCausalLM`` built from the same ModelConfig, BF16,
    ``generate()`` greedy with exactly the new tokens; ms per step from two runs (1 and N new
    tokens), so its prefill is not counted either.

Checks first (exit 1 on a mismatch): one decode step with the fused kernels against the torch twins
on the preset itself, and the graphed step against the eager one (same greedy tokens).

Weights: the GEMM weights (every QuantLinear and the LM head) are held as their BF16 values, which
is exactly what the BF16 fprop multiplies (it rounds the FP32 master to BF16 every call); under a
quantized recipe they stay FP32 and are quantized at every step, or, with ``--hold-weights``, the
policy holds each layer's quantized fprop weight, made once (``PrecisionPolicy.freeze_weights``, as
the sampler does); with held NVFP4 weights each linear layer's decode GEMM is one fused kernel
(``precision/decode_fprop.py``). ``--activation-scale row`` gives x one NVFP4 scale per row.

Usage:
    python scripts/bench_decode.py                                  # everything (several minutes)
    python scripts/bench_decode.py --presets peer158m --batches 64 --prompts 128
    python scripts/bench_decode.py --recipe nvfp4 --batches 64 --no-hf
    python scripts/bench_decode.py --markdown BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import time

import torch

from inkling_fp4.model.compiled import reference_glue
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.fused_nvfp4_decode import fuse_nvfp4_decode
from inkling_fp4.model.graphed_decoder import GraphedDecoder
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.precision.quant_linear import QuantLinear


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def copy_bandwidth(device) -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (median of 20)."""
    src = torch.randn(1 << 28, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def events_ms(fn, n: int) -> float:
    """Mean ms of n calls of fn, timed with CUDA events around all of them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def floor_bytes(model: HybridLM, batch: int, prompt: int, new: int) -> dict[str, float]:
    """Bytes a decode step must read or write, by kind (BF16 weights, states, KV at the mean length)."""
    cfg = model.cfg
    weights = 2 * model.matmul_params()  # every QuantLinear and the LM head, as BF16
    ssm = conv = kv = 0
    mean_len = prompt + new / 2
    for kind in cfg.pattern:
        if kind == "M":
            ssm += 2 * batch * cfg.mamba_heads * cfg.mamba_head_dim * cfg.d_state * 4
            conv += 2 * batch * (cfg.d_inner + 2 * cfg.n_groups * cfg.d_state) * (cfg.conv_kernel - 1) * 2
        elif kind == "*":
            kv += 2 * batch * (mean_len + 1) * cfg.n_kv_heads * cfg.attn_head_dim * 2
    return dict(weights=weights, ssm=ssm, conv=conv, kv=kv)


def inference_weights(model: HybridLM) -> None:
    """Hold the BF16-fprop GEMM weights as BF16 (the values that fprop multiplies, cast once)."""
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.recipe is None:
            m.weight.data = m.weight.data.to(torch.bfloat16)
    model.lm_head.weight.data = model.lm_head.weight.data.to(torch.bfloat16)


def build_model(
    preset: str, recipe: str, device, hold_weights: bool = False, activation_scale: str = "tensor",
    fused_rows: bool = True,
) -> HybridLM:  # fmt: skip
    cfg = ModelConfig(preset=preset)
    model = HybridLM(cfg).to(device).eval()
    if recipe != "bf16":
        from inkling_fp4.precision.config import PrecisionConfig
        from inkling_fp4.precision.policy import PrecisionPolicy

        pcfg = PrecisionConfig(
            recipe=recipe, bf16_first_layers=0, bf16_last_layers=0, activation_scale=activation_scale
        )
        policy = PrecisionPolicy(pcfg, cfg.n_layers)
        policy.apply(model)
        if hold_weights:
            if fused_rows:  # as the sampler: the producers write the next linear's NVFP4 rows (row scales)
                fuse_nvfp4_decode(model)
            policy.freeze_weights(model)
    inference_weights(model)
    return model


def check(model: HybridLM, device) -> list[str]:
    """Kernels against twins for one step on this preset; graphed against eager greedy tokens."""
    failures = []
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (8, 33), device=device)
    lengths = torch.randint(1, 33, (8,), device=device)
    outs = []
    for ref in (False, True):
        cache = model.allocate_cache(8, 48)
        with (
            torch.autocast("cuda", dtype=torch.bfloat16),
            reference_glue() if ref else contextlib.nullcontext(),
        ):
            model.prefill(ids[:, :32], lengths, cache)
            outs.append(model.decode_step(ids[:, 32], cache).float())
    err = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    print(f"  fused decode kernels vs torch twins, one step, logits rel. err {err:.2e}")
    # NOTE only BF16 has a bound here: the kernels and their twins differ by BF16 rounding (~1e-2 of
    # random-weight logits), which under a 4-bit recipe moves activations across rounding boundaries
    # in every layer (measured 0.24-0.29 with NVFP4); the GEMMs have their own tests
    quantized = any(isinstance(m, QuantLinear) and m.recipe is not None for m in model.modules())
    if not quantized and not err < 2e-2:
        failures.append(f"fused decode step vs twins: rel. err {err:.2e}")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cache = model.allocate_cache(8, 48)
        first = model.prefill(ids[:, :32], lengths, cache)
        graphed = GraphedDecoder(model, cache)
        toks = []
        for step in (lambda t: model.decode_step(t, cache), graphed):
            model.prefill(ids[:, :32], lengths, cache)
            logits, seq = first, []
            for _ in range(12):
                seq.append(logits.argmax(-1))
                logits = step(seq[-1])
            toks.append(torch.stack(seq, 1))
    same = torch.equal(toks[0], toks[1])
    print(f"  graphed vs eager greedy tokens (12 steps, batch 8): {'equal' if same else 'DIFFERENT'}")
    if not same:
        failures.append("graphed decode tokens differ from eager")
    return failures


def bench_ours(model, batch, prompt, new, eager_steps, twins, device, profile: int = 0) -> dict:
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=device)
    lengths = torch.full((batch,), prompt, device=device)
    row = {}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cache = model.allocate_cache(batch, prompt + new)
        first = model.prefill(ids, lengths, cache)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = model.prefill(ids, lengths, cache)
        torch.cuda.synchronize()
        row["prefill_ms"] = 1e3 * (time.perf_counter() - t0)
        state = {"tok": first.argmax(-1)}

        def eager():
            state["tok"] = model.decode_step(state["tok"], cache).argmax(-1)

        eager()
        eager()
        row["eager_ms"] = events_ms(eager, eager_steps)
        if twins:
            model.prefill(ids, lengths, cache)
            with reference_glue():
                eager()
                row["twins_ms"] = events_ms(eager, max(4, eager_steps // 4))
        try:
            decoder = GraphedDecoder(model, cache)
        except Exception as e:  # noqa: BLE001 (reported in the table: the eager step still counts)
            print(f"  no graph: {type(e).__name__}: {e}")
            decoder = None
        if decoder is not None:
            model.prefill(ids, lengths, cache)
            state["tok"] = first.argmax(-1)

            def graphed():
                state["tok"] = decoder(state["tok"]).argmax(-1)

            row["graphed_ms"] = events_ms(graphed, new - 1)  # the first new token came from the prefill
            if profile:
                model.prefill(ids, lengths, cache)
                state["tok"] = first.argmax(-1)
                print_kernels(graphed, profile, f"graphed step, batch {batch}, prompt {prompt}")
    return row


def print_kernels(step, steps: int, label: str) -> None:
    """The CUDA kernels of ``steps`` calls of ``step``: device time per group (step_profile.py's
    groups) and the top kernels. Why: a step's time against bf16 says how far NVFP4 is from its
    target, the kernels say which of its launches (quantizers, GEMMs, glue) to fuse."""
    from torch.profiler import ProfilerActivity, profile

    from step_profile import breakdown, format_top, top_kernels

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    groups = breakdown(events, steps)
    print(f"  kernels of the {label} ({steps} steps profiled):")
    for name, (ms, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"    {ms:8.3f} ms {n:5d}  {name}")
    print(format_top(top_kernels(events, steps, 25), width=110))


def hf_config(cfg: ModelConfig, max_len: int):
    """transformers' NemotronHConfig with our ModelConfig's sizes (field names vary by version)."""
    from transformers import NemotronHConfig

    base = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.attn_head_dim,
        intermediate_size=cfg.ffn_dim,
        mamba_num_heads=cfg.mamba_heads,
        mamba_head_dim=cfg.mamba_head_dim,
        n_groups=cfg.n_groups,
        ssm_state_size=cfg.d_state,
        conv_kernel=cfg.conv_kernel,
        expand=cfg.d_inner // cfg.d_model,
        chunk_size=cfg.chunk_size,
        layer_norm_epsilon=cfg.norm_eps,
        mlp_hidden_act="relu2",
        use_bias=False,
        mlp_bias=False,
        attention_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=max(4096, max_len),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    attempts = [
        dict(hybrid_override_pattern=cfg.pattern, num_hidden_layers=cfg.n_layers),
        dict(hybrid_override_pattern=cfg.pattern),
        dict(layers_block_type=[{"M": "mamba", "*": "attention", "-": "mlp"}[c] for c in cfg.pattern]),
    ]
    error = None
    for extra in attempts:
        try:
            hf = NemotronHConfig(**base, **extra)
        except Exception as e:  # noqa: BLE001 (the next spelling of the fields is tried)
            error = e
            continue
        if getattr(hf, "hybrid_override_pattern", cfg.pattern) == cfg.pattern:
            return hf
    raise RuntimeError(f"could not build a NemotronHConfig for pattern {cfg.pattern}: {error}")


def bench_hf(hf_model, cfg, batch, prompt, new, device) -> dict:
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt), device=device)
    mask = torch.ones_like(ids)

    def gen(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf_model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        torch.cuda.synchronize()
        assert out.shape[1] == prompt + n, out.shape
        return time.perf_counter() - t0

    with torch.no_grad():
        gen(4)
        one, full = gen(1), gen(new)
    return dict(hf_ms=1e3 * (full - one) / (new - 1), hf_total_s=full)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="peer158m,hybrid-350m")
    parser.add_argument("--batches", type=ints, default=[1, 16, 64, 256])
    parser.add_argument("--prompts", type=ints, default=[128, 512])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--recipe", default="bf16", help="precision recipe of the GEMMs (bf16, nvfp4, ...)")
    parser.add_argument(
        "--hold-weights", action="store_true", help="hold the quantized weights, made once (as the sampler)"
    )
    parser.add_argument("--activation-scale", default="tensor", choices=["tensor", "row"])
    parser.add_argument(
        "--unfused-rows",
        action="store_true",
        help="every linear quantizes its own input (the step before the fusion)",
    )
    parser.add_argument("--decode-gemm", default=None, choices=["auto", "triton", "cublas"])
    parser.add_argument("--eager-steps", type=int, default=32, help="eager decode steps timed per cell")
    parser.add_argument("--hf-batches", type=ints, default=[1, 16, 64, 256], help="cells with transformers")
    parser.add_argument("--hf-prompts", type=ints, default=[128])
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' generate()")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="print the kernels of N graphed steps per cell"
    )
    parser.add_argument("--markdown", default=None, help="append the table as Markdown to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    if args.decode_gemm:
        from inkling_fp4.precision import decode_fprop

        decode_fprop.GEMM = args.decode_gemm
    bw = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device)
    hf_version = None
    if not args.no_hf:
        try:
            import transformers

            hf_version = transformers.__version__
        except ImportError:
            pass
    print(
        f"{name}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s, transformers {hf_version}"
    )
    failures, rows = [], []
    for preset in args.presets.split(","):
        model = build_model(
            preset,
            args.recipe,
            device,
            hold_weights=args.hold_weights,
            activation_scale=args.activation_scale,
            fused_rows=not args.unfused_rows,
        )
        if not args.no_check:
            print(f"checks, {preset} ({args.recipe}):")
            failures += check(model, device)
        hf_model = None
        if hf_version is not None:
            from transformers import NemotronHForCausalLM

            max_len = max(args.prompts) + args.new_tokens
            try:
                hf_model = (
                    NemotronHForCausalLM(hf_config(model.cfg, max_len)).to(device, torch.bfloat16).eval()
                )
            except Exception as e:  # noqa: BLE001
                print(f"  no transformers model: {type(e).__name__}: {e}")
        for prompt in args.prompts:
            for batch in args.batches:
                row = dict(preset=preset, batch=batch, prompt=prompt)
                ours = bench_ours(
                    model, batch, prompt, args.new_tokens, args.eager_steps, batch == 64, device, args.profile
                )
                row.update(ours)
                torch.cuda.empty_cache()
                parts = floor_bytes(model, batch, prompt, args.new_tokens)
                row["floor_gb"] = sum(parts.values()) / 1e9
                row["floor_ms"] = 1e3 * sum(parts.values()) / bw
                if hf_model is not None and batch in args.hf_batches and prompt in args.hf_prompts:
                    try:
                        row.update(bench_hf(hf_model, model.cfg, batch, prompt, args.new_tokens, device))
                    except Exception as e:  # noqa: BLE001 (the peer's failure is reported, ours still counts)
                        print(f"  transformers generate() failed: {type(e).__name__}: {e}")
                    torch.cuda.empty_cache()
                rows.append(row)
                print(
                    "  "
                    + ", ".join(
                        f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                    )
                )
        del model, hf_model
        torch.cuda.empty_cache()

    lines = [
        f"### bench_decode.py: recipe {args.recipe} ({args.activation_scale} activation scales"
        f"{', held weights' if args.hold_weights else ''}), {args.new_tokens} new tokens, greedy, "
        "random weights",
        "",
        f"{name}, torch {torch.__version__}, transformers {hf_version}, {datetime.date.today()}; "
        f"copy bandwidth {bw / 1e12:.2f} TB/s (1 GiB device-to-device, read + write)",
        "",
        "| preset | batch | prompt | eager ms/step | twins ms/step | graphed ms/step | new tokens/s | "
        "floor GB | floor ms | x floor | HF ms/step | HF tokens/s | x HF |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        step_ms = r.get("graphed_ms", r["eager_ms"])
        tps = r["batch"] * 1e3 / step_ms
        hf = r.get("hf_ms")
        twins = f"{r['twins_ms']:.2f}" if "twins_ms" in r else ""
        hf_cols = f"{hf:.2f} | {r['batch'] * 1e3 / hf:,.0f} | {hf / step_ms:.1f}" if hf else " | | "
        lines.append(
            f"| {r['preset']} | {r['batch']} | {r['prompt']} | {r['eager_ms']:.3f} | {twins} | "
            f"{r.get('graphed_ms', float('nan')):.3f} | {tps:,.0f} | {r['floor_gb']:.2f} | "
            f"{r['floor_ms']:.3f} | "
            f"{step_ms / r['floor_ms']:.2f} | {hf_cols} |"
        )
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")
    if failures:
        print("MISMATCH: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

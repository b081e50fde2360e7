"""Pretraining throughput on one GPU (or several under torchrun): bf16 vs fp8 (native) vs nvfp4 (emulated).

Trains a preset (default hybrid-350m at sequence 2048) for a few steps per precision recipe with the
training loop's own pieces (HybridLM, PrecisionPolicy, AdamW with FP32 master weights, BF16 autocast,
FP32 masked cross-entropy, gradient clipping) and reports, per recipe:

    tokens/s      global tokens per second over the timed steps (after --warmup untimed steps)
    step ms       wall time per optimizer step
    host ms       CPU time to issue one step (Python, autograd, launches) before waiting for its
                  loss; well below "step ms": the GPU is the limit; close to it: the host is, or the
                  launch queue filled up (``--cprofile`` tells which: time in launches vs Python)
    MFU           model.flops_per_token(seq) * tokens/s / (989e12 * GPUs). The FLOPs are the model's
                  training FLOPs: 6 per GEMM weight per token (every QuantLinear and the LM head),
                  causal attention QK^T and AV, and the SSD scan, forward + backward
                  (inkling_fp4/model/flops.py); the peak is the H100/H200 dense BF16 datasheet rate
                  for every recipe, so FP8/NVFP4 runs are on the same scale as BF16.
    peak GiB      torch.cuda.max_memory_allocated over the run of that recipe
    vs bf16       step time / the bf16 step time (targets: nvfp4 <= 1.3, fp8 <= 0.85)

``--config peer158m`` runs the 158M configuration that Hugging Face transformers' NemotronH was
measured at on this H200 (126K tokens/s, 28 GiB with mamba-ssm's Triton scan, batch 8 x 2048).

Exit status is non-zero when a loss is not finite, when a recipe's first loss is more than 2% away
from bf16's (the same init and batch: the formats may move it, not by that much), or when the loss
did not go down over the run (a broken backward trains nothing).

Examples:
    python scripts/bench_pretrain.py --out bench_1gpu.json
    python scripts/bench_pretrain.py --config peer158m --out bench_peer.json
    python scripts/bench_pretrain.py --recipes bf16,nvfp4 --profile 3      # + GPU time by kernel group
    python scripts/bench_pretrain.py --config peer158m --cuda-graph        # steps as CUDA graphs
    python scripts/bench_pretrain.py --recipes fp8 --profile 2 --sources   # + which line launched what
    python scripts/bench_pretrain.py --recipes fp8-delayed --without mlp  # one fused FP8 path off
    python scripts/bench_pretrain.py --recipes nvfp4 --unfused-epilogue    # NVFP4 GEMM epilogue in a pass
    python scripts/bench_pretrain.py --recipes nvfp4 --nvfp4-pair off      # x's, dy's operands in two passes
    python scripts/bench_pretrain.py --recipes nvfp4 --tiles rht=128,2,2   # the quantizers under other tiles
    python scripts/bench_pretrain.py --recipes nvfp4 --producer-amaxes on  # the producers give the amaxes
    python scripts/bench_pretrain.py --recipes nvfp4 --tma-gemm on --fused-max-k 8192  # TMA-fed GEMMs
    python scripts/bench_pretrain.py --recipes nvfp4 --rht-loads wide     # RHT kernel: one tile a group
    python scripts/bench_pretrain.py --recipes nvfp4 --saved-x values     # wgrad's x kept as BF16 values
    torchrun --nproc_per_node 2 scripts/bench_pretrain.py --recipes bf16 --steps 100 \
        --out bench_2gpu.json --compare-to bench_1gpu.json      # scaling and loss curve vs 1 GPU
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import json
import math
import pstats
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import step_profile
from inkling_fp4 import distributed as D
from inkling_fp4.config import RunConfig, from_dict, to_dict
from inkling_fp4.config.trainer import OptimConfig
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.fused_fp8.layers import fuse_fp8
from inkling_fp4.model.fused_nvfp4_train import fuse_nvfp4_train
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.numerics.kernels import nvfp4_quantize, nvfp4_rht
from inkling_fp4.precision import gemm
from inkling_fp4.precision.config import PrecisionConfig
from inkling_fp4.precision.graph_capture import graph_blocker
from inkling_fp4.precision.policy import PrecisionPolicy
from inkling_fp4.trainer.flops import mfu, peak_flops
from inkling_fp4.trainer.graphed_step import GraphedMicroStep
from inkling_fp4.trainer.optimizer import build_optimizer, set_lr

CONFIGS = {"hybrid-350m": (dict(preset="hybrid-350m"), 16), "peer158m": (dict(preset="peer158m"), 8)}
"""name -> (ModelConfig fields, default global batch)"""
BACKENDS = {"bf16": "auto", "fp8": "native-fp8", "fp8-tensorwise": "native-fp8"}
BACKENDS |= {"nvfp4": "emulated", "mxfp4": "emulated", "fp8-delayed": "native-fp8"}
DELAYED = "fp8-delayed"
"""A name of this script's: fp8-tensorwise with ``precision.fp8_scaling=delayed``."""
PEER_TOKENS_PER_S = 126_000
FUSIONS = ("norm", "in_proj", "out_proj", "mlp", "residual")
"""The fused FP8 paths of ``inkling_fp4.model.fused_fp8`` (delayed FP8 scaling on the GPU), by module."""


def disable_fusions(names: str) -> list[str]:
    """Turn the named fused FP8 paths off in this process: each module's ``applies`` then answers
    False, so the model runs its plain path there (the math is the same; the step measures what
    the fusion saved). Returns the names turned off."""
    chosen = list(FUSIONS) if names.strip() == "all" else [n.strip() for n in names.split(",") if n.strip()]
    for name in chosen:
        if name not in FUSIONS:
            raise SystemExit(f"--without {name}: not one of {', '.join(FUSIONS)} (or all)")
        importlib.import_module(f"inkling_fp4.model.fused_fp8.{name}").applies = lambda *args, **kwargs: False
    return chosen


TILES = {"rows": (nvfp4_quantize, "ROW_TILE"), "rht": (nvfp4_rht, "QUANTIZE_TILE"),
         "rht_amax": (nvfp4_rht, "AMAX_TILE")}  # fmt: skip
"""--tiles names -> the kernel module attribute each sets."""


def set_tiles(spec: str) -> list[str]:
    """Set the NVFP4 quantizers' tiles in this process (``name=a,b,c`` items); returns what was set."""
    done = []
    for item in spec.split():
        name, _, numbers = item.partition("=")
        if name not in TILES:
            raise SystemExit(f"--tiles {item}: not one of {', '.join(TILES)}")
        try:
            tile = tuple(int(v) for v in numbers.split(","))
        except ValueError:
            tile = ()
        if len(tile) != 3:
            raise SystemExit(f"--tiles {item}: give three integers, e.g. {name}=64,2,2")
        module, attr = TILES[name]
        setattr(module, attr, tile)
        done.append(f"{name}={numbers}")
    return done


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="hybrid-350m")
    p.add_argument(
        "--recipes",
        default="bf16,fp8,fp8-tensorwise,nvfp4",
        help=f"comma list of recipes ({DELAYED}: fp8-tensorwise with delayed scaling)",
    )
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument(
        "--without",
        default="",
        help=f"comma list of fused FP8 paths to turn off ({', '.join(FUSIONS)}; 'all'): what each one pays",
    )
    p.add_argument(
        "--unfused-epilogue",
        action="store_true",
        help="NVFP4 GEMMs write their FP32 product and scale it in a second pass (what the fusion saves)",
    )
    p.add_argument(
        "--tiles",
        default="",
        help="NVFP4 quantizer tiles to time the step under, e.g. 'rows=8,512,2 rht=128,2,2 rht_amax=512,8,4' "
        "(rows: block_m,block_n,warps; rht, rht_amax: block_n,groups,warps; bench_quant.py --sweep)",
    )
    p.add_argument(
        "--nvfp4-pair",
        choices=("on", "off"),
        help="a tensor's two NVFP4 operands (rows, RHT) from one pass over it (on) or two (off); "
        "default: the trainer's (gemm.FUSED_NVFP4_PAIR)",
    )
    p.add_argument(
        "--producer-amaxes",
        choices=("on", "off"),
        help="x's two NVFP4 tensor amaxes reduced by its producer (the pre-norm, the squared ReLU) as it "
        "writes x (on), or by the linear's own pass over x (off); default: gemm.PRODUCER_NVFP4_AMAXES",
    )
    p.add_argument(
        "--tma-gemm",
        choices=("on", "off"),
        help="the fused NVFP4 GEMM fed by TMA, persistent (on), or by pointers (off); "
        "default: scaled_gemm.TMA_FED",
    )
    p.add_argument(
        "--fused-max-k",
        type=int,
        help="the longest contraction an NVFP4 GEMM fuses its epilogue at; default: gemm.FUSED_MAX_K",
    )
    p.add_argument(
        "--rht-loads",
        choices=("wide", "rows"),
        help="the RHT kernel loads a 16-token group as one tile (wide) or as 16 row loads (rows); "
        "default: nvfp4_rht.WIDE_LOADS",
    )
    p.add_argument(
        "--saved-x",
        choices=("values", "codes"),
        help="x's wgrad operand kept for the backward as BF16 values or as codes; "
        "default: gemm.SAVED_WGRAD_VALUES",
    )
    p.add_argument("--batch", type=int, default=None, help="global batch (default 16; peer158m 8)")
    p.add_argument("--micro-batch", type=int, default=None, help="per-GPU micro batch (default: all of it)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", choices=["builtin", "random"], default="builtin")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay each micro-batch's forward + backward as a CUDA graph (one GPU; every recipe: "
        "stochastic rounding replays the eager seeds)",
    )
    p.add_argument("--ssd-impl", default="auto", choices=["auto", "triton", "reference"])
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--compare-to", type=Path, default=None, help="a JSON of this script: scaling and losses")
    p.add_argument(
        "--profile", type=int, default=0, help="then profile this many steps: GPU time by kernel group"
    )
    p.add_argument("--top", type=int, default=20, help="with --profile: list this many kernels")
    p.add_argument(
        "--sources", action="store_true", help="with --profile: GPU time by the package line that launched it"
    )
    p.add_argument(
        "--cprofile",
        type=int,
        default=0,
        help="then run this many steps under cProfile: host time by function",
    )
    return p.parse_args()


def batches(args, dist, cfg: RunConfig, micro: int, accum: int, n_steps: int):
    """n_steps lists of ``accum`` micro batches, the same global batches for any number of GPUs."""
    if args.data == "random":
        g = torch.Generator().manual_seed(1234)
        for _ in range(n_steps):
            step = []
            for _ in range(accum):
                full = torch.randint(
                    0, cfg.model.vocab_size, (micro * dist.world_size, args.seq + 1), generator=g
                )
                mine = full[dist.rank :: dist.world_size]
                ids, tgt = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
                step.append((ids, tgt, None, torch.ones_like(ids, dtype=torch.bool)))
            yield step
        return
    from inkling_fp4.data.pipeline import build_pretrain_data

    run_dir = Path(tempfile.mkdtemp(prefix="bench_pretrain_"))
    for building in (True, False):  # rank 0 first: it trains the tokenizer and writes the shards
        if dist.is_main == building:
            data = build_pretrain_data(cfg.data, run_dir, 0, rank=dist.rank, world_size=dist.world_size)
        D.barrier(dist)
    for _ in range(n_steps):
        step = []
        for _ in range(accum):
            b = data.train.next_batch(micro)
            step.append((b.input_ids, b.targets, b.doc_ids, b.loss_mask))
        yield step


def build_model(recipe: str, cfg: RunConfig, device) -> HybridLM:
    """The model as the trainer builds it for ``recipe``: seed 0, with its fused training paths (the FP8
    ones under delayed scaling, each off under --without; the producers' NVFP4 amaxes under nvfp4)."""
    torch.manual_seed(0)
    model = HybridLM(cfg.model).to(device)
    if recipe == DELAYED:
        fuse_fp8(model)
    elif recipe == "nvfp4":
        fuse_nvfp4_train(model)
    return model


def bench_recipe(recipe: str, args, dist, cfg: RunConfig, micro: int, accum: int) -> dict:
    device = dist.device
    model = build_model(recipe, cfg, device)
    scaling = {"recipe": recipe}
    if recipe == DELAYED:
        scaling = {"recipe": "fp8-tensorwise", "fp8_scaling": "delayed"}
    policy = PrecisionPolicy(PrecisionConfig(backend=BACKENDS[recipe], **scaling), cfg.model.n_layers)
    policy.set_generator_seed(dist.rank)
    policy.apply(model)
    described = policy.describe(model)
    opt = build_optimizer(model, OptimConfig(lr=args.lr))
    fwd = torch.compile(model) if args.compile else model
    train_model = D.wrap_model(fwd, dist)
    graphed, graph_note = None, None
    if args.cuda_graph:
        graph_note = graph_blocker(model, dist.world_size, device)
        if graph_note is None:

            def loss_fn(ids, docs, tgt, mask, net=train_model):
                with torch.autocast("cuda", dtype=torch.bfloat16):  # inside: only this is captured
                    return net(ids, doc_ids=docs, targets=tgt, loss_mask=mask)

            graphed = GraphedMicroStep(model, loss_fn, accumulate=accum > 1)
            graph_note = "forward + backward replayed as a CUDA graph"
        described += f"; {graph_note}"
    n_steps = args.warmup + args.steps + args.profile + args.cprofile
    tokens_per_step = cfg.train.batch_size * args.seq
    torch.cuda.reset_peak_memory_stats(device)
    losses, t0, elapsed, profiler, host_s, cprof, host_top = [], None, None, None, [], None, None
    profiling = contextlib.ExitStack()  # holds the torch profiler while it records
    for i, step_batches in enumerate(batches(args, dist, cfg, micro, accum, n_steps)):
        if i == args.warmup + args.steps + args.profile and args.cprofile:
            profiling.close()  # the torch profile is over (if any): its overhead stays out of cProfile's
            cprof = cProfile.Profile()
            cprof.enable()
        if i == args.warmup:
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        if i == args.warmup + args.steps:  # the timed steps are over: profile the rest
            torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t0
            if args.profile:
                activities = [torch.profiler.ProfilerActivity.CUDA]
                if args.sources:  # CPU ops with Python stacks, so kernels can be traced to their lines
                    activities.append(torch.profiler.ProfilerActivity.CPU)
                profiler = profiling.enter_context(
                    torch.profiler.profile(activities=activities, with_stack=args.sources)
                )
        t_issue = time.perf_counter()
        set_lr(opt, args.lr * min(1.0, (i + 1) / 10))
        n_tok = D.all_reduce_sum(
            torch.tensor(float(sum(int(m.sum()) for *_, m in step_batches)), device=device), dist
        )
        loss_sum = torch.zeros((), device=device)
        for j, (ids, tgt, docs, mask) in enumerate(step_batches):
            ids, tgt, mask = (
                ids.to(device, non_blocking=True),
                tgt.to(device, non_blocking=True),
                mask.to(device),
            )
            docs = docs.to(device) if docs is not None else None
            if graphed is not None:
                loss_sum += graphed(ids, docs, tgt, mask, dist.world_size / n_tok)
                continue
            sync = j == accum - 1
            with train_model.no_sync() if dist.active and not sync else contextlib.nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16):  # chunked CE, as the trainer does
                    part = train_model(ids, doc_ids=docs, targets=tgt, loss_mask=mask)
                (part * (dist.world_size / n_tok)).backward()
            loss_sum += part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history = policy.amax_history
        first_history = history is not None and not history.ready
        policy.end_step(False, lambda t: D.all_reduce_max(t, dist))  # delayed scaling's history
        if graphed is not None and first_history and history.ready:
            graphed.reset()  # as the trainer: warm up (autotune) and capture the delayed kernels anew
        if graphed is not None:
            graphed.zero_grad()  # in place where the graph adds into these tensors
        else:
            opt.zero_grad(set_to_none=True)
        loss_now = D.all_reduce_sum(loss_sum, dist) / n_tok
        if args.warmup <= i < args.warmup + args.steps:
            host_s.append(time.perf_counter() - t_issue)  # issued; .item() below waits for the GPU
        losses.append(loss_now.item())
    torch.cuda.synchronize(device)
    if elapsed is None:
        elapsed = time.perf_counter() - t0
    if cprof is not None:
        cprof.disable()
        host_top = _host_top(cprof, args.cprofile)
    groups, top, sources = None, None, None
    profiling.close()
    if profiler is not None:
        events = [e for e in profiler.key_averages() if str(e.device_type).endswith("CUDA")]
        groups = step_profile.breakdown(events, args.profile)
        top = step_profile.top_kernels(events, args.profile, args.top)
        if args.sources:
            sources = step_profile.top_sources(profiler.events(), args.profile)
    tok_s = tokens_per_step * args.steps / elapsed
    peak = peak_flops(device)
    result = {
        "recipe": recipe,
        "precision": described,
        "tokens_per_s": tok_s,
        "step_ms": 1e3 * elapsed / args.steps,
        "host_ms": 1e3 * sum(host_s) / max(1, len(host_s)),
        "mfu": mfu(model.flops_per_token(args.seq), tok_s, dist.world_size, peak),
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "losses": losses[: args.warmup + args.steps],
        "profile": None if groups is None else _profile_dict(groups),
        "top_kernels": top,
        "top_sources": sources,
        "host_top": host_top,
    }
    del model, opt, fwd, train_model, graphed
    torch.cuda.empty_cache()
    return result


def _host_top(prof: cProfile.Profile, steps: int, n: int = 30) -> list[tuple[str, float, float, int]]:
    """The ``n`` functions with the most own host time: (where, own ms per step, cumulative ms per
    step, calls per step). Why: when "host ms" is close to "step ms", this says which Python to cut."""
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in stats.stats.items():
        where = f"{path.split('site-packages/')[-1].split('src/')[-1]}:{line} {name}"
        rows.append((where, 1e3 * own / steps, 1e3 * cum / steps, round(calls / steps)))
    return sorted(rows, key=lambda r: -r[1])[:n]


def _profile_dict(groups: dict[str, tuple[float, int]]) -> dict:
    return {k: {"ms": ms, "launches": n} for k, (ms, n) in groups.items()}


def main() -> int:
    args = parse_args()
    if args.without:
        print(f"fused FP8 paths off: {', '.join(disable_fusions(args.without))}")
    if args.unfused_epilogue:
        gemm.FUSED_EPILOGUE = False
        print("NVFP4 GEMM epilogue: a second pass over the FP32 product")
    if args.nvfp4_pair:
        gemm.FUSED_NVFP4_PAIR = args.nvfp4_pair == "on"
    print(f"NVFP4 operand pairs: {'one pass' if gemm.FUSED_NVFP4_PAIR else 'two passes'} over x and dy")
    if args.producer_amaxes:
        gemm.PRODUCER_NVFP4_AMAXES = args.producer_amaxes == "on"
    print(
        f"NVFP4 amaxes of x: {'from its producer' if gemm.PRODUCER_NVFP4_AMAXES else 'a pass of their own'}"
    )
    if args.tma_gemm or args.fused_max_k:
        from inkling_fp4.numerics.kernels import scaled_gemm  # needs triton

        if args.tma_gemm:
            scaled_gemm.TMA_FED = args.tma_gemm == "on"
        if args.fused_max_k:
            gemm.FUSED_MAX_K = args.fused_max_k
        print(
            f"NVFP4 fused GEMM: fed by {'TMA' if scaled_gemm.TMA_FED else 'pointers'}, "
            f"K <= {gemm.FUSED_MAX_K}"
        )
    if args.saved_x:
        gemm.SAVED_WGRAD_VALUES = args.saved_x == "values"
        print(f"NVFP4 x kept for wgrad: {'BF16 values' if gemm.SAVED_WGRAD_VALUES else 'codes'}")
    if args.rht_loads:
        from inkling_fp4.numerics.kernels import nvfp4_rht  # needs triton

        nvfp4_rht.WIDE_LOADS = args.rht_loads == "wide"
        print(f"NVFP4 RHT kernel: {args.rht_loads} loads")
    if args.tiles:
        print(f"NVFP4 quantizer tiles: {' '.join(set_tiles(args.tiles))}")
    if not torch.cuda.is_available():
        print("bench_pretrain.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dist = D.init_distributed("cuda")
    model_fields, default_batch = CONFIGS[args.config]
    batch = args.batch or default_batch
    micro = args.micro_batch or batch // dist.world_size
    accum = batch // (micro * dist.world_size)
    if accum * micro * dist.world_size != batch:
        raise SystemExit(f"--batch {batch} is not a multiple of micro batch {micro} x {dist.world_size} GPUs")
    cfg = from_dict(
        RunConfig,
        {
            "name": f"bench-{args.config}",
            "model": {**model_fields, "ssd_impl": args.ssd_impl},
            "data": {"vocab_size": 32768, "seq_len": args.seq, "max_documents": 4000},
            "train": {"batch_size": batch, "micro_batch_size": micro},
        },
    )
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    results, crashed = [], []
    for r in recipes:  # one recipe's crash must not lose the others' numbers
        try:
            results.append(bench_recipe(r, args, dist, cfg, micro, accum))
        except Exception as err:
            traceback.print_exc()
            crashed.append(f"{r}: crashed: {type(err).__name__}: {err}")
            torch.cuda.empty_cache()
    failures = check(results) + crashed
    if dist.is_main:
        report(args, cfg, dist, micro, accum, results, failures)
    D.shutdown(dist)
    return 1 if failures else 0


def check(results: list[dict]) -> list[str]:
    failures = []
    base = next((r for r in results if r["recipe"] == "bf16"), None)
    for r in results:
        ls = r["losses"]
        if not all(math.isfinite(x) for x in ls):
            failures.append(f"{r['recipe']}: non-finite loss")
            continue
        if base is not None and abs(ls[0] - base["losses"][0]) > 0.02 * base["losses"][0]:
            failures.append(f"{r['recipe']}: first loss {ls[0]:.4f} vs bf16 {base['losses'][0]:.4f}")
        k = max(1, len(ls) // 5)
        if sum(ls[-k:]) / k >= sum(ls[:k]) / k:
            failures.append(f"{r['recipe']}: the loss did not go down ({ls[0]:.4f} -> {ls[-1]:.4f})")
    return failures


def report(args, cfg, dist, micro, accum, results, failures) -> None:
    gpu = torch.cuda.get_device_name(dist.device)
    n_params = HybridLM(ModelConfig(**to_dict(cfg.model))).num_params() / 1e6
    print(
        f"{args.config}: {n_params:.0f}M params, seq {args.seq}, batch {cfg.train.batch_size} "
        f"({micro} x {accum} accum x {dist.world_size} GPU), {args.steps} timed steps after {args.warmup}, "
        f"data {args.data}, compile {args.compile}, {gpu} x {dist.world_size}"
    )
    base = next((r for r in results if r["recipe"] == "bf16"), None)
    head = (
        f"{'recipe':<16}{'tokens/s':>12}{'step ms':>10}{'host ms':>9}{'MFU':>8}{'peak GiB':>10}{'vs bf16':>9}"
    )
    print(f"{head}  loss first->last")
    for r in results:
        ratio = f"{r['step_ms'] / base['step_ms']:.2f}x" if base else "-"
        mfu_s = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        print(
            f"{r['recipe']:<16}{r['tokens_per_s']:>12,.0f}{r['step_ms']:>10.1f}{r['host_ms']:>9.1f}{mfu_s:>8}"
            f"{r['peak_mem_gib']:>10.1f}{ratio:>9}  {r['losses'][0]:.4f}->{r['losses'][-1]:.4f}"
        )
    for r in results:
        print(f"  {r['recipe']}: {r['precision']}")
    for r in results:
        if r["profile"] is not None:
            groups = {k: (v["ms"], v["launches"]) for k, v in r["profile"].items()}
            title = f"{r['recipe']} ({args.profile} steps)"
            print(step_profile.format_breakdown(title, groups, r["step_ms"]))
            print(step_profile.format_top(r["top_kernels"]))
            if r.get("top_sources"):
                print(step_profile.format_sources(r["top_sources"]))
    for r in results:
        if r.get("host_top"):
            print(f"{r['recipe']}: host time by function (own ms per step, cumulative ms, calls per step)")
            for where, own, cum, calls in r["host_top"]:
                print(f"  {own:8.2f} {cum:9.2f} {calls:6d}  {where[:140]}")
    if args.config == "peer158m" and base is not None:
        x = base["tokens_per_s"] / PEER_TOKENS_PER_S
        print(f"bf16 vs the transformers NemotronH peer (126K tokens/s): {x:.2f}x (target >= 2x)")
    summary = {
        "config": args.config,
        "gpu": gpu,
        "world_size": dist.world_size,
        "args": vars(args) | {"out": str(args.out), "compare_to": str(args.compare_to)},
        "results": results,
        "failures": failures,
    }
    if args.compare_to is not None:
        summary["comparison"] = compare(json.loads(args.compare_to.read_text()), summary)
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))
        print(f"wrote {args.out}")
    for f in failures:
        print(f"FAIL {f}")


def compare(other: dict, this: dict) -> dict:
    """Scaling efficiency and the largest loss difference against another run of this script."""
    out = {}
    for r in this["results"]:
        o = next((x for x in other["results"] if x["recipe"] == r["recipe"]), None)
        if o is None:
            continue
        eff = (r["tokens_per_s"] / this["world_size"]) / (o["tokens_per_s"] / other["world_size"])
        n = min(len(r["losses"]), len(o["losses"]))
        diff = max(abs(a - b) / b for a, b in zip(r["losses"][:n], o["losses"][:n], strict=True))
        out[r["recipe"]] = {"scaling_efficiency": eff, "max_rel_loss_diff": diff, "steps_compared": n}
        print(
            f"{r['recipe']}: {this['world_size']} vs {other['world_size']} GPU(s): scaling efficiency "
            f"{eff:.1%} (target >= 85%), largest relative loss difference over {n} steps {diff:.2e}"
        )
    return out


if __name__ == "__main__":
    sys.exit(main())

"""The pretraining loop: one function, read top to bottom, that turns a config into a run directory.

What happens, in order: seeds; the data stream (rank-sharded) and its tokenizer; the model on its
device with the precision policy applied (the log says which layers are quantized how); AdamW;
the WSD learning-rate schedule and the precision schedule that switches to BF16 before the decay
(paper §5); resume from the newest checkpoint that verifies; then per step

    LR for the step -> precision switch if due -> micro batches (grad accumulation) forward under
    BF16 autocast (CUDA), FP32 cross-entropy over loss_mask, backward -> global grad norm and clip ->
    noise monitor (skip the update on a spike or a non-finite value; fall back to BF16 after
    repeated triggers) -> AdamW step -> log, evaluate, checkpoint.

Under torchrun the same function runs on every rank: DDP replicas or FSDP2 shards
(``train.parallel``), each rank reading its own share of every global batch, rank 0 logging and
writing checkpoints; the global batch and so the loss curve do not depend on the number of GPUs.

Evaluation always measures the validation loss with every GEMM in BF16 (how the paper reports
loss) and, optionally, in the training precision too. SIGINT / SIGTERM end the step in flight,
write a checkpoint and return cleanly; ``--resume`` then continues bit for bit (same data
position, RNG states, stochastic-rounding generators, optimizer state, monitor history).

Steps count from 1: step k is the k-th optimizer update and ``checkpoints/step_<k>`` the state after it.
Legend: B micro-batch sequences, L sequence length, V vocabulary.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from inkling_fp4.config import RunConfig, save_config, to_dict
from inkling_fp4.data.pipeline import build_pretrain_data
from inkling_fp4.data.tokenizer import check_vocab
from inkling_fp4.errors import ConfigError, NumericsError, UserError
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.precision import finite_guard
from inkling_fp4.precision.policy import PrecisionPolicy
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.train import determinism
from inkling_fp4.train import distributed as D
from inkling_fp4.train.checkpoint import (
    check_processes,
    latest_good,
    load_model_tensors,
    model_tensors,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from inkling_fp4.train.evaluate import all_gemms_in_bf16, evaluate
from inkling_fp4.train.flops import mfu, peak_flops
from inkling_fp4.train.graphed_step import GraphedMicroStep, graph_blocker
from inkling_fp4.train.interrupt import StopSignal
from inkling_fp4.train.metrics import MetricsLogger, format_duration
from inkling_fp4.train.monitor import NoiseMonitor
from inkling_fp4.train.optimizer import build_optimizer, load_optimizer_tensors, optimizer_tensors, set_lr
from inkling_fp4.train.schedule import PrecisionSchedule, WSDSchedule
from inkling_fp4.train.sharding import full_state, is_sharded, load_full_state, local_value, shard_model


def run(cfg: RunConfig, run_dir: Path, resume: bool = False, baseline: Path | None = None) -> Path:
    """Train ``cfg`` into ``run_dir`` (continuing its latest good checkpoint with ``resume``)."""
    run_dir = Path(run_dir)
    if cfg.train.deterministic:  # before the first GEMM on the GPU: cuBLAS reads its setting once
        determinism.enable_determinism()
    dist = D.init_distributed(cfg.train.device)
    device = dist.device
    live_gap = _live_gap(baseline)
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    D.barrier(dist)

    # -- seeds and batch geometry -------------------------------------------------------------
    seed = cfg.train.seed
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    micro, accum = _batch_geometry(cfg, dist.world_size)
    seq_len = cfg.data.seq_len
    tokens_per_step = cfg.train.batch_size * seq_len  # global, every target position

    # -- data ---------------------------------------------------------------------------------
    # rank 0 first: it trains the tokenizer and writes the token shards; the others then read them
    for building in (True, False):
        if dist.is_main == building:
            data = build_pretrain_data(
                cfg.data, run_dir, seed, rank=dist.rank, world_size=dist.world_size,
                total_tokens=cfg.train.steps * tokens_per_step,
            )  # fmt: skip
        D.barrier(dist)
    check_vocab(data.tokenizer, cfg.model.vocab_size)
    if dist.is_main and not (run_dir / "tokenizer.json").is_file():
        data.tokenizer.save(run_dir / "tokenizer.json")
    # each rank evaluates its share of eval.batches x micro x ranks windows: with the default micro batch
    # (batch_size / ranks) the validation set is the same whatever the number of processes
    val_batches = data.val_batches(cfg.eval.batches, micro, rank_shard=True)

    # -- model, precision, optimizer, schedules -----------------------------------------------
    # built in place: a 12B model never passes through host memory
    with torch.device(device), _initial_weights_rng(cfg.train.init_seed, device):
        model = HybridLM(cfg.model)
    sharded = cfg.train.parallel == "fsdp" and dist.active
    _check_memory(model, dist, sharded)
    if sharded:
        shard_model(model, dist)  # before the optimizer: it must hold the shards
    policy = PrecisionPolicy(cfg.precision, cfg.model.n_layers)
    policy.set_generator_seed(seed * 1009 + dist.rank)  # a distinct stochastic-rounding stream per rank
    policy.apply(model)
    optimizer = build_optimizer(model, cfg.optim)
    wsd = WSDSchedule(
        cfg.train.steps, cfg.train.warmup_steps, cfg.train.decay_fraction, cfg.train.decay_shape,
        cfg.train.min_lr_ratio,
    )  # fmt: skip
    switch = PrecisionSchedule(None if cfg.precision.recipe == "bf16" else cfg.precision.switch_to_bf16, wsd)
    monitor = NoiseMonitor(cfg.monitor)
    step = 0

    # -- resume -------------------------------------------------------------------------------
    notes: list[str] = []
    if resume:
        ckpt = latest_good(run_dir, report=notes.append)
        if ckpt is None:
            raise UserError(
                f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}; start without --resume"
            )
        check_processes(ckpt.path, ckpt.state, dist.world_size)
        if sharded:
            load_full_state(model, optimizer, ckpt.model, ckpt.optimizer)
        else:
            load_model_tensors(model, ckpt.model, device)
            load_optimizer_tensors(optimizer, model, ckpt.optimizer)
        data.train.load_state_dict(ckpt.state["data"][dist.rank])
        policy.load_state_dict(ckpt.state["precision"][dist.rank])
        monitor.load_state_dict(ckpt.state["monitor"])
        set_rng_state(ckpt.state["rng"][dist.rank], device)
        step = ckpt.step
        notes.append(f"resumed from {ckpt.path} (step {step})")
    _set_precision(model, policy, monitor)

    fwd_model = torch.compile(model) if cfg.train.compile else model
    train_model = fwd_model if sharded else D.wrap_model(fwd_model, dist)
    autocast = _autocast(device)

    def micro_loss(ids, doc_ids, targets, loss_mask):  # summed FP32 cross-entropy, chunked: no full logits
        with autocast:
            return train_model(ids, doc_ids=doc_ids, targets=targets, loss_mask=loss_mask)

    graphed = GraphedMicroStep(model, micro_loss, accumulate=accum > 1) if cfg.train.cuda_graph else None
    flops_per_token = model.flops_per_token(seq_len)
    peak = peak_flops(device, cfg.log.peak_flops)
    log = MetricsLogger(
        run_dir, run_name=cfg.name, total_steps=cfg.train.steps, start_step=step, config=to_dict(cfg),
        wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project, progress=cfg.log.progress,
        enabled=dist.is_main,
    )  # fmt: skip
    for note in notes:
        log.event(step, "resume", note)
    log.info(f"data: {data.describe()}")
    log.info(
        f"model: {model.num_params() / 1e6:.2f}M parameters, pattern {cfg.model.pattern}, "
        f"{flops_per_token / 1e6:.1f} MFLOP/token (train) at seq {seq_len}"
    )
    log.info(f"precision: {policy.describe(model)}")
    if cfg.train.deterministic:
        log.info(determinism.describe())
    log.info(
        f"device: {device} x {dist.world_size} | batch {cfg.train.batch_size} x {seq_len} = "
        f"{micro} micro x {accum} accum x {dist.world_size} ranks | lr {cfg.optim.lr:g} WSD "
        f"(warmup {wsd.warmup_steps}, decay {cfg.train.decay_shape} from step {wsd.first_decay_step}) | "
        f"BF16 switch: {'step ' + str(switch.switch_step) if switch.switch_step else 'never'}"
    )

    # -- the loop -----------------------------------------------------------------------------
    stop = StopSignal()
    last_val = None
    if step >= cfg.train.steps:
        log.info(f"the run is already complete ({step} of {cfg.train.steps} steps); nothing to do")
    # throughput counts training time only: evaluation and checkpoint time goes to `paused`
    timer_t0, timer_steps, paused, session_time, session_steps = time.perf_counter(), 0, 0.0, 0.0, 0
    use_graph = _graph_on(graphed, model, dist, log, step, None)
    try:
        while step < cfg.train.steps:
            step += 1
            if switch.in_bf16(step) and policy.switched_scope is None:
                policy.switch_to_bf16(model, cfg.precision.switch_scope)
                _set_precision(model, policy, monitor)
                log.event(step, "precision_switch", f"precision: step {step}: {policy.describe(model)}")
                use_graph = _graph_on(graphed, model, dist, log, step, use_graph)
            if monitor.fallback_ends_at(step):
                _set_precision(model, policy, monitor)
                log.event(
                    step, "monitor_fallback_end", f"monitor: step {step}: back to {policy.describe(model)}"
                )
                use_graph = _graph_on(graphed, model, dist, log, step, use_graph)
            lr = cfg.optim.lr * wsd.lr_ratio(step)
            set_lr(optimizer, lr)

            # forward / backward over the micro batches; the loss is the mean over every trained
            # target token of the global batch, so the gradient does not depend on how it is split
            batches = [data.train.next_batch(micro).to(device, non_blocking=True) for _ in range(accum)]
            n_tokens = D.all_reduce_sum(
                torch.tensor(float(sum(b.num_tokens for b in batches)), device=device), dist
            )
            loss_sum, fault = torch.zeros((), device=device), None
            grad_scale = dist.world_size / n_tokens  # DDP averages over ranks
            for i, b in enumerate(batches):
                micro_batch = (b.input_ids, b.doc_ids, b.targets, b.loss_mask)
                if use_graph:  # forward + backward in one replay; a NaN loss skips the step below
                    try:
                        loss_sum += graphed(*micro_batch, grad_scale)
                    except NumericsError as e:  # the deferred record's own check (every 512 records)
                        fault = _nonfinite_or_raise(e)
                        break
                    continue
                with _gradient_sync(train_model, model, i == accum - 1):
                    try:
                        part = micro_loss(*micro_batch)
                        fault = None if torch.isfinite(part) else f"non-finite loss {part.item()}"
                    except NumericsError as e:  # a quantizer met NaN/Inf in the forward pass
                        fault = _nonfinite_or_raise(e)
                    if D.any_rank(fault is not None, dist):
                        break
                    try:
                        (part * grad_scale).backward()
                    except NumericsError as e:  # ... or in a gradient (single process only: NOTE
                        fault = _nonfinite_or_raise(e)  # under DDP the other ranks would wait)
                        break
                loss_sum += part.detach()
            if fault is None:  # the quantizers' deferred NaN/Inf record: one device read per step
                try:
                    if policy.amax_history is not None:  # delayed FP8 scaling's recorded amaxes too
                        policy.amax_history.record_for_check()
                    finite_guard.raise_if_non_finite()
                except NumericsError as e:
                    fault = _nonfinite_or_raise(e)
            finite_guard.discard()
            if D.any_rank(fault is not None, dist) and fault is None:
                fault = "non-finite values on another rank"
            if fault is None:
                loss = (D.all_reduce_sum(loss_sum, dist) / n_tokens).item()
                if use_graph and not math.isfinite(loss):
                    fault = f"non-finite loss {loss}"
                clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
                grad_norm = local_value(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)).item()
            else:
                loss = grad_norm = math.nan

            verdict = monitor.check(step, loss, grad_norm)
            if verdict.skip:
                detail = f" ({fault})" if fault else ""
                log.event(step, verdict.reason, verdict.message + detail, loss=loss, grad_norm=grad_norm)
            else:
                optimizer.step()
            # delayed FP8 scaling: this step's amaxes into the history (a skipped step's are dropped)
            first_history = policy.amax_history is not None and not policy.amax_history.ready
            policy.end_step(verdict.skip, lambda t: D.all_reduce_max(t, dist))
            if graphed is not None:
                graphed.zero_grad()  # once captured: in place, or nothing (each replay writes them)
            else:
                optimizer.zero_grad(set_to_none=True)
            if first_history and policy.amax_history.ready:  # a graph captured before scaled currently
                use_graph = _graph_on(graphed, model, dist, log, step, use_graph)
            if verdict.start_fallback:
                _set_precision(model, policy, monitor)
                log.event(step, "monitor_fallback", f"monitor: step {step}: all GEMMs in BF16 (fallback)")
                use_graph = _graph_on(graphed, model, dist, log, step, use_graph)
            timer_steps += 1
            log.advance(step)

            if step % cfg.train.log_every == 0 or step == cfg.train.steps or verdict.skip:
                elapsed = time.perf_counter() - timer_t0 - paused
                session_time += elapsed
                session_steps += timer_steps
                tok_s = tokens_per_step * timer_steps / elapsed
                record = {
                    "step": step, "tokens": step * tokens_per_step, "loss": loss, "lr": lr,
                    "grad_norm": grad_norm, "precision": _precision_label(cfg, policy, monitor),
                    "phase": wsd.phase_at(step), "tokens_per_s": tok_s,
                    "mfu": mfu(flops_per_token, tok_s, dist.world_size, peak),
                    "eta_s": (cfg.train.steps - step) * session_time / session_steps, "skipped": verdict.skip,
                }  # fmt: skip
                if live_gap is not None:
                    record["baseline_loss"] = live_gap.at(step)
                    record["gap"] = live_gap.gap(step, loss)
                log.log_step(record)
                timer_t0, timer_steps, paused = time.perf_counter(), 0, 0.0

            pause_t0 = time.perf_counter()
            interrupted = D.any_rank(stop.requested, dist)
            last = step == cfg.train.steps or step == cfg.train.stop_after or interrupted
            if (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.train.steps:
                last_val = _evaluate_and_log(
                    fwd_model, val_batches, autocast, dist, log, cfg, policy, monitor, step,
                    step * tokens_per_step, wsd.phase_at(step),
                )  # fmt: skip
            if (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or last:
                path = _checkpoint(run_dir, step, model, optimizer, data, policy, monitor, switch, dist, cfg)
                log.event(step, "checkpoint", f"checkpoint: {path}")
            if last:
                if interrupted:
                    log.event(step, "interrupt", f"interrupted after step {step}; continue with --resume")
                elif step < cfg.train.steps:
                    log.event(
                        step, "stop", f"stopped after step {step} (train.stop_after); continue with --resume"
                    )
                break
            paused += time.perf_counter() - pause_t0
    finally:
        stop.restore()
        log.close()

    if dist.is_main and step == cfg.train.steps and session_steps:
        val = f", val loss (bf16) {last_val:.4f}" if last_val is not None else ""
        print(f"done: {step} steps in {format_duration(session_time)}{val}", flush=True)
    # The DDP wrapper's reducer holds the process group: drop it (and the graph, which holds the loss
    # function that holds it) before the group is destroyed. Otherwise the group is destroyed later, by
    # the reducer at exit, and its gloo threads could wait for a peer that had left: a hung rank after a
    # finished run.
    graphed = micro_loss = train_model = None
    gc.collect()
    D.barrier(dist)
    D.shutdown(dist)
    return run_dir


# ----------------------------------------------------------------------------------------------
# pieces of the loop


def _evaluate_and_log(
    model, batches, autocast, dist, log, cfg, policy, monitor, step, tokens, phase
) -> float:
    with all_gemms_in_bf16(model):
        val_bf16 = evaluate(model, batches, autocast, dist)
    record = {"step": step, "tokens": tokens, "val_loss_bf16": val_bf16, "phase": phase}
    label = _precision_label(cfg, policy, monitor)
    if cfg.eval.in_training_precision and label != "bf16":
        record["val_loss"] = evaluate(model, batches, autocast, dist)
        record["val_precision"] = label
    else:
        record["val_loss"] = val_bf16
        record["val_precision"] = "bf16"
    log.log(record)
    extra = f" | {label} {record['val_loss']:.4f}" if record["val_precision"] != "bf16" else ""
    log.info(f"eval step {step}: val loss bf16 {val_bf16:.4f}{extra}")
    return val_bf16


def _set_precision(model: nn.Module, policy: PrecisionPolicy, monitor: NoiseMonitor) -> None:
    """The policy's per-layer recipes, overridden to BF16 everywhere while a monitor fallback is on."""
    policy.apply(model)
    if monitor.fallback_active:
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.recipe = None


def _graph_on(
    graphed: GraphedMicroStep | None, model: nn.Module, dist, log: MetricsLogger, step: int, was: bool | None
) -> bool:
    """After a precision change: whether micro-steps run as a CUDA graph now (logged when that
    changes). The old graph replays the old layers' kernels, so it is dropped either way."""
    if graphed is None:
        return False
    graphed.reset()
    blocker = graph_blocker(model, dist.world_size, dist.device)
    if (blocker is None) != was:
        message = "on: forward + backward replayed" if blocker is None else f"off: {blocker}"
        log.event(step, "cuda_graph", f"cuda graph: step {step}: {message}")
    return blocker is None


def _precision_label(cfg: RunConfig, policy: PrecisionPolicy, monitor: NoiseMonitor) -> str:
    if monitor.fallback_active:
        return "bf16-fallback"
    if policy.switched_scope == "all":
        return "bf16"
    if policy.switched_scope == "forward":
        return f"bf16-fwd/{cfg.precision.recipe}-bwd"
    return cfg.precision.recipe


def _checkpoint(run_dir, step, model, optimizer, data, policy, monitor, switch, dist, cfg) -> Path | None:
    """Gather every rank's piece of state; rank 0 writes the checkpoint."""
    state = {
        "data": D.gather_objects(data.train.state_dict(), dist),
        "rng": D.gather_objects(rng_state(dist.device), dist),
        "precision": D.gather_objects(policy.state_dict(), dist),
        "monitor": monitor.state_dict(),
        "schedule": {"total_steps": cfg.train.steps, "lr": optimizer.param_groups[0]["lr"],
                     "switch_step": switch.switch_step, "switched_scope": policy.switched_scope},
    }  # fmt: skip
    path = None
    if is_sharded(model):
        params, opt = full_state(model, optimizer)  # a collective: gathered to rank 0
    elif dist.is_main:
        params, opt = dict(model_tensors(model)), optimizer_tensors(optimizer, model)
    if dist.is_main:
        path = save_checkpoint(run_dir, step, params, opt, state, cfg.checkpoint.keep_last)
    D.barrier(dist)
    return path


@contextlib.contextmanager
def _initial_weights_rng(init_seed: int | None, device: torch.device):
    """Draw the initial weights from ``init_seed`` when it is set. The global generators (CPU and this
    device) then continue from where they were before the build; the data order and the stochastic
    rounding draw from their own generators, seeded from ``train.seed``, so they do not change."""
    if init_seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(init_seed)
        yield


def _batch_geometry(cfg: RunConfig, world: int) -> tuple[int, int]:
    """(micro batch per forward, accumulation steps) for the global batch over ``world`` ranks."""
    batch = cfg.train.batch_size
    if batch % world:
        raise ConfigError(f"train.batch_size={batch} must be a multiple of the {world} processes")
    per_rank = batch // world
    micro = cfg.train.micro_batch_size or per_rank
    if per_rank % micro:
        raise ConfigError(
            f"train.micro_batch_size={micro} must divide the per-process batch {per_rank} "
            f"(train.batch_size {batch} / {world} processes)"
        )
    return micro, per_rank // micro


def _check_memory(model: nn.Module, dist: D.DistInfo, sharded: bool) -> None:
    """FP32 weights, gradients and two Adam moments (16 bytes a parameter) must fit the GPU with room
    for activations; say so before the optimizer runs out of memory halfway through a step."""
    if dist.device.type != "cuda":
        return
    per_gpu = 16 * model.num_params() / (dist.world_size if sharded else 1)
    total = torch.cuda.get_device_properties(dist.device).total_memory
    if per_gpu > 0.8 * total:
        fix = "use more GPUs" if sharded else "shard it with train.parallel=fsdp over several GPUs (torchrun)"
        gpu = torch.cuda.get_device_name(dist.device)
        raise UserError(
            f"the model's FP32 weights, gradients and Adam states need {per_gpu / 2**30:.0f} GiB per GPU, "
            f"more than 80% of the {total / 2**30:.0f} GiB of {gpu}; {fix}"
        )


def _autocast(device: torch.device):
    """BF16 autocast on CUDA; on CPU QuantLinear computes in BF16 by itself and the rest stays FP32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _gradient_sync(train_model: nn.Module, model: nn.Module, sync: bool):
    """Average gradients over ranks only on the last micro batch of a step (DDP's all-reduce, FSDP's
    reduce-scatter); the earlier ones accumulate locally."""
    if sync:
        yield
    elif isinstance(train_model, nn.parallel.DistributedDataParallel):
        with train_model.no_sync():
            yield
    elif is_sharded(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def _nonfinite_or_raise(e: NumericsError) -> str:
    """The message of a quantizer's NaN/Inf error (the monitor's business); other errors propagate."""
    text = str(e)
    if "non-finite" in text or "overflowed to Inf" in text:
        return text
    raise e


def _live_gap(baseline: Path | None):
    if baseline is None:
        return None
    from inkling_fp4.compare.live import LiveGap

    return LiveGap(baseline)

"""The shared trainer: one optimizer step, checkpoints and metrics for every stage (fit.py: the cadence).

pretrain, sft and rollout differ only in their :class:`Task` (batches, loss, evaluation, resumable
state); the trainer never asks which stage it runs. One step:

    LR -> precision switch if due -> micro batches (BF16 autocast, FP32 loss over loss_mask, backward)
       -> grad norm and clip -> noise monitor (skip on a spike or NaN; BF16 fallback) -> AdamW

``loss_fn`` None is the model's masked cross-entropy, which CUDA graphs can capture. The step's loss
is the mean over the global batch's trained tokens (see ``trainer/evaluate.py``). Throughput counts
real tokens (padding excluded, prompts included), so tokens/s and MFU stay honest for padded or
packed batches. Step k is the k-th optimizer update; ``checkpoints/step_<k>`` the state after it.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from inkling_fp4 import distributed as D
from inkling_fp4.compare.live import LiveGap
from inkling_fp4.config import RunConfig, to_dict
from inkling_fp4.data.batch import Batch
from inkling_fp4.errors import ConfigError, NumericsError, UserError
from inkling_fp4.model.fused_fp8.layers import fuse_fp8
from inkling_fp4.model.fused_nvfp4_train import fuse_nvfp4_train
from inkling_fp4.precision import finite_guard
from inkling_fp4.precision.autocast import autocast_for
from inkling_fp4.precision.graph_capture import graph_blocker
from inkling_fp4.precision.policy import PrecisionPolicy
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.runs.checkpoint import (
    Checkpoint,
    check_processes,
    load_model_tensors,
    model_tensors,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from inkling_fp4.runs.metrics import MetricsLogger
from inkling_fp4.runs.schedule import PrecisionSchedule, WSDSchedule
from inkling_fp4.trainer import determinism
from inkling_fp4.trainer.evaluate import all_gemms_in_bf16, evaluate
from inkling_fp4.trainer.flops import peak_flops
from inkling_fp4.trainer.graphed_step import GraphedMicroStep
from inkling_fp4.trainer.monitor import NoiseMonitor, Verdict
from inkling_fp4.trainer.optimizer import build_optimizer, load_optimizer_tensors, optimizer_tensors, set_lr
from inkling_fp4.trainer.replicas import check_replicas
from inkling_fp4.trainer.sharding import full_state, is_sharded, load_full_state, local_value, shard_model


class Task(Protocol):
    """What a stage hands the trainer; ``step_metrics()`` are its own figures for a logged step."""

    loss_fn: Callable | None

    def next_batches(self, micro: int, accum: int) -> list[Batch]: ...

    def real_tokens(self, batches: list[Batch]) -> int: ...

    def evaluate(self, trainer: Trainer) -> dict | None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def step_metrics(self) -> dict: ...


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    verdict: Verdict
    trained_tokens: int
    """Target tokens the loss was taken over, all ranks."""
    real_tokens: int
    """Non-padding tokens of the step, all ranks."""
    fault: str | None = None


class Trainer:
    """Model, policy, optimizer, schedules, monitor and logger of one run, made once weights are in place."""

    def __init__(self, cfg: RunConfig, run_dir: Path, dist: D.DistInfo, model: nn.Module, baseline=None):
        self.cfg, self.run_dir, self.dist, self.device = cfg, Path(run_dir), dist, dist.device
        self.micro, self.accum = batch_geometry(cfg, dist.world_size)
        self.model = model
        self.sharded = cfg.train.parallel == "fsdp" and dist.active
        if cfg.precision.recipe != "bf16" and cfg.precision.fp8_scaling == "delayed":
            fuse_fp8(model)  # the fused FP8 training paths, before any wrapper subclasses the classes
        elif cfg.precision.recipe == "nvfp4":
            fuse_nvfp4_train(model)  # the producers' NVFP4 amaxes, before any wrapper subclasses the classes
        check_memory(model, dist, self.sharded)
        if self.sharded:
            shard_model(model, dist)  # before the optimizer: it must hold the shards
        self.policy = PrecisionPolicy(cfg.precision, cfg.model.n_layers)
        self.policy.set_generator_seed(cfg.train.seed * 1009 + dist.rank)  # a stream per rank
        self.policy.apply(model)
        self.optimizer = build_optimizer(model, cfg.optim)
        t = cfg.train
        self.wsd = WSDSchedule(t.steps, t.warmup_steps, t.decay_fraction, t.decay_shape, t.min_lr_ratio)
        switch = None if cfg.precision.recipe == "bf16" else cfg.precision.switch_to_bf16
        self.switch = PrecisionSchedule(switch, self.wsd)
        self.monitor = NoiseMonitor(cfg.monitor)
        self.step_count = 0
        self.tokens = {"real": 0, "trained": 0}
        self.live_gap = _live_gap(baseline)
        self.log: MetricsLogger | None = None
        self._built = False

    # -- set-up --------------------------------------------------------------------------------

    def restore(self, ckpt: Checkpoint) -> dict:
        """Load a checkpoint of this run; returns this rank's task state."""
        check_processes(ckpt.path, ckpt.state, self.dist.world_size)
        if self.sharded:
            load_full_state(self.model, self.optimizer, ckpt.model, ckpt.optimizer)
        else:
            load_model_tensors(self.model, ckpt.model, self.device)
            load_optimizer_tensors(self.optimizer, self.model, ckpt.optimizer)
        rank = self.dist.rank
        self.policy.load_state_dict(ckpt.state["precision"][rank])
        self.monitor.load_state_dict(ckpt.state["monitor"])
        set_rng_state(ckpt.state["rng"][rank], self.device)
        self.step_count = ckpt.step
        per_step = self.cfg.train.batch_size * self.cfg.data.seq_len  # checkpoints without counts
        saved = ckpt.state.get("tokens") or {"real": ckpt.step * per_step, "trained": ckpt.step * per_step}
        self.tokens = {"real": int(saved["real"]), "trained": int(saved["trained"])}
        return ckpt.state["data"][rank]

    def build(self) -> None:
        """Once weights and states are final: set the precision, compile / wrap the model, the graph."""
        self._set_precision()
        self.fwd_model = torch.compile(self.model) if self.cfg.train.compile else self.model
        self.train_model = self.fwd_model if self.sharded else D.wrap_model(self.fwd_model, self.dist)
        self.autocast = autocast_for(self.device)
        self.graphed = (
            GraphedMicroStep(self.model, self._micro_loss, accumulate=self.accum > 1)
            if self.cfg.train.cuda_graph
            else None
        )
        self.use_graph = False  # until fit() asks graph_blocker (and logs the answer)
        self.own_loss = False
        self.flops_per_token = self.model.flops_per_token(self.cfg.data.seq_len)
        self.peak = peak_flops(self.device, self.cfg.log.peak_flops)
        self._built = True

    def open_log(self, notes: list[str], describe: list[str]) -> MetricsLogger:
        """The metrics logger (cut back to the restored step) and the run's header lines."""
        cfg, model = self.cfg, self.model
        self.log = MetricsLogger(
            self.run_dir, run_name=cfg.name, total_steps=cfg.train.steps, start_step=self.step_count,
            config=to_dict(cfg), wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project,
            progress=cfg.log.progress, enabled=self.dist.is_main,
        )  # fmt: skip
        for note in notes:
            self.log.event(self.step_count, "resume", note)
        for line in describe:
            self.log.info(line)
        self.log.info(
            f"model: {model.num_params() / 1e6:.2f}M parameters, pattern {cfg.model.pattern}, "
            f"{self.flops_per_token / 1e6:.1f} MFLOP/token (train) at seq {cfg.data.seq_len}"
        )
        self.log.info(f"precision: {self.policy.describe(model)}")
        if cfg.train.deterministic:
            self.log.info(determinism.describe())
        self.log.info(
            f"device: {self.device} x {self.dist.world_size} | batch {cfg.train.batch_size} x "
            f"{cfg.data.seq_len} = {self.micro} micro x {self.accum} accum x {self.dist.world_size} ranks | "
            f"lr {cfg.optim.lr:g} WSD (warmup {self.wsd.warmup_steps}, decay {cfg.train.decay_shape} from "
            f"step {self.wsd.first_decay_step}) | BF16 switch: "
            f"{'step ' + str(self.switch.switch_step) if self.switch.switch_step else 'never'}"
        )
        return self.log

    # -- one optimizer step --------------------------------------------------------------------

    def step(self, batches: list[Batch], loss_fn: Callable | None = None, real_tokens: int = 0) -> StepResult:
        """One optimizer update over this rank's micro batches. ``loss_fn(train_model, batch)`` returns a
        micro batch's summed loss (None: masked cross-entropy). ``real_tokens``: this rank's
        non-padding tokens, reduced with the trained ones in one collective."""
        assert self._built, "Trainer.build() first"
        cfg, dist, policy, monitor, log = self.cfg, self.dist, self.policy, self.monitor, self.log
        self.step_count += 1
        step = self.step_count
        if self.switch.in_bf16(step) and policy.switched_scope is None:
            policy.switch_to_bf16(self.model, cfg.precision.switch_scope)
            self._set_precision()
            log.event(step, "precision_switch", f"precision: step {step}: {policy.describe(self.model)}")
            self.graph_on(step)
        if monitor.fallback_ends_at(step):
            self._set_precision()
            log.event(
                step, "monitor_fallback_end", f"monitor: step {step}: back to {policy.describe(self.model)}"
            )
            self.graph_on(step)
        lr = cfg.optim.lr * self.wsd.lr_ratio(step)
        set_lr(self.optimizer, lr)

        trained, real = _global_counts([sum(b.num_tokens for b in batches), real_tokens], dist)
        self.tokens["trained"] += trained
        self.tokens["real"] += real
        batches = [b.to(self.device, non_blocking=True) for b in batches]
        # a step with nothing to train (RL: every completion masked) has a zero loss: no 0 / 0
        n_tokens = torch.tensor(float(max(trained, 1)), device=self.device)
        loss_sum, fault = torch.zeros((), device=self.device), None
        grad_scale = dist.world_size / n_tokens  # DDP averages over ranks
        use_graph = self.use_graph and loss_fn is None
        for i, b in enumerate(batches):
            if use_graph:  # forward + backward in one replay; a NaN loss skips the step below
                try:
                    loss_sum += self.graphed(b.input_ids, b.doc_ids, b.targets, b.loss_mask, grad_scale)
                except NumericsError as e:  # the deferred record's own check (every 512 records)
                    fault = _nonfinite_or_raise(e)
                    break
                continue
            with _gradient_sync(self.train_model, self.model, i == len(batches) - 1):
                try:
                    if loss_fn is None:
                        part = self._micro_loss(b.input_ids, b.doc_ids, b.targets, b.loss_mask)
                    else:
                        with self.autocast:
                            part = loss_fn(self.train_model, b)
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
            grad_norm = local_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)).item()
        else:
            loss = grad_norm = math.nan

        watch_loss = loss_fn is None or getattr(loss_fn, "fits_data", True)  # False: RL's surrogate
        verdict = monitor.check(step, loss, grad_norm, watch_loss=watch_loss)
        if verdict.skip:
            detail = f" ({fault})" if fault else ""
            log.event(step, verdict.reason, verdict.message + detail, loss=loss, grad_norm=grad_norm)
        else:
            self.optimizer.step()
        # delayed FP8 scaling: this step's amaxes into the history (a skipped step's are dropped)
        first_history = policy.amax_history is not None and not policy.amax_history.ready
        policy.end_step(verdict.skip, lambda t: D.all_reduce_max(t, dist))
        if self.graphed is not None:
            self.graphed.zero_grad()  # once captured: in place, or nothing (each replay writes them)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if first_history and policy.amax_history.ready:  # a graph captured before scaled currently
            self.graph_on(step)
        if verdict.start_fallback:
            self._set_precision()
            log.event(step, "monitor_fallback", f"monitor: step {step}: all GEMMs in BF16 (fallback)")
            self.graph_on(step)
        return StepResult(loss, grad_norm, lr, verdict, trained, real, fault)

    def _micro_loss(self, ids, doc_ids, targets, loss_mask):
        """Summed FP32 cross-entropy over loss_mask, chunked: no full logits."""
        with self.autocast:
            return self.train_model(ids, doc_ids=doc_ids, targets=targets, loss_mask=loss_mask)

    # -- evaluation, checkpoints ---------------------------------------------------------------

    def validation_loss(self, batches: list[Batch]) -> dict:
        """The validation loss with every GEMM in BF16 (how the paper reports loss) and, unless
        ``eval.in_training_precision`` is off, in the training precision as well."""
        with all_gemms_in_bf16(self.fwd_model):
            val_bf16 = evaluate(self.fwd_model, batches, self.autocast, self.dist)
        record = {"val_loss_bf16": val_bf16}
        label = self.precision_label()
        if self.cfg.eval.in_training_precision and label != "bf16":
            record["val_loss"] = evaluate(self.fwd_model, batches, self.autocast, self.dist)
            record["val_precision"] = label
        else:
            record["val_loss"] = val_bf16
            record["val_precision"] = "bf16"
        return record

    def checkpoint(self, task_state: dict) -> Path | None:
        """Gather every rank's piece of state; rank 0 writes ``checkpoints/step_<k>``."""
        dist, cfg = self.dist, self.cfg
        state = {
            "data": D.gather_objects(task_state, dist),
            "rng": D.gather_objects(rng_state(self.device), dist),
            "precision": D.gather_objects(self.policy.state_dict(), dist),
            "monitor": self.monitor.state_dict(),
            "schedule": {"total_steps": cfg.train.steps, "lr": self.optimizer.param_groups[0]["lr"],
                         "switch_step": self.switch.switch_step,
                         "switched_scope": self.policy.switched_scope},
            "tokens": dict(self.tokens),
        }  # fmt: skip
        path = None
        if not is_sharded(self.model):
            check_replicas(self.model, dist, self.step_count)
        if is_sharded(self.model):
            params, opt = full_state(self.model, self.optimizer)  # a collective: gathered to rank 0
        elif dist.is_main:
            params, opt = dict(model_tensors(self.model)), optimizer_tensors(self.optimizer, self.model)
        if dist.is_main:
            path = save_checkpoint(
                self.run_dir, self.step_count, params, opt, state, cfg.checkpoint.keep_last
            )
        D.barrier(dist)
        return path

    def precision_label(self) -> str:
        if self.monitor.fallback_active:
            return "bf16-fallback"
        if self.policy.switched_scope == "all":
            return "bf16"
        if self.policy.switched_scope == "forward":
            return f"bf16-fwd/{self.cfg.precision.recipe}-bwd"
        return self.cfg.precision.recipe

    def close(self) -> None:
        """Drop the DDP wrapper and the graph before the process group goes: destroyed at exit, the
        reducer's gloo threads could wait for a peer that had left (a hung rank after a finished run)."""
        if self.log is not None:
            self.log.close()
        self.graphed = self.train_model = self.fwd_model = None
        gc.collect()

    # -- precision changes ---------------------------------------------------------------------

    def _set_precision(self) -> None:
        """The policy's per-layer recipes, overridden to BF16 everywhere while a monitor fallback is on."""
        self.policy.apply(self.model)
        if self.monitor.fallback_active:
            for m in self.model.modules():
                if isinstance(m, QuantLinear):
                    m.recipe = None

    def graph_on(self, step: int, first: bool = False, own_loss: bool | None = None) -> None:
        """After a precision change: whether micro-steps run as a CUDA graph now (logged on change). The
        old graph replays the old kernels, so it is dropped either way. ``own_loss`` (given once, by fit):
        the task brings its own loss (RL), whose micro-steps :meth:`step` runs eagerly."""
        was = None if first else self.use_graph
        if own_loss is not None:
            self.own_loss = own_loss
        if self.graphed is None:
            self.use_graph = False
            return
        self.graphed.reset()
        blocker = graph_blocker(self.model, self.dist.world_size, self.device)
        if blocker is None and self.own_loss:
            blocker = "the stage's own loss runs eagerly (its batches change shape from step to step)"
        auto = self.cfg.train.cuda_graph == "auto"
        if auto and blocker is None and self.cfg.train.compile:
            blocker = "train.compile is on (set train.cuda_graph=true to capture the compiled model)"
        quiet = auto and self.device.type != "cuda"  # no GPU: nothing a user expected to be graphed
        if (blocker is None) != was and not quiet:
            message = "on: forward + backward replayed" if blocker is None else f"off: {blocker}"
            self.log.event(step, "cuda_graph", f"cuda graph: step {step}: {message}")
        self.use_graph = blocker is None


def _global_counts(counts: list[int], dist: D.DistInfo) -> list[int]:
    """Per-rank host counts summed over ranks (no device round trip in a single process)."""
    if not dist.active:
        return [int(c) for c in counts]
    total = D.all_reduce_sum(torch.tensor(counts, dtype=torch.float64, device=dist.device), dist)
    return [int(c) for c in total.tolist()]


# ----------------------------------------------------------------------------------------------
# pieces shared by the stages


def batch_geometry(cfg: RunConfig, world: int) -> tuple[int, int]:
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


def check_memory(model: nn.Module, dist: D.DistInfo, sharded: bool) -> None:
    """Fail early if FP32 weights, gradients and Adam moments (16 bytes a parameter) leave no room."""
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
    return LiveGap(baseline)

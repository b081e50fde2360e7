"""Training-loop configuration: steps, batch, schedule, optimizer, evaluation, checkpoints, logs.

Steps are counted from 1: step k is the k-th optimizer update and ``checkpoints/step_<k>`` holds the
state after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


@dataclass
class TrainConfig:
    steps: int = 200
    """Optimizer steps."""
    seed: int = 0
    """Seed of the model init, data order and stochastic rounding."""
    init_seed: int | None = None
    """Seed of the initial weights alone (None: ``seed``): the same data and order from another start,
    how far two runs drift apart by chance (``compare-baseline --noise``)."""
    batch_size: int = 8
    """Sequences per optimizer step (global, across ranks and accumulation)."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward on one rank; None = batch_size / world size. Gradients are
    accumulated over batch_size / (micro_batch_size * world size) micro batches."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N (under torchrun, auto picks cuda:LOCAL_RANK)."""
    compile: bool = False
    """torch.compile the model."""
    cuda_graph: bool | str = "auto"
    """Replay each micro-batch's forward + backward as a CUDA graph (trainer/graphed_step.py), so the
    host's kernel launches do not set a small model's step time; one GPU, any recipe. auto: where it
    applies (no train.compile), saying why not on a GPU; true: also with train.compile; false: eager."""
    parallel: str = "ddp"
    """Several GPUs (torchrun): ddp (a replica per GPU) or fsdp (FSDP2: weights, gradients and Adam
    states sharded across the GPUs, for models whose replica does not fit one)."""
    log_every: int = 10
    """Steps between console/metrics log lines."""
    checkpoint_every: int = 100
    """Steps between checkpoints (0 = only at the end and on interrupt)."""
    warmup_steps: int | float = 0.05
    """Linear warmup: steps (int) or fraction of the run (float < 1)."""
    decay_fraction: float = 0.2
    """Final fraction of the run over which the LR decays (WSD)."""
    decay_shape: str = "linear"
    """linear | cosine | 1-sqrt."""
    min_lr_ratio: float = 0.01
    """LR at the end of the decay, as a fraction of optim.lr."""
    stop_after: int | None = None
    """End this invocation after this step with a checkpoint, as an interrupt would (e.g. to fit a job's
    time limit); ``--resume`` then goes on to train.steps with the same schedule."""
    deterministic: bool = False
    """Bit-reproducible GPU runs (same config, seed and data -> same losses and weights), for A/B
    comparisons at the 1% level (trainer/determinism.py); slower, process-wide once on."""

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError("train.steps must be >= 1")
        if self.batch_size < 1:
            raise ValueError("train.batch_size must be >= 1")
        if self.micro_batch_size is not None and (
            self.micro_batch_size < 1 or self.batch_size % self.micro_batch_size
        ):
            raise ValueError(
                f"train.micro_batch_size={self.micro_batch_size} must be >= 1 and divide "
                f"train.batch_size={self.batch_size}"
            )
        if isinstance(self.cuda_graph, str) and self.cuda_graph != "auto":
            raise ValueError(f"train.cuda_graph must be auto, true or false, not '{self.cuda_graph}'")
        if self.parallel not in ("ddp", "fsdp"):
            raise ValueError(f"train.parallel must be ddp or fsdp, not '{self.parallel}'")
        if self.log_every < 1:
            raise ValueError("train.log_every must be >= 1")
        if self.checkpoint_every < 0:
            raise ValueError("train.checkpoint_every must be >= 0 (0 = only at the end)")
        if isinstance(self.warmup_steps, float) and not 0.0 <= self.warmup_steps < 1.0:
            raise ValueError("train.warmup_steps must be a step count (int) or a fraction in [0, 1)")
        if isinstance(self.warmup_steps, int) and self.warmup_steps < 0:
            raise ValueError("train.warmup_steps must be >= 0")
        if self.decay_shape not in DECAY_SHAPES:
            raise ValueError("train.decay_shape must be linear, cosine or 1-sqrt")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError("train.decay_fraction must be in [0, 1]")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("train.min_lr_ratio must be in [0, 1]")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError("train.stop_after must be >= 1 or null")


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate."""
    beta1: float = 0.9
    """Adam beta1 (first-moment decay)."""
    beta2: float = 0.95
    """Adam beta2 (second-moment decay)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, on matrices only (not norms, biases, A_log, D, dt_bias)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""

    def __post_init__(self):
        # NOTE: every test is written so that NaN fails it ("nan <= 0" is False, "not nan > 0" True)
        if not 0.0 < self.lr < math.inf:
            raise ValueError(f"optim.lr={self.lr} must be a finite number > 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name} must be in [0, 1)")
        if not (0.0 <= self.weight_decay < math.inf and 0.0 <= self.grad_clip < math.inf):
            raise ValueError("optim.weight_decay and optim.grad_clip must be finite numbers >= 0")
        if not 0.0 < self.eps < math.inf:
            raise ValueError(f"optim.eps={self.eps} must be a finite number > 0")


@dataclass
class EvalConfig:
    every: int = 50
    """Steps between validation evaluations (0 = only at the end)."""
    batches: int = 4
    """Validation batches per evaluation."""
    in_training_precision: bool = True
    """Also evaluate in the training precision (always in BF16, as the paper does)."""
    at_start: bool = False
    """Also evaluate once before the first step of a fresh run (logged at step 0): the start of the
    curve, what an RL run's held-out accuracy is read against."""

    def __post_init__(self):
        if self.every < 0 or self.batches < 1:
            raise ValueError("eval.every must be >= 0 and eval.batches >= 1")


@dataclass
class CheckpointConfig:
    keep_last: int = 3
    """Keep the newest K checkpoints."""

    def __post_init__(self):
        if self.keep_last < 1:
            raise ValueError("checkpoint.keep_last must be >= 1")


@dataclass
class MonitorConfig:
    enabled: bool = True
    """Watch loss and grad norm for spikes and non-finite values."""
    window: int = 50
    """Steps of history for the running statistics."""
    warmup: int = 10
    """Steps before the spike test is armed."""
    loss_zscore: float = 6.0
    """Robust z-score (median / MAD) above which a loss is a spike."""
    grad_zscore: float = 6.0
    """Robust z-score above which a grad norm is a spike."""
    min_rel_spread: float = 0.05
    """Floor of the spread in the z-score, as a fraction of the median, so that a very flat history
    does not turn ordinary noise into a spike."""
    grad_min_ratio: float = 3.0
    """A grad norm below this multiple of the history's median is never a spike, whatever its z-score:
    real batches move the norm that much, and gradient clipping already bounds such updates."""
    max_triggers: int = 3
    """Triggers within `window` steps before the run falls back to BF16."""
    fallback_steps: int = 0
    """Steps to stay in BF16 after a fallback (0 = for good)."""

    def __post_init__(self):
        if self.window < 2 or self.warmup < 1 or self.max_triggers < 1 or self.fallback_steps < 0:
            raise ValueError(
                "monitor.window must be >= 2, monitor.warmup >= 1, monitor.max_triggers >= 1 and "
                "monitor.fallback_steps >= 0"
            )
        if self.warmup > self.window:
            raise ValueError("monitor.warmup must be <= monitor.window")
        finite = all(math.isfinite(v) for v in (self.loss_zscore, self.grad_zscore, self.min_rel_spread))
        if not (self.loss_zscore > 0 and self.grad_zscore > 0 and self.min_rel_spread >= 0 and finite):
            raise ValueError(
                "monitor.loss_zscore and grad_zscore must be finite numbers > 0, min_rel_spread >= 0"
            )
        if not 1 <= self.grad_min_ratio < math.inf:
            raise ValueError("monitor.grad_min_ratio must be >= 1 (a multiple of the median grad norm)")


@dataclass
class LogConfig:
    wandb: bool = False
    """Log to wandb (offline unless WANDB_API_KEY is set); the run name is the config's name."""
    wandb_project: str = "fp4train"
    """wandb project."""
    progress: bool = True
    """Show a progress bar (off when not a terminal)."""
    peak_flops: float | None = None
    """Peak dense BF16 FLOP/s of one device for MFU; None = from the device name (no MFU on CPU)."""
    profile_steps: list[int] | None = None
    """[first, last]: profile these steps (inclusive, evaluations within them too) into the run's
    ``profile/``: ``trace.json`` (Perfetto, chrome://tracing) and ``kernels.md`` (device time per step
    by kernel group, the top kernels and ops). null: no profiling."""

    def __post_init__(self):
        if self.peak_flops is not None and not 0 < self.peak_flops < math.inf:
            raise ValueError(f"log.peak_flops={self.peak_flops} must be a finite number > 0 or null")
        steps = self.profile_steps
        ok = steps is None or (
            isinstance(steps, (list, tuple))
            and len(steps) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
            and 1 <= steps[0] <= steps[1]
        )
        if not ok:
            raise ValueError(
                f"log.profile_steps={steps} must be [first, last] steps with 1 <= first <= last, or null"
            )

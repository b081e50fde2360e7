"""Training-loop configuration: steps, batch, schedule, optimizer, evaluation, checkpoints, logs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    steps: int = 200
    """Optimizer steps."""
    seed: int = 0
    """Seed of the model init, data order and stochastic rounding."""
    batch_size: int = 8
    """Sequences per optimizer step (global, across ranks and accumulation)."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward on one rank; None = batch_size / world size."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    compile: bool = False
    """torch.compile the model."""
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

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError("train.steps must be >= 1")
        if self.batch_size < 1:
            raise ValueError("train.batch_size must be >= 1")
        if self.decay_shape not in ("linear", "cosine", "1-sqrt"):
            raise ValueError("train.decay_shape must be linear, cosine or 1-sqrt")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError("train.decay_fraction must be in [0, 1]")


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay, on matrices only (not norms, biases, A_log, D, dt_bias)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""


@dataclass
class EvalConfig:
    every: int = 50
    """Steps between validation evaluations (0 = only at the end)."""
    batches: int = 4
    """Validation batches per evaluation."""
    in_training_precision: bool = True
    """Also evaluate in the training precision (always in BF16, as the paper does)."""


@dataclass
class CheckpointConfig:
    keep_last: int = 3
    """Keep the newest K checkpoints."""


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
    max_triggers: int = 3
    """Triggers within `window` steps before the run falls back to BF16."""
    fallback_steps: int = 0
    """Steps to stay in BF16 after a fallback (0 = for good)."""


@dataclass
class LogConfig:
    wandb: bool = False
    """Log to wandb (offline unless WANDB_API_KEY is set)."""
    wandb_project: str = "fp4train"
    progress: bool = True
    """Show a progress bar (off when not a terminal)."""

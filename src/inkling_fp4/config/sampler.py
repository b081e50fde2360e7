"""The sampler's configuration: the ``sampler:`` section of a run config (``sampler.top_p=0.9``)."""

from __future__ import annotations

from dataclasses import dataclass, field

PRECISIONS = ("train", "bf16", "fp8", "nvfp4")


@dataclass
class SamplerConfig:
    precision: str = "train"
    """The forward pass sampling runs: 'train' (the run's own precision as its checkpoint stands: what
    the trainer computes), or 'bf16' | 'fp8' | 'nvfp4' (that recipe, for comparisons)."""
    temperature: float = 1.0
    """Logits are divided by it before the filters; 0 is greedy (the most likely token)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: no top-k filter)."""
    top_p: float = 1.0
    """Nucleus: keep the fewest most likely tokens whose probabilities sum to at least top_p (1: all)."""
    min_p: float = 0.0
    """Keep the tokens at least min_p times as likely as the most likely one (0: no min-p filter)."""
    max_new_tokens: int = 128
    """Most tokens generated per prompt (fewer where the context ends first, see max_context)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, matched on the decoded text across token boundaries; the text ends before the match."""
    seed: int = 0
    """Seed of the sampling generator: the same seed, prompts and settings give the same completions."""
    batch_size: int = 0
    """Sequences decoded together (the rows of the decode cache); 0: auto, 64 on the CPU and on CUDA
    up to 256 as free memory allows."""
    continuous_batching: bool = True
    """A row whose sequence ends takes the next prompt at once (``infer/continuous.py``); false
    decodes a batch at a time, each until its longest member ends. Completions are the same."""
    max_context: int | None = None
    """Prompt plus completion in tokens; None: the run's data.seq_len, the longest it trained on. A
    longer prompt is refused, and a completion ends (finish reason 'length') where the context does."""
    check_every: int = 8
    """Decode steps between host reads of the finished flags and the stop strings (results do not
    depend on it: finished sequences keep decoding until the check and are cut where they ended)."""
    device: str = "auto"
    """auto (CUDA when available) | cpu | cuda | cuda:N."""
    cuda_graph: bool = True
    """On CUDA, replay the decode step as a CUDA graph per batch bucket, kept across generate calls
    (``infer/decode_graphs.py``), so a small model's step does not wait on kernel launches. Results
    are eager decoding's; a model that cannot be captured decodes eagerly, saying why."""

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"sampler.precision '{self.precision}' is not one of {', '.join(PRECISIONS)}")
        # NOTE: written as `not (x >= 0)` so NaN fails too
        if not self.temperature >= 0:
            raise ValueError(f"sampler.temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampler.top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampler.top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"sampler.min_p must lie in [0, 1), got {self.min_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampler.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 0:
            raise ValueError(f"sampler.batch_size must be >= 1, or 0 for auto, got {self.batch_size}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"sampler.max_context must be >= 2 or null, got {self.max_context}")
        if self.check_every < 1:
            raise ValueError(f"sampler.check_every must be >= 1, got {self.check_every}")
        if any(not s for s in self.stop):
            raise ValueError("sampler.stop: an empty stop string would stop at once; drop it")
        if self.device != "auto" and not (self.device in ("cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"sampler.device must be auto, cpu, cuda or cuda:N, not '{self.device}'")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

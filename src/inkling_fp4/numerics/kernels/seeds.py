"""Stochastic-rounding seeds for the Triton quantizers: from the host, or from a device word when the
launches are replayed by a CUDA graph.

Eagerly the seed is derived from the caller's CUDA generator without touching the device:
``seed = 2^32 + mix64(initial_seed · φ + offset) mod (2^62 - 2^32)``, ``offset`` the generator's Philox
offset (advanced by 4 per draw), so a resumed run draws the same seeds.

A CUDA graph freezes kernel arguments, so a captured quantizer would reuse one seed every replay, a
bias that no longer averages out. Inside :func:`capturing` a draw is a :class:`DeviceSeed`: the kernel
reads ``base = initial_seed · φ + offset_0`` from a device word, adds the draw's offset and applies the
same mix (``common.replay_seed``). :meth:`GraphSeeds.before_replay` writes ``base`` and advances the
generator, so a replayed step draws the seeds of the same step run eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

PHI = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
"""splitmix64's finaliser multipliers (infer/sequence_noise.py uses the same hash on tensors)."""
SEED_FLOOR = 2**32
"""Seeds lie in [2^32, 2^62): the kernel argument keeps one type (int64), so one compiled kernel."""
SEED_SPAN = 2**62 - 2**32
OFFSET_STEP = 4
"""Philox offsets a draw advances a CUDA generator by (its unit)."""


def mix64(value: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit words that spreads every input bit."""
    value = (value ^ (value >> 30)) * MIX1 % 2**64
    value = (value ^ (value >> 27)) * MIX2 % 2**64
    return value ^ (value >> 31)


def _is_cuda_generator(generator: torch.Generator | None) -> bool:
    """A generator whose (seed, offset) state lives on the host: a CUDA one."""
    return generator is not None and generator.device.type == "cuda" and hasattr(generator, "get_offset")


def _base(generator: torch.Generator, offset: int) -> int:
    """The 64-bit word a draw at Philox ``offset`` mixes: initial_seed · φ + offset, mod 2^64."""
    return (generator.initial_seed() * PHI + offset) % 2**64


def seed_at(generator: torch.Generator, offset: int) -> int:
    """The seed of the draw at Philox ``offset`` of a CUDA ``generator``."""
    return SEED_FLOOR + mix64(_base(generator, offset)) % SEED_SPAN


@dataclass(frozen=True)
class DeviceSeed:
    """A draw inside a CUDA graph capture: the kernel reads ``base`` and adds ``delta - 2^32``."""

    base: torch.Tensor  # int64 [1] on the device: (initial_seed · φ + offset_0) mod 2^64, as int64 bits
    delta: int  # 2^32 + OFFSET_STEP · (draws before this one in the graph): an int64 like a seed


class GraphSeeds:
    """The stochastic-rounding draws of one captured CUDA graph and the device word their kernels read."""

    def __init__(self, device: torch.device):
        self.base = torch.zeros(1, dtype=torch.int64, device=device)
        self.generator: torch.Generator | None = None
        self.used = 0  # offsets one replay consumes

    def draw(self, generator: torch.Generator | None) -> DeviceSeed:
        """The next draw of the capture. NOTE a capture may not read or move a CUDA generator's offset
        (torch forbids it), so draws are counted here and the generator moves in ``before_replay``."""
        if not _is_cuda_generator(generator):
            raise RuntimeError(
                "a stochastic-rounding draw inside a CUDA graph capture needs the layer's CUDA generator "
                "(its seeds are replayed from the generator's offset); got "
                + ("no generator" if generator is None else f"a {generator.device} generator")
            )
        if self.generator is None:
            self.generator = generator
        elif generator is not self.generator:
            raise RuntimeError("stochastic-rounding draws from two generators inside one CUDA graph capture")
        seed = DeviceSeed(self.base, SEED_FLOOR + self.used)
        self.used += OFFSET_STEP
        return seed

    def before_replay(self) -> None:
        """Point the graph's kernels at the generator's current offset and advance it past their draws."""
        if self.generator is None:
            return
        offset = self.generator.get_offset()
        base = _base(self.generator, offset)
        self.base.fill_(base - 2**64 if base >= 2**63 else base)  # the same 64 bits as an int64
        self.generator.set_offset(offset + self.used)


_capture: list[GraphSeeds] = []


@contextlib.contextmanager
def capturing(seeds: GraphSeeds) -> Iterator[GraphSeeds]:
    """Within this context (a CUDA graph capture) every draw is a :class:`DeviceSeed` of ``seeds``."""
    _capture.append(seeds)
    try:
        yield seeds
    finally:
        _capture.pop()


def draw_seed(generator: torch.Generator | None) -> int | DeviceSeed:
    """The next seed of ``generator`` (torch's default when None): an int in [2^32, 2^62), or a
    :class:`DeviceSeed` inside :func:`capturing`."""
    if _capture:
        return _capture[-1].draw(generator)
    if _is_cuda_generator(generator):
        offset = generator.get_offset()
        generator.set_offset(offset + OFFSET_STEP)
        return seed_at(generator, offset)
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(SEED_FLOOR, 2**62, (1,), generator=generator, device=device, dtype=torch.int64))


def launch_args(seed: int | DeviceSeed | None, dummy: torch.Tensor) -> tuple[int, torch.Tensor, bool]:
    """(seed argument, seed pointer, SEED_PTR) of a quantizer launch; ``dummy`` fills the unused pointer."""
    if isinstance(seed, DeviceSeed):
        return seed.delta, seed.base, True
    return (0 if seed is None else seed), dummy, False

"""The precision policy: which layers run the recipe, which stay in BF16, and the mid-run switch.

The first and last few blocks (by ``QuantLinear.layer_idx``) stay in BF16 (paper §4.1: the layers
next to the embedding and head are the most sensitive). Embeddings, the LM head, norms, attention
and the SSD scan never go through :class:`QuantLinear` and are never quantized.

The policy only sets ``QuantLinear.recipe`` (and the rounding RNG), never parameters or optimizer
state, so the switch to BF16 near the LR decay (paper §5, appendix D) needs no rebuild. The rounding
generators are checkpointed, so a resumed run continues the same random stream.
"""

from __future__ import annotations

import base64
import weakref

import torch
from torch import nn

from inkling_fp4.errors import ConfigError
from inkling_fp4.precision.amax_history import AmaxHistory
from inkling_fp4.precision.backends import describe_backend, resolve_backend
from inkling_fp4.precision.config import PrecisionConfig
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.precision.recipes import Recipe, build_recipe, default_bf16_layers

SCOPES = ("all", "forward")


class RoundingRNG:
    """One ``torch.Generator`` per device for stochastic rounding, created on first use."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def for_device(self, device: torch.device) -> torch.Generator:
        key = _device_key(device)
        g = self._generators.get(key)
        if g is None:
            g = torch.Generator(device=key)
            g.manual_seed(self.seed)
            self._generators[key] = g
        return g

    def reseed(self, seed: int) -> None:
        self.seed = seed
        for g in self._generators.values():
            g.manual_seed(seed)

    def state_dict(self) -> dict:
        states = {
            k: base64.b64encode(g.get_state().numpy().tobytes()).decode() for k, g in self._generators.items()
        }
        return {"seed": self.seed, "generators": states}

    def load_state_dict(self, d: dict) -> None:
        self.seed = int(d["seed"])
        self._generators = {}
        for key, encoded in d.get("generators", {}).items():
            if key.startswith("cuda") and not torch.cuda.is_available():
                continue  # resumed on a machine without that device: it will be reseeded on first use
            g = torch.Generator(device=key)
            raw = bytearray(base64.b64decode(encoded))
            g.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
            self._generators[key] = g


def _device_key(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


class PrecisionPolicy:
    """Applies a :class:`PrecisionConfig` to a model's :class:`QuantLinear` layers by block index."""

    def __init__(self, cfg: PrecisionConfig, n_layers: int, seed: int = 0):
        self.cfg = cfg
        self.n_layers = n_layers
        self.recipe: Recipe | None = build_recipe(cfg)
        first, last = default_bf16_layers(cfg.recipe, n_layers)
        self.bf16_first = first if cfg.bf16_first_layers is None else cfg.bf16_first_layers
        self.bf16_last = last if cfg.bf16_last_layers is None else cfg.bf16_last_layers
        self.switched_scope: str | None = None
        """None while the recipe runs; 'all' or 'forward' after :meth:`switch_to_bf16`."""
        self.backend: str | None = None
        """Resolved at :meth:`apply` from the model's device (emulated | native-fp8 | te)."""
        self.rng = RoundingRNG(seed)
        self.amax_history: AmaxHistory | None = None
        """Delayed FP8 scaling's amaxes (``precision.fp8_scaling=delayed``), made at :meth:`apply`."""
        self._models: list[weakref.ref] = []
        self._device = torch.device("cpu")
        self.version = 0
        """Which weights the held fprop operands were quantized from; bumped by :meth:`weights_updated`."""

    # -- which layer gets what ---------------------------------------------------------------

    def is_quantized_layer(self, layer_idx: int) -> bool:
        """Whether block ``layer_idx`` runs the recipe (before any switch)."""
        if self.recipe is None:
            return False
        return self.bf16_first <= layer_idx < self.n_layers - self.bf16_last

    def layer_recipe(self, layer_idx: int) -> Recipe | None:
        """The recipe block ``layer_idx`` runs now (None = BF16)."""
        if not 0 <= layer_idx < self.n_layers:
            raise ValueError(f"layer_idx {layer_idx} is outside the model's {self.n_layers} layers")
        if not self.is_quantized_layer(layer_idx) or self.switched_scope == "all":
            return None
        return self.recipe.bf16_forward() if self.switched_scope == "forward" else self.recipe

    # -- acting on a model -------------------------------------------------------------------

    def apply(self, model: nn.Module) -> nn.Module:
        """Set ``.recipe`` on every QuantLinear of ``model`` by its ``layer_idx``; returns the model.

        Call it once the model is on its device (``auto`` picks the backend for it); idempotent.
        """
        param = next(model.parameters(), None)
        self._device = param.device if param is not None else torch.device("cpu")
        if self.recipe is not None:
            self.backend = resolve_backend(self.cfg.backend, self.recipe.name, self._device)
            if self.recipe.backend != self.backend:
                self.recipe = _with_backend(self.recipe, self.backend)
            if self.backend == "te":
                from inkling_fp4.precision.te_linear import te_recipe  # transformer_engine

                te_recipe(self.recipe)  # fail now, not at the first forward, if TE cannot run it
        layers = list(_quant_linears(model))
        delayed = self.recipe is not None and self.cfg.fp8_scaling == "delayed"
        if delayed and self.amax_history is None:
            names = [m.full_name for m in layers]
            self.amax_history = AmaxHistory(len(layers), self.cfg.amax_history, self._device, names)
        if self.amax_history is not None:
            if self.amax_history.layers != len(layers):
                raise ValueError(
                    f"this policy's amax history has {self.amax_history.layers} layers; the model has "
                    f"{len(layers)} linear layers (one policy per model structure)"
                )
            self.amax_history.state = self.amax_history.state.to(self._device)
        for i, m in enumerate(layers):
            m.recipe = self.layer_recipe(m.layer_idx)
            m.rng = self.rng
            m.amax_history = self.amax_history if m.recipe is not None else None
            m.amax_index = i
        if not any(ref() is model for ref in self._models):
            self._models.append(weakref.ref(model))
        return model

    def switch_to_bf16(self, model: nn.Module | None = None, scope: str = "all") -> None:
        """Leave the recipe mid-run: all GEMMs to BF16 (``all``, final) or only the forward passes."""
        if scope not in SCOPES:
            raise ValueError(f"switch scope must be one of {', '.join(SCOPES)}, not '{scope}'")
        if self.switched_scope != "all":
            self.switched_scope = scope
        if model is not None:
            self.apply(model)
        else:
            self._reapply()

    def end_step(self, skipped: bool, reduce_max=None) -> None:
        """After each optimizer step (or skipped step): roll delayed scaling's amaxes (see
        :class:`AmaxHistory`); ``reduce_max`` max-reduces a tensor in place across ranks."""
        if self.amax_history is not None:
            self.amax_history.end_step(skipped, reduce_max)

    def weights_updated(self) -> int:
        """Count a new policy version (the weights changed: an optimizer step, a checkpoint load);
        the next :meth:`freeze_weights` quantizes every layer's weight again. Returns the version."""
        self.version += 1
        return self.version

    def freeze_weights(self, model: nn.Module) -> int:
        """Hold every layer's fprop weight operand, quantized once for this version, for no-grad forwards
        (the sampler); returns how many layers quantized now. Training is unaffected."""
        return sum(m.freeze_weights(self.version) for m in _quant_linears(model))

    def thaw_weights(self, model: nn.Module) -> None:
        for m in _quant_linears(model):
            m.thaw_weights()

    @property
    def switched(self) -> bool:
        return self.switched_scope is not None

    def set_generator_seed(self, seed: int) -> None:
        """Reseed the stochastic-rounding generators (e.g. run seed + rank)."""
        self.rng.reseed(seed)

    def describe(self, model: nn.Module | None = None) -> str:
        """One line for the run log, e.g. 'nvfp4: 24/32 linear layers, backend emulated (first 1, ...)'."""
        layers = list(_quant_linears(model)) if model is not None else []
        total = len(layers)
        n_quant = sum(1 for m in layers if m.recipe is not None)
        if self.recipe is None:
            return f"bf16: all {total} linear layers in BF16"
        name = self.recipe.name + _ablations(self.cfg)
        backend = describe_backend(self.backend or self.recipe.backend, self.recipe.name, self._device)
        where = f"first {self.bf16_first}, last {self.bf16_last} of {self.n_layers} layers in BF16"
        if self.switched_scope == "all":
            return f"{name} switched to BF16 (all GEMMs): 0/{total} linear layers quantized"
        if self.switched_scope == "forward":
            return (
                f"{name} switched to BF16 forward passes: backward GEMMs of {n_quant}/{total} linear "
                f"layers quantized, backend {backend} ({where})"
            )
        return f"{name}: {n_quant}/{total} linear layers, backend {backend} ({where})"

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """JSON-serialisable: recipe name, switch state and the stochastic-rounding RNG states."""
        d = {
            "recipe": self.cfg.recipe,
            "switched_scope": self.switched_scope,
            "bf16_first": self.bf16_first,
            "bf16_last": self.bf16_last,
            "rng": self.rng.state_dict(),
        }
        if self.amax_history is not None:
            d["amax_history"] = self.amax_history.state_dict()
        return d

    def load_state_dict(self, d: dict) -> None:
        """Restore a checkpoint's policy state and re-apply it to the models this policy was applied to."""
        if d.get("recipe") != self.cfg.recipe:
            raise ConfigError(
                f"the checkpoint was trained with precision.recipe={d.get('recipe')}, this run asks for "
                f"{self.cfg.recipe}; resume with the same recipe or start a new run"
            )
        self.switched_scope = d.get("switched_scope")
        self.rng.load_state_dict(d["rng"])
        if self.amax_history is not None and "amax_history" in d:  # else: current scales until a step
            self.amax_history.load_state_dict(d["amax_history"])
        self._reapply()

    def _reapply(self) -> None:
        self._models = [ref for ref in self._models if ref() is not None]
        for ref in self._models:
            self.apply(ref())


def _quant_linears(model: nn.Module):
    return (m for m in model.modules() if isinstance(m, QuantLinear))


def _with_backend(recipe: Recipe, backend: str) -> Recipe:
    import dataclasses

    return dataclasses.replace(recipe, backend=backend)


def _ablations(cfg: PrecisionConfig) -> str:
    """' (no RHT, no SR)'-style note for the switches that are off, where the recipe has them."""
    if cfg.recipe == "fp8-tensorwise" and cfg.fp8_scaling == "delayed":
        return f" (delayed scaling, {cfg.amax_history}-step amax history)"
    if cfg.recipe not in ("nvfp4", "mxfp4"):
        return ""
    notes = []
    if not cfg.rht:
        notes.append("no RHT")
    elif cfg.rht_signs == "random":
        notes.append(f"random RHT signs, seed {cfg.rht_seed}")
    if not cfg.stochastic_rounding:
        notes.append("no SR")
    if cfg.recipe == "nvfp4" and not cfg.weight_2d:
        notes.append("1x16 weights")
    return f" ({', '.join(notes)})" if notes else ""

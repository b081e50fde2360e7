"""QuantLinear: the one linear layer of the model, whose three GEMMs follow a precision recipe.

Every matrix multiply in the model's blocks goes through this class, so a recipe applies without
touching model code. ``recipe`` None means BF16. The master weight is FP32; the layer casts its
operands itself (no autocast on CPU) and returns BF16. The GEMMs are in :mod:`.linear_gemms`;
partial blocks are zero-padded inside them (zeros change no scale or product).

Legend: M tokens (leading dims of x flattened), K = in_features, N = out_features.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from inkling_fp4.precision import fused_kernels, gemm
from inkling_fp4.precision.held_operand import refresh_in_place
from inkling_fp4.precision.linear_gemms import DelayedWords, LinearGEMMs, _QuantLinearFn, quantized_forward
from inkling_fp4.precision.recipes import Recipe


class FrozenWeight(NamedTuple):
    """W's fprop operand quantized once (:meth:`QuantLinear.freeze_weights`), with what it was made from."""

    operand: gemm.Operand
    version: int
    """The policy version it was quantized for (:attr:`PrecisionPolicy.version`)."""
    weight_version: int
    """W's ``Tensor._version`` when quantized: an in-place update (optimizer step, checkpoint load)
    bumps it, so a stale operand is never used."""
    recipe: Recipe
    device: torch.device


class QuantLinear(nn.Module):
    """``y = x @ W.T`` with W: [out_features, in_features] (FP32 master), no bias (Nemotron-H has none)."""

    def __init__(self, in_features: int, out_features: int, *, layer_idx: int, name: str = ""):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.layer_idx = layer_idx
        self.name = name
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.recipe: Recipe | None = None
        self.rng = None
        """Stochastic-rounding generators (``.for_device(device)``) from the policy; None: torch's default."""
        self.amax_history = None
        """The delayed-scaling ``AmaxHistory`` this layer records into (row ``amax_index``), or None."""
        self.amax_index = 0
        self.frozen: FrozenWeight | None = None
        """W's fprop operand held quantized for forwards without autograd (:meth:`freeze_weights`)."""
        self._producer_rows: tuple | None = None
        """(x, x's quantized operand) from x's producer, for the next no-grad forward (:meth:`hand_over`)."""
        self._producer_amaxes: tuple | None = None
        """(x, x's two NVFP4 tensor amaxes) from x's producer, for the next training forward
        (:meth:`hand_over_amaxes`)."""
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(in_features))

    def forward(
        self, x: torch.Tensor, pair_x: tuple | None = None, dy_fp8=None, dy_amaxes: list | None = None
    ) -> torch.Tensor:
        """x [..., K] -> [..., N]. ``pair_x``: x's fprop and wgrad operands already quantized by x's
        producer (``model/fused_fp8/norm.py``; x is then not read, only its gradient flows). ``dy_fp8``: the
        FP8 slab the output's consumer writes the output's gradient into (``model/fused_fp8/residual.py``).
        Both only for training forwards of delayed FP8 pairs (:meth:`delayed_fp8_pairs`). ``dy_amaxes``: a
        list that the output's one consumer fills in its backward with the output gradient's two NVFP4
        tensor amaxes (:meth:`producer_amax_signs` with ``grad``), which the backward then takes."""
        recipe = self.recipe
        handed = pair_x is not None or dy_fp8 is not None
        if handed and not (torch.is_grad_enabled() and self.delayed_fp8_pairs()):
            raise ValueError(
                f"{self.full_name}: pair_x and dy_fp8 are for training forwards of delayed FP8 pairs only"
            )
        if recipe is None or not recipe.quantizes_anything:
            return _bf16_linear(x, self.weight)
        if recipe.backend == "te" and recipe.fprop is not None:
            from inkling_fp4.precision.te_linear import te_linear  # the te backend only (transformer_engine)

            return te_linear(self, x)
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)  # x2d: [M, K]
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            given, self._producer_amaxes = self._producer_amaxes, None
            amaxes = given[1] if given is not None and given[0] is x else None
            gemms = self.gemms(x2d.shape[0], x2d.device)
            y = _QuantLinearFn.apply(x2d, self.weight, gemms, pair_x, dy_fp8, amaxes, dy_amaxes)
        else:
            wq = self.frozen_weight()  # W quantized once per policy version, or None
            given, self._producer_rows = self._producer_rows, None
            rows = given[1] if given is not None and given[0] is x else None
            y = quantized_forward(
                x2d, self.weight, recipe, name=self.full_name, out_dtype=torch.bfloat16, wq=wq, rows=rows
            )
        return y.reshape(*lead, self.out_features)

    def hand_over(self, x: torch.Tensor, rows) -> None:
        """x's fprop operand as x's producer quantized it (:class:`decode_fprop.QuantizedRows`), taken by
        this layer's next forward if it is a no-grad forward of this very tensor."""
        self._producer_rows = (x, rows)

    def producer_amax_signs(self, x: torch.Tensor, grad: bool = False) -> int | None:
        """The RHT sign mask for x's producer to reduce x's two NVFP4 tensor amaxes with while it writes
        x (:meth:`hand_over_amaxes`), where this layer's next training forward of x would read x for
        them (``gemm.shared_nvfp4_amaxes``); with ``grad`` the same for the output's gradient dy, which
        the output's consumer writes (``dy_amaxes``). Else None. x: tokens a multiple of 16; the producer
        writes BF16."""
        r = self.recipe
        if not gemm.PRODUCER_NVFP4_AMAXES or r is None or r.backend == "te" or None in (r.fprop, r.wgrad):
            return None
        if not (torch.is_grad_enabled() and self.weight.requires_grad):  # no wgrad: no RHT amax
            return None
        if grad and not (x.requires_grad and r.dgrad is not None):  # dy's two operands need a dgrad
            return None
        specs = (r.dgrad.a, r.wgrad.a) if grad else (r.fprop.a, r.wgrad.b)
        if not gemm.nvfp4_amax_pair_specs(*specs) or x.numel() == 0 or (x.numel() // x.shape[-1]) % 16:
            return None
        fused = fused_kernels.fused_for(x)
        return None if fused is None else fused.rht_sign_bits(r.rht_signs)

    def hand_over_amaxes(self, x: torch.Tensor, words: torch.Tensor) -> None:
        """x's NVFP4 tensor amaxes ``[max |rht(xᵀ)|, max |x|]`` as x's producer reduced them, taken by this
        layer's next training forward if it is of this very tensor (:meth:`producer_amax_signs`)."""
        self._producer_amaxes = (x, words)

    def freeze_weights(self, version: int) -> bool:
        """Quantize W's fprop operand once for policy ``version`` and hold it for no-grad forwards;
        True if it quantized now, False if already held (or the recipe has no quantized fprop).

        It is the operand the no-grad fprop would make, so outputs are bit for bit the same; it is used
        only while recipe, device and W are unchanged (:meth:`frozen_weight`), never in training. A new
        operand is copied into the held tensors (``held_operand``), so a captured decode graph sees it."""
        recipe = self.recipe
        if recipe is None or recipe.fprop is None or recipe.backend == "te":
            self.frozen = None
            return False
        held = self.frozen
        if held is not None and held.version == version and self.frozen_weight() is not None:
            return False
        weight = self.weight
        with torch.no_grad(), torch.autocast(device_type=weight.device.type, enabled=False):
            wq = gemm.quantize(weight, recipe.fprop.b, codes=False, values=True, name=f"{self.full_name} W")
            if wq.values is None and wq.q is not None and wq.spec.format in ("nvfp4", "mxfp4"):
                # the exact BF16 block values an emulated GEMM multiplies, decoded once here
                decode = wq.q.decode_scale if wq.spec.format == "nvfp4" else None
                wq = dataclasses.replace(wq, values=wq.q.block_values(torch.bfloat16), decode_scale=decode)
        if held is not None and refresh_in_place(held.operand, wq):
            wq = held.operand  # the same addresses, the new values: a captured decode graph sees them
        self.frozen = FrozenWeight(wq, version, weight._version, recipe, weight.device)
        return True

    def thaw_weights(self) -> None:
        """Drop the held weight operand (forwards quantize W again, as training does)."""
        self.frozen = None

    def frozen_weight(self) -> gemm.Operand | None:
        """The held fprop weight operand while it still describes W under this layer's recipe, else None."""
        held = self.frozen
        if held is None:
            return None
        same_recipe = held.recipe is self.recipe or held.recipe == self.recipe
        fresh = held.weight_version == self.weight._version and held.device == self.weight.device
        return held.operand if same_recipe and fresh else None

    def delayed_fp8_pairs(self) -> bool:
        """Whether x and dy are each one delayed-scaled tensorwise FP8 pair and the history has a step:
        then x's or dy's producer may hand them over already quantized."""
        r = self.recipe
        if r is None or r.backend == "te" or None in (r.fprop, r.dgrad, r.wgrad):
            return False
        x_pair = r.fprop.a == r.wgrad.b and r.fprop.a.delayed
        dy_pair = r.dgrad.a == r.wgrad.a and r.dgrad.a.delayed
        history = self.amax_history
        return x_pair and dy_pair and history is not None and history.ready

    @property
    def full_name(self) -> str:
        """What error messages call this layer: ``layers.<index>.<name>``."""
        return f"layers.{self.layer_idx}.{self.name or 'linear'}"

    def gemms(self, tokens: int, device: torch.device) -> LinearGEMMs:
        """This layer's three GEMMs for ``tokens`` rows on ``device`` (recipe, generator, delayed scales)."""
        generator = self.rng.for_device(device) if self.rng is not None else None
        shape = (tokens, self.in_features, self.out_features)
        return LinearGEMMs(self.recipe, generator, self.full_name, self.delayed_words(), shape)

    def delayed_words(self) -> DelayedWords | None:
        """The delayed-scaling words (each scale amax None until the history has a step), or None:
        current scaling. No-grad forwards always use current scaling."""
        history = self.amax_history
        if history is None:
            return None
        rows = [history.row(self.amax_index, operand) for operand in range(3)]  # x, dy, W
        if not history.ready:
            rows = [(None, record) for _, record in rows]
        return DelayedWords(*(word for row in rows for word in row))

    def extra_repr(self) -> str:
        r = self.recipe.name if self.recipe is not None else "bf16"
        if self.recipe is not None and self.recipe.fprop is None:
            r += " (bf16 forward)"
        return f"{self.in_features}->{self.out_features}, layer={self.layer_idx}, precision={r}"


def _bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """BF16 operands, FP32 accumulation, BF16 output; on CUDA the weight gradient stays FP32.

    NOTE on CPU the BF16-rounded operands are widened to FP32 (a BF16 ``F.linear`` is far slower there):
    BF16 products are exact in FP32, so it is the same GEMM.
    """
    if x.device.type == "cuda":
        if torch.is_grad_enabled() and weight.requires_grad and gemm.mm_out_dtype_supported(x.device):
            return _BF16LinearFn.apply(x, weight)
        return F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16))
    x16 = x.to(torch.bfloat16).float()
    w16 = weight.to(torch.bfloat16).float()
    return F.linear(x16, w16).to(torch.bfloat16)  # y: [..., N]


class _BF16LinearFn(torch.autograd.Function):
    """``F.linear`` in BF16 whose weight gradient comes out of the GEMM in FP32.

    Why: autograd through ``weight.to(bf16)`` rounds dW to BF16 and casts it back in a separate pass;
    here the wgrad writes its FP32 accumulator as is (as Megatron's fused wgrad accumulation does).
    """

    @staticmethod
    def forward(ctx, x, weight):
        x16, w16 = x.to(torch.bfloat16), weight.to(torch.bfloat16)  # x16: [..., K], w16: [N, K]
        ctx.save_for_backward(x16, w16)
        ctx.x_dtype = x.dtype
        return F.linear(x16, w16)  # y: [..., N]

    @staticmethod
    def backward(ctx, dy):
        x16, w16 = ctx.saved_tensors
        dy2 = dy.reshape(-1, w16.shape[0]).to(torch.bfloat16)  # dy2: [M, N]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ w16).reshape(x16.shape).to(ctx.x_dtype)  # dx: [M, K]
        if ctx.needs_input_grad[1]:
            dw = gemm.mm_fp32_out(dy2.t(), x16.reshape(-1, x16.shape[-1]))  # dW: [N, K] FP32
        return dx, dw

"""QuantLinear: the one linear layer of the model, whose three GEMMs follow a precision recipe.

Every matrix multiply in the model's blocks goes through this class so that a recipe (and its
per-layer policy) applies without touching model code. ``recipe`` is set by the precision policy;
``None`` means BF16 (BF16 operands, FP32 accumulation). The master weight is FP32; the layer casts
its operands itself and does not rely on autocast (on CPU there is none), returning BF16.

Legend: M tokens (all leading dims of x flattened), K = in_features, N = out_features.

    fprop   y  [M, N] = Q(x) [M, K] · Q(W)ᵀ          Q(W): 16×16 tiles (NVFP4), shared with dgrad
    dgrad   dx [M, K] = Q_sr(dy) [M, N] · Q(W)        contraction over N, W's tiles transposed
    wgrad   dW [N, K] = Q_sr(RHT(dyᵀ)) · Q(RHT(xᵀ))ᵀ  both blocked along tokens M; RHT cancels

(see :mod:`inkling_fp4.precision.recipes` for the per-recipe table). What is saved for backward is
the *quantized* operands the backward GEMMs consume (packed codes + scales): the dgrad weight
operand and the wgrad activation operand ``Q(RHT(xᵀ))`` are produced in the forward pass, so an
NVFP4 layer keeps ~0.56 bytes per element of x and W alive instead of BF16's 2, emulated or not.

Forwards without autograd (sampling) may use W's fprop operand held quantized once per policy
version (:meth:`QuantLinear.freeze_weights`, driven by ``PrecisionPolicy.freeze_weights``) instead of
quantizing W in every call: the same values, bit for bit; training forwards always quantize W.

Dims that are not multiples of a recipe's block (16, 32, 128) are zero-padded inside the GEMMs and
the outputs sliced back; zeros change neither block scales nor products, so results are exactly
those of a quantizer that accepted partial blocks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from inkling_fp4.precision import gemm
from inkling_fp4.precision.recipes import TENSORWISE, OperandQuant, Recipe


class DelayedWords(NamedTuple):
    """A layer's delayed-scaling words, views of the policy's persistent amax state
    (``precision/amax_history.py``): per operand, the amax its scale comes from (None: current
    scaling, the history has no step yet) and the word its own amax is recorded into."""

    x_used: torch.Tensor | None
    x_record: torch.Tensor
    dy_used: torch.Tensor | None
    dy_record: torch.Tensor
    w_used: torch.Tensor | None
    w_record: torch.Tensor


class FrozenWeight(NamedTuple):
    """W's fprop operand quantized once (:meth:`QuantLinear.freeze_weights`), with what it was made from."""

    operand: gemm.Operand
    version: int
    """The policy version it was quantized for (:attr:`PrecisionPolicy.version`)."""
    weight_version: int
    """W's in-place version counter (``Tensor._version``) when quantized: an optimizer step or a
    checkpoint load changes W in place and bumps it, so a stale operand is never used."""
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
        """Stochastic-rounding generators (``.for_device(device)``), set by the policy.

        None: torch's default generator."""
        self.amax_history = None
        """The delayed-scaling :class:`~inkling_fp4.precision.amax_history.AmaxHistory` this layer
        records into (row ``amax_index``), set by the policy when the recipe scales x, dy and W that way."""
        self.amax_index = 0
        self.frozen: FrozenWeight | None = None
        """W's fprop operand held quantized for forwards without autograd (:meth:`freeze_weights`)."""
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(in_features))

    def forward(self, x: torch.Tensor, pair_x: tuple | None = None, dy_fp8=None) -> torch.Tensor:
        """x [..., K] -> [..., N]. ``pair_x``: x's fprop and wgrad operands, already quantized by x's
        producer under this layer's delayed scale (``model/norm_fp8.py``; x is then not read, only its
        gradient flows). ``dy_fp8``: the one-block FP8 gradient slab the output's consumer writes the
        output's gradient into (``model/residual_fp8.py``). Both only for a training forward of
        delayed FP8 pairs (:meth:`delayed_fp8_pairs`)."""
        recipe = self.recipe
        handed = pair_x is not None or dy_fp8 is not None
        if handed and not (torch.is_grad_enabled() and self.delayed_fp8_pairs()):
            raise ValueError(
                f"{self.full_name}: pair_x and dy_fp8 are for training forwards of delayed FP8 pairs only"
            )
        if recipe is None or not recipe.quantizes_anything:
            return _bf16_linear(x, self.weight)
        if recipe.backend == "te" and recipe.fprop is not None:
            from inkling_fp4.precision.te_linear import te_linear

            return te_linear(self, x)
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)  # x2d: [M, K]
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            y = _QuantLinearFn.apply(x2d, self.weight, self.gemms(x2d.shape[0], x2d.device), pair_x, dy_fp8)
        else:
            wq = self.frozen_weight()  # W quantized once per policy version, or None
            y = quantized_forward(
                x2d, self.weight, recipe, name=self.full_name, out_dtype=torch.bfloat16, wq=wq
            )
        return y.reshape(*lead, self.out_features)

    def freeze_weights(self, version: int) -> bool:
        """Quantize W's fprop operand once for policy ``version`` and hold it for the forwards that
        run without autograd (sampling), instead of quantizing W in every call; True if it quantized
        now, False if it holds that version already (or the recipe has no quantized fprop).

        The operand is the one the no-grad fprop makes (the same quantizer on the same W, the BF16
        block values and FP32 tensor scale kept), so outputs are bit for bit those without it; for
        NVFP4 the 16×16 tiles are those the training fprop and dgrad use. (Delayed FP8 scaling is
        the exception there as everywhere without autograd: W is scaled from its own amax.) It is
        used only while the recipe, device and W itself are unchanged (:meth:`frozen_weight`);
        training forwards never use it."""
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
        """Whether x and dy are each quantized as one delayed-scaled tensorwise FP8 pair (for two
        GEMMs) and the amax history has a step: then a producer of x or dy that knows the scale may
        hand them over already quantized (:meth:`LinearGEMMs.forward` / ``backward``)."""
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
        """The words of delayed scaling; a scale amax is None (current scaling, still recorded) until
        the history has a step. None: the layer scales from each tensor's own amax. Evaluation and
        other no-grad forwards always do."""
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

    NOTE: CPUs have no BF16 matrix units worth the name (a BF16 ``F.linear`` is ~40x slower than
    FP32 there), so on CPU the BF16-rounded operands are widened to FP32 first: products of two BF16
    values are exact in FP32, so this is the same GEMM with FP32 accumulation, only faster.
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

    Why: autograd through ``weight.to(bf16)`` gets dW from a BF16 GEMM (rounded to BF16), then casts
    it back to the FP32 master's dtype in a separate pass. Here the wgrad GEMM writes its FP32
    accumulator as is (``torch.mm(..., out_dtype=float32)``): no rounding of the gradient, no cast
    kernel (what Megatron's fused wgrad accumulation gives). Forward and dgrad are those of F.linear.
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


# -- the three GEMMs -----------------------------------------------------------------------------


def _symmetric(spec: OperandQuant) -> bool:
    """Whether the operand's quantization is the same for the tensor and its transpose."""
    return spec.block == TENSORWISE or spec.block[0] == spec.block[1]


def _transposed_operand(
    t, spec: OperandQuant, recipe: Recipe, generator, name: str, *, keep: bool, amax=None, scale_with=None,
    record=None,
):  # fmt: skip
    """The operand ``tᵀ`` (t: [contraction, rows]); symmetric blocks quantize t as stored.

    ``keep``: the operand is saved for backward (packed codes); otherwise it is multiplied at once.
    ``amax``: its tensor amax when already known (:func:`gemm.shared_nvfp4_amaxes`), or its delayed
    FP8 scale's amax (then ``record`` gets its own, see :func:`gemm.quantize`).
    ``scale_with``: the partner operand's decode scale (see :func:`gemm.quantize`).
    """
    if _symmetric(spec) and not spec.rht:
        amax_fp8 = amax if spec.delayed else None
        op = gemm.quantize(
            t, spec, codes=keep, values=not keep, name=name, scale_with=scale_with, amax=amax_fp8,
            record=record,
        )  # fmt: skip
        return dataclasses.replace(op, transposed=True)
    return gemm.quantize(
        t, spec, transpose=True, signs=recipe.rht_signs, generator=generator, codes=keep,
        values=not keep, name=name, amax=amax, scale_with=scale_with,
    )  # fmt: skip


def quantized_forward(
    x2d: torch.Tensor, weight: torch.Tensor, recipe: Recipe, *, name: str = "", out_dtype=torch.float32,
    wq: gemm.Operand | None = None,
) -> torch.Tensor:  # fmt: skip
    """fprop only (no autograd): y [M, N], FP32 unless ``out_dtype`` says otherwise. ``wq``: W's
    fprop operand already quantized (:meth:`QuantLinear.freeze_weights`)."""
    with torch.autocast(device_type=x2d.device.type, enabled=False):
        y, _, _ = _fprop(x2d, weight, recipe, name, out_dtype, wq=wq)
    return y


def _fprop(
    x2d, weight, recipe: Recipe, name: str, out_dtype, keep_x=False, keep_w=False, amax_x=None, xq=None,
    record_x=None, rows=None, amax_w=None, record_w=None, wq=None,
):  # fmt: skip
    """y [M, N] = x · Wᵀ, and the quantized operands (packed codes kept where asked for); ``xq`` /
    ``wq``: x / W already quantized (:func:`gemm.fp8_operand_pair`; x2d may then be None and ``rows``
    gives M). ``amax_*`` / ``record_*``: delayed scaling of x and W (see :func:`gemm.quantize`)."""
    M, N = x2d.shape[0] if rows is None else rows, weight.shape[0]
    if recipe.fprop is None:
        return gemm.bf16_matmul(x2d, weight).to(out_dtype), None, None  # y: [M, N]
    if xq is None:  # xq: [M, K]
        xq = gemm.quantize(
            x2d, recipe.fprop.a, codes=keep_x, values=True, name=f"{name} x", amax=amax_x, record=record_x
        )
    if wq is None:  # wq: [N, K]
        wq = gemm.quantize(
            weight, recipe.fprop.b, codes=keep_w, values=True, name=f"{name} W", scale_with=xq.decode_scale,
            amax=amax_w, record=record_w,
        )  # fmt: skip
    y = gemm.matmul(xq, wq, backend=recipe.backend, out_dtype=out_dtype, size=(M, N))  # y: [M, N]
    return y, xq, wq


class _QuantLinearFn(torch.autograd.Function):
    """The autograd function of a quantized linear layer (see the module docstring for the GEMMs)."""

    @staticmethod
    def forward(ctx, x2d, weight, layer: LinearGEMMs, pair_x, dy_fp8):
        need_dx, need_dw = ctx.needs_input_grad[:2]
        y, saved = layer.forward(x2d, weight, need_dx=need_dx, need_dw=need_dw, pair_x=pair_x)
        save_operands(ctx, saved)
        ctx.layer, ctx.x_dtype, ctx.dy_fp8 = layer, x2d.dtype, dy_fp8
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dw = ctx.layer.backward(saved_operands(ctx), dy, ctx.x_dtype, dy_fp8=ctx.dy_fp8)
        return dx, dw, None, None, None


@dataclasses.dataclass
class LinearGEMMs:
    """The three GEMMs of one quantized linear layer, forward and backward, outside autograd.

    :class:`_QuantLinearFn` is these two methods behind ``torch.autograd.Function``; a block that
    owns several linears (the fused FP8 MLP, ``model/mlp_fp8.py``) calls them itself, handing in x or
    dy already quantized by the kernel that produced it (``pair_x`` / ``pair_dy``, a
    :func:`gemm.fp8_operand_pair`). Only plain attributes are kept here: tensors to save go in the
    dict that :meth:`forward` returns (through ``ctx.save_for_backward``)."""

    recipe: Recipe
    generator: torch.Generator | None
    name: str
    delayed: DelayedWords | None
    """The delayed-scaling words (:meth:`QuantLinear.delayed_words`), or None: current scaling."""
    shape: tuple[int, int, int]
    """(M tokens, K in_features, N out_features)."""

    def forward(
        self, x2d, weight, *, need_dx: bool, need_dw: bool, pair_x: tuple | None = None
    ) -> tuple[torch.Tensor, dict]:
        """(y [M, N] BF16, the operands to save for :meth:`backward`). ``pair_x``: x already quantized
        as its fprop and wgrad operands (x2d is then not read and may be None)."""
        recipe, generator, name, delayed = self.recipe, self.generator, self.name, self.delayed
        fprop, dgrad, wgrad = recipe.fprop, recipe.dgrad, recipe.wgrad
        # Operands that serve two GEMMs: W's 16x16 (or 128x128) tiles are the same for Wᵀ, and a
        # per-tensor-scaled x is the same for xᵀ.
        reuse_w = need_dx and fprop is not None and dgrad is not None and dgrad.b == fprop.b
        reuse_w = reuse_w and _symmetric(fprop.b)
        reuse_x = need_dw and fprop is not None and wgrad is not None and wgrad.b == fprop.a
        reuse_x = reuse_x and fprop.a.block == TENSORWISE
        amax_x = amax_xt = None
        with torch.autocast(device_type=weight.device.type, enabled=False):
            x_used, x_rec = (None, None) if delayed is None else (delayed.x_used, delayed.x_record)
            w_delayed = delayed is not None and fprop is not None and fprop.b.delayed
            if pair_x is None:
                # x is quantized along rows (fprop) and after the RHT along tokens (wgrad): one read of x
                # gives both tensor amaxes where the fused kernels run.
                amax_x, amax_xt = gemm.shared_nvfp4_amaxes(
                    x2d, fprop.a if fprop else None, wgrad.b if need_dw and wgrad else None, recipe.rht_signs
                )
                # FP8: x along rows (fprop) and xᵀ along tokens (wgrad) from one read of x; a delayed
                # tensorwise scale comes from the history and x's amax goes into it.
                pair_x = gemm.fp8_operand_pair(
                    x2d, fprop.a if fprop else None, wgrad.b if need_dw and wgrad else None, f"{name} x",
                    amax=x_used, record=x_rec,
                )  # fmt: skip
                if x_used is not None and not pair_x and fprop is not None and fprop.a.delayed:
                    amax_x = x_used  # x quantized for the fprop alone, from the history as well
            # FP8: W along rows (fprop) and Wᵀ (dgrad) from one read of W, as x: no byte transpose of W
            # in the backward (a tensorwise pair of whole blocks: W is not padded; a delayed scale from
            # the history, W's amax recorded into it)
            pair_w = None
            if reuse_w and all(d % m == 0 for d, m in zip(weight.shape, fprop.b.multiple, strict=True)):
                pair_w = gemm.fp8_operand_pair(
                    weight, fprop.b, dgrad.b, f"{name} W", amax=delayed.w_used if w_delayed else None,
                    record=delayed.w_record if w_delayed else None,
                )  # fmt: skip
            y, xq, wq = _fprop(
                x2d, weight, recipe, name, torch.bfloat16, keep_x=reuse_x, keep_w=reuse_w, amax_x=amax_x,
                xq=pair_x[0] if pair_x else None,
                record_x=x_rec if fprop is not None and fprop.a.delayed else None, rows=self.shape[0],
                amax_w=delayed.w_used if w_delayed else None,
                record_w=delayed.w_record if w_delayed else None, wq=pair_w[0] if pair_w else None,
            )  # fmt: skip
            saved = {}
            if need_dx:
                if dgrad is None:
                    saved["w"] = weight
                elif pair_w:
                    saved["w"] = pair_w[1]  # Wᵀ: [K, N], the dgrad operand as stored
                elif reuse_w:
                    saved["w"] = dataclasses.replace(wq.packed(), transposed=True)  # [K, N] logical
                else:
                    w_delayed = delayed is not None and dgrad.b.delayed
                    saved["w"] = _transposed_operand(
                        weight, dgrad.b, recipe, generator, f"{name} W", keep=True,
                        amax=delayed.w_used if w_delayed else None,
                        record=delayed.w_record if w_delayed else None,
                    )  # fmt: skip
            if need_dw:
                if wgrad is None:
                    saved["x"] = x2d.to(torch.bfloat16)
                elif pair_x:
                    saved["x"] = pair_x[1]  # xᵀ: [K, M] (blocked along the tokens, or tensorwise)
                elif reuse_x:
                    saved["x"] = dataclasses.replace(xq.packed(), transposed=True)  # [K, M] logical
                else:  # Q(RHT(xᵀ)): [K, M], blocked along the tokens
                    saved["x"] = _transposed_operand(
                        x2d, wgrad.b, recipe, generator, f"{name} x", keep=True, amax=amax_xt
                    )
        return y, saved

    def backward(
        self, saved: dict, dy, x_dtype: torch.dtype, *, pair_dy: tuple | None = None, dy_fp8=None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(dx [M, K] in ``x_dtype``, dW [N, K] FP32), each None where ``saved`` has no operand for it.
        ``pair_dy``: dy already quantized as its dgrad and wgrad operands (dy is then not read).
        ``dy_fp8``: the FP8 gradient slab dy's consumer was handed (``model/residual_fp8.py``): dy is
        its placeholder where the consumer wrote the bytes, else values it quantizes the same way."""
        recipe, generator, name = self.recipe, self.generator, self.name
        if pair_dy is None and dy_fp8 is not None:
            pair_dy = dy_fp8.fp8_operands((dy,), recipe.dgrad.a, recipe.wgrad.a)
            dy = None
        M, K, N = self.shape
        dx = dw = None
        backend = recipe.backend
        device = dy.device if dy is not None else pair_dy[0].q.data.device
        with torch.autocast(device_type=device.type, enabled=False):
            dyq = None
            amax_dy = amax_dyt = None
            delayed = self.delayed
            dy_used, dy_rec = (None, None) if delayed is None else (delayed.dy_used, delayed.dy_record)
            if pair_dy is None:
                dy = dy.reshape(M, N)  # dy: [M, N]
                # dy is quantized along rows (dgrad) and after the RHT along tokens (wgrad): both amaxes
                # from one read of dy where the fused kernels run.
                amax_dy, amax_dyt = gemm.shared_nvfp4_amaxes(
                    dy,
                    recipe.dgrad.a if "w" in saved and recipe.dgrad else None,
                    recipe.wgrad.a if "x" in saved and recipe.wgrad else None,
                    recipe.rht_signs,
                )
                # FP8: dy along rows (dgrad) and dyᵀ along tokens (wgrad) from one read of dy (delayed
                # tensorwise scaling as for x in the forward).
                pair_dy = gemm.fp8_operand_pair(
                    dy,
                    recipe.dgrad.a if "w" in saved and recipe.dgrad else None,
                    recipe.wgrad.a if "x" in saved and recipe.wgrad else None,
                    f"{name} dy",
                    amax=dy_used,
                    record=dy_rec,
                )
                if delayed is not None and not pair_dy:  # dy quantized for one GEMM only
                    amax_dy = amax_dyt = dy_used
            if "w" in saved:
                if recipe.dgrad is None:
                    dx = gemm.bf16_matmul(dy, saved["w"].t()).to(x_dtype)  # dx: [M, K] = dy · W
                else:
                    if pair_dy:
                        dyq = pair_dy[0]
                    else:  # multiplied at once, never saved: no 4-bit codes (FP8 operands are their bytes)
                        dyq = gemm.quantize(
                            dy, recipe.dgrad.a, generator=generator, codes=False, values=True,
                            name=f"{name} dy", amax=amax_dy, scale_with=saved["w"].decode_scale,
                            record=dy_rec if recipe.dgrad.a.delayed else None,
                        )  # fmt: skip
                    dx = gemm.matmul(dyq, saved["w"], backend=backend, out_dtype=x_dtype, size=(M, K))
            if "x" in saved:
                if recipe.wgrad is None:
                    dw = gemm.bf16_matmul(dy.t(), saved["x"].t())  # dW: [N, K] = dyᵀ · x
                else:
                    a = recipe.wgrad.a
                    if pair_dy:
                        dy_t = pair_dy[1]  # dyᵀ: [N, M] (blocked along the tokens, or tensorwise)
                    elif dyq is not None and dyq.spec == a and a.block == TENSORWISE:
                        dy_t = dataclasses.replace(dyq, transposed=True)
                    else:  # Q_sr(RHT(dyᵀ)): [N, M], blocked along the tokens
                        dy_t = _transposed_operand(
                            dy, a, recipe, generator, f"{name} dy", keep=False, amax=amax_dyt,
                            scale_with=saved["x"].decode_scale, record=dy_rec if a.delayed else None,
                        )  # fmt: skip
                    dw = gemm.matmul(dy_t, saved["x"], backend=backend, out_dtype=torch.float32, size=(N, K))
        return dx, dw


# -- saving quantized operands through ctx.save_for_backward -------------------------------------
# Saved tensors must go through save_for_backward (not ctx attributes) so autograd manages their
# lifetime and saved_tensors_hooks (offloading, memory accounting) see them.


def save_operands(ctx, saved: dict) -> None:
    """``ctx.save_for_backward`` of a dict of tensors and :class:`gemm.Operand` s (their tensors)."""
    tensors, layout = [], {}
    for key, item in saved.items():
        if isinstance(item, torch.Tensor):
            layout[key] = ("tensor", len(tensors))
            tensors.append(item)
            continue
        assert item.values is None, "operands are saved packed (Operand.packed)"
        q = item.q
        fields = {}
        for f in dataclasses.fields(q):
            value = getattr(q, f.name)
            if isinstance(value, torch.Tensor):
                fields[f.name] = ("tensor", len(tensors))
                tensors.append(value)
            else:
                fields[f.name] = ("value", value)
        decode = None  # the quantizer's decode scale, so backward does not recompute it from the amax
        if item.decode_scale is not None:
            decode = len(tensors)
            tensors.append(item.decode_scale)
        layout[key] = ("operand", type(q), fields, item.spec, item.transposed, decode)
    ctx.save_for_backward(*tensors)
    ctx.layout = layout


def saved_operands(ctx) -> dict:
    """The dict :func:`save_operands` saved."""
    tensors = ctx.saved_tensors
    out = {}
    for key, entry in ctx.layout.items():
        if entry[0] == "tensor":
            out[key] = tensors[entry[1]]
            continue
        _, cls, fields, spec, transposed, decode = entry
        kwargs = {name: tensors[v] if kind == "tensor" else v for name, (kind, v) in fields.items()}
        decode_scale = None if decode is None else tensors[decode]
        out[key] = gemm.Operand(cls(**kwargs), spec, transposed, decode_scale=decode_scale)
    return out

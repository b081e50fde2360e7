"""The three GEMMs of a quantized linear layer (the table of :mod:`.recipes`), forward and backward,
and their autograd function. Legend: M tokens, K = in_features, N = out_features.

Saved for backward are the *quantized* operands the backward GEMMs consume (packed codes + scales,
e.g. ``Q(RHT(xᵀ))`` made in the forward), so an NVFP4 layer keeps about 0.56 bytes per element of x
and W alive instead of BF16's 2. Where the fused kernels run, x's wgrad operand is kept as its BF16
block values instead (``gemm.SAVED_WGRAD_VALUES``): 2 bytes, and no decode pass in the backward.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from inkling_fp4.precision import gemm, gemm_backend
from inkling_fp4.precision.decode_fprop import decode_fprop
from inkling_fp4.precision.operand_plan import operand_plan, symmetric
from inkling_fp4.precision.recipes import OperandQuant, Recipe


class DelayedWords(NamedTuple):
    """Views of the policy's amax state (``amax_history``): per operand, the amax its scale comes from
    (None: current scaling, no step yet) and the word its own amax is recorded into."""

    x_used: torch.Tensor | None
    x_record: torch.Tensor
    dy_used: torch.Tensor | None
    dy_record: torch.Tensor
    w_used: torch.Tensor | None
    w_record: torch.Tensor


def _transposed_operand(
    t, spec: OperandQuant, recipe: Recipe, generator, name: str, *, keep: bool, amax=None, scale_with=None,
    record=None,
):  # fmt: skip
    """The operand ``tᵀ`` (t: [contraction, rows]); symmetric blocks quantize t as stored.
    ``keep``: saved for backward (packed codes), else multiplied at once; the rest as :func:`gemm.quantize`.
    """
    if symmetric(spec) and not spec.rht:
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
    wq: gemm.Operand | None = None, rows=None,
) -> torch.Tensor:  # fmt: skip
    """fprop only (no autograd): y [M, N], FP32 unless ``out_dtype`` says otherwise. ``wq``: W's
    fprop operand already quantized (:meth:`QuantLinear.freeze_weights`); ``rows``: x's, by its producer
    (:class:`decode_fprop.QuantizedRows`)."""
    with torch.autocast(device_type=x2d.device.type, enabled=False):
        if out_dtype == torch.bfloat16 and recipe.fprop is not None:  # one fused kernel, or None
            y = decode_fprop(x2d, wq, recipe.fprop.a, weight.shape[0], name, rows)
            if y is not None:
                return y
        y, _, _ = _fprop(x2d, weight, recipe, name, out_dtype, wq=wq)
    return y


def _fprop(
    x2d, weight, recipe: Recipe, name: str, out_dtype, keep_x=False, keep_w=False, amax_x=None, xq=None,
    record_x=None, rows=None, amax_w=None, record_w=None, wq=None,
):  # fmt: skip
    """y [M, N] = x · Wᵀ and the quantized operands; ``xq`` / ``wq``: already quantized (x2d may then be
    None and ``rows`` gives M). ``amax_*`` / ``record_*``: delayed scaling (see :func:`gemm.quantize`)."""
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
    y = gemm_backend.matmul(xq, wq, backend=recipe.backend, out_dtype=out_dtype, size=(M, N))  # y: [M, N]
    return y, xq, wq


class _QuantLinearFn(torch.autograd.Function):
    """The autograd function of a quantized linear layer (see the module docstring for the GEMMs)."""

    @staticmethod
    def forward(ctx, x2d, weight, layer: LinearGEMMs, pair_x, dy_fp8, amaxes_x=None, dy_amaxes=None):
        need_dx, need_dw = ctx.needs_input_grad[:2]
        y, saved = layer.forward(
            x2d, weight, need_dx=need_dx, need_dw=need_dw, pair_x=pair_x, amaxes_x=amaxes_x
        )
        save_operands(ctx, saved)
        ctx.layer, ctx.x_dtype, ctx.dy_fp8, ctx.dy_amaxes = layer, x2d.dtype, dy_fp8, dy_amaxes
        return y

    @staticmethod
    def backward(ctx, dy):
        given = ctx.dy_amaxes.pop() if ctx.dy_amaxes else None  # from the output's consumer, if it ran
        dx, dw = ctx.layer.backward(saved_operands(ctx), dy, ctx.x_dtype, dy_fp8=ctx.dy_fp8, amaxes_dy=given)
        return dx, dw, None, None, None, None, None


@dataclasses.dataclass
class LinearGEMMs:
    """The three GEMMs of one quantized linear layer, forward and backward, outside autograd.

    Blocks that own several linears (the fused FP8 MLP, ``model/fused_fp8/mlp.py``) call these directly,
    handing in x or dy already quantized (``pair_x`` / ``pair_dy``). Only plain attributes live here:
    tensors to save go in the dict :meth:`forward` returns (through ``ctx.save_for_backward``)."""

    recipe: Recipe
    generator: torch.Generator | None
    name: str
    delayed: DelayedWords | None
    """The delayed-scaling words (:meth:`QuantLinear.delayed_words`), or None: current scaling."""
    shape: tuple[int, int, int]
    """(M tokens, K in_features, N out_features)."""

    def forward(
        self, x2d, weight, *, need_dx: bool, need_dw: bool, pair_x: tuple | None = None, amaxes_x=None
    ) -> tuple[torch.Tensor, dict]:
        """(y [M, N] BF16, the operands to save for :meth:`backward`). ``pair_x``: x already quantized
        as its fprop and wgrad operands (x2d is then not read and may be None). ``amaxes_x``: x's NVFP4
        tensor amaxes from its producer (``QuantLinear.hand_over_amaxes``)."""
        recipe, generator, name, delayed = self.recipe, self.generator, self.name, self.delayed
        fprop, dgrad, wgrad = recipe.fprop, recipe.dgrad, recipe.wgrad
        plan = operand_plan(recipe, need_dx, need_dw)
        amax_x = amax_xt = None
        with torch.autocast(device_type=weight.device.type, enabled=False):
            x_used, x_rec = (None, None) if delayed is None else (delayed.x_used, delayed.x_record)
            w_delayed = delayed is not None and fprop is not None and fprop.b.delayed
            if pair_x is None:
                # x is quantized along rows (fprop) and after the RHT along tokens (wgrad): one read of x
                # gives both tensor amaxes where the fused kernels run.
                amax_x, amax_xt = gemm.shared_nvfp4_amaxes(
                    x2d, plan.fprop_x, plan.wgrad_x, recipe.rht_signs, amaxes_x
                )
                # FP8: x along rows (fprop) and xᵀ along tokens (wgrad) from one read of x; a delayed
                # tensorwise scale comes from the history and x's amax goes into it.
                pair_x = gemm.fp8_operand_pair(
                    x2d, plan.fprop_x, plan.wgrad_x, f"{name} x", amax=x_used, record=x_rec
                )
                if x_used is not None and not pair_x and fprop is not None and fprop.a.delayed:
                    amax_x = x_used  # x quantized for the fprop alone, from the history as well
                if plan.saved_x == "own" and not pair_x:  # NVFP4: both of x's operands from one more read
                    pair_x = gemm.nvfp4_operand_pair(
                        x2d, plan.fprop_x, plan.wgrad_x, recipe.rht_signs, amax_x, amax_xt, f"{name} x"
                    )
            # FP8: W along rows (fprop) and Wᵀ (dgrad) from one read of W, as x: no byte transpose of W
            # in the backward (a tensorwise pair of whole blocks: W is not padded; a delayed scale from
            # the history, W's amax recorded into it)
            pair_w = None
            if plan.saved_w == "reuse" and all(
                d % m == 0 for d, m in zip(weight.shape, fprop.b.multiple, strict=True)
            ):
                pair_w = gemm.fp8_operand_pair(
                    weight, fprop.b, dgrad.b, f"{name} W", amax=delayed.w_used if w_delayed else None,
                    record=delayed.w_record if w_delayed else None,
                )  # fmt: skip
            y, xq, wq = _fprop(
                x2d, weight, recipe, name, torch.bfloat16, keep_x=plan.saved_x == "reuse",
                keep_w=plan.saved_w == "reuse", amax_x=amax_x, xq=pair_x[0] if pair_x else None,
                record_x=x_rec if fprop is not None and fprop.a.delayed else None, rows=self.shape[0],
                amax_w=delayed.w_used if w_delayed else None,
                record_w=delayed.w_record if w_delayed else None, wq=pair_w[0] if pair_w else None,
            )  # fmt: skip
            saved = {}
            if plan.saved_w == "bf16":
                saved["w"] = weight
            elif pair_w:
                saved["w"] = pair_w[1]  # Wᵀ: [K, N], the dgrad operand as stored
            elif plan.saved_w == "reuse":
                saved["w"] = dataclasses.replace(wq.packed(), transposed=True)  # [K, N] logical
            elif plan.saved_w == "own":
                w_delayed = delayed is not None and dgrad.b.delayed
                saved["w"] = _transposed_operand(
                    weight, dgrad.b, recipe, generator, f"{name} W", keep=True,
                    amax=delayed.w_used if w_delayed else None,
                    record=delayed.w_record if w_delayed else None,
                )  # fmt: skip
            if plan.saved_x == "bf16":
                saved["x"] = x2d.to(torch.bfloat16)
            elif plan.saved_x and pair_x:
                saved["x"] = pair_x[1]  # xᵀ: [K, M] (blocked along the tokens, or tensorwise)
            elif plan.saved_x == "reuse":
                saved["x"] = dataclasses.replace(xq.packed(), transposed=True)  # [K, M] logical
            elif plan.saved_x == "own":  # Q(RHT(xᵀ)): [K, M], blocked along the tokens
                saved["x"] = _transposed_operand(
                    x2d, wgrad.b, recipe, generator, f"{name} x", keep=not gemm.saves_wgrad_values(x2d),
                    amax=amax_xt,
                )  # fmt: skip
        return y, saved

    def backward(
        self, saved: dict, dy, x_dtype: torch.dtype, *, pair_dy: tuple | None = None, dy_fp8=None,
        amaxes_dy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """(dx [M, K] in ``x_dtype``, dW [N, K] FP32), each None where ``saved`` has no operand for it.
        ``pair_dy``: dy already quantized (dy is then not read). ``dy_fp8``: the FP8 gradient slab
        (``model/fused_fp8/residual.py``): dy is a placeholder where the consumer wrote the bytes.
        ``amaxes_dy``: dy's NVFP4 tensor amaxes from the consumer that wrote dy (``QuantLinear.forward``)."""
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
            plan = operand_plan(recipe, "w" in saved, "x" in saved)
            if pair_dy is None:
                dy = dy.reshape(M, N)  # dy: [M, N]
                # dy is quantized along rows (dgrad) and after the RHT along tokens (wgrad): both amaxes
                # from one read of dy where the fused kernels run.
                amax_dy, amax_dyt = gemm.shared_nvfp4_amaxes(
                    dy, plan.dgrad_dy, plan.wgrad_dy, recipe.rht_signs, amaxes_dy
                )
                # FP8: dy along rows (dgrad) and dyᵀ along tokens (wgrad) from one read of dy (delayed
                # tensorwise scaling as for x in the forward).
                pair_dy = gemm.fp8_operand_pair(
                    dy, plan.dgrad_dy, plan.wgrad_dy, f"{name} dy", amax=dy_used, record=dy_rec
                )
                if delayed is not None and not pair_dy:  # dy quantized for one GEMM only
                    amax_dy = amax_dyt = dy_used
                if not pair_dy and amax_dyt is not None and "w" in saved and "x" in saved:
                    # NVFP4: both of dy's operands from one more read of dy (the seeds drawn as for two)
                    pair_dy = gemm.nvfp4_operand_pair(
                        dy, plan.dgrad_dy, plan.wgrad_dy, recipe.rht_signs, amax_dy, amax_dyt, f"{name} dy",
                        keep_codes_t=False, generator=generator,
                        scale_with=(saved["w"].decode_scale, saved["x"].decode_scale),
                    )  # fmt: skip
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
                    dx = gemm_backend.matmul(dyq, saved["w"], backend=backend, out_dtype=x_dtype, size=(M, K))
            if "x" in saved:
                if recipe.wgrad is None:
                    dw = gemm.bf16_matmul(dy.t(), saved["x"].t())  # dW: [N, K] = dyᵀ · x
                else:
                    a = recipe.wgrad.a
                    if pair_dy:
                        dy_t = pair_dy[1]  # dyᵀ: [N, M] (blocked along the tokens, or tensorwise)
                    elif plan.reuse_dy:
                        dy_t = dataclasses.replace(dyq, transposed=True)
                    else:  # Q_sr(RHT(dyᵀ)): [N, M], blocked along the tokens
                        dy_t = _transposed_operand(
                            dy, a, recipe, generator, f"{name} dy", keep=False, amax=amax_dyt,
                            scale_with=saved["x"].decode_scale, record=dy_rec if a.delayed else None,
                        )  # fmt: skip
                    dw = gemm_backend.matmul(
                        dy_t, saved["x"], backend=backend, out_dtype=torch.float32, size=(N, K)
                    )
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
        if item.q is None:  # BF16 block values alone (gemm.SAVED_WGRAD_VALUES) and their decode scale
            layout[key] = ("values", len(tensors), item.spec, item.transposed)
            tensors += [item.values, item.decode_scale]
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
    tensors = ctx.saved_tensors
    out = {}
    for key, entry in ctx.layout.items():
        if entry[0] == "tensor":
            out[key] = tensors[entry[1]]
            continue
        if entry[0] == "values":
            _, i, spec, transposed = entry
            out[key] = gemm.Operand(None, spec, transposed, values=tensors[i], decode_scale=tensors[i + 1])
            continue
        _, cls, fields, spec, transposed, decode = entry
        kwargs = {name: tensors[v] if kind == "tensor" else v for name, (kind, v) in fields.items()}
        decode_scale = None if decode is None else tensors[decode]
        out[key] = gemm.Operand(cls(**kwargs), spec, transposed, decode_scale=decode_scale)
    return out

"""The MLP under delayed-scaled tensorwise FP8, with its squared ReLU done inside the quantizers.

In ``down(relu(up(x))²)``, r = relu(h)² (down_proj's x) and its gradient dh (up_proj's dy) are BF16
[tokens, ffn] tensors whose only reader is the quantizer; with a delayed scale the quantizer computes
them from h (and dr) as it reads (``fp8.quantize_squared_relu_pair``), rounding to BF16 exactly as the
squared ReLU kernels do: the same bits and amaxes as unfused (``tests/test_mlp_fp8.py``).

Shape letters: M tokens, D d_model, F ffn width.
"""

from __future__ import annotations

import torch

from inkling_fp4.precision import gemm
from inkling_fp4.precision.linear_gemms import LinearGEMMs, save_operands, saved_operands
from inkling_fp4.precision.quant_linear import QuantLinear


def applies(up: QuantLinear, down: QuantLinear, x: torch.Tensor) -> bool:
    """Whether :func:`squared_relu_mlp` runs: a training forward not traced by torch.compile (which sees
    the linears one by one), both linears delayed FP8 pairs."""
    grads = x.requires_grad or up.weight.requires_grad or down.weight.requires_grad
    eager = not torch.compiler.is_compiling()
    return torch.is_grad_enabled() and grads and eager and up.delayed_fp8_pairs() and down.delayed_fp8_pairs()


def squared_relu_mlp(
    up: QuantLinear, down: QuantLinear, x: torch.Tensor, pair_x: tuple | None = None, dy_fp8=None
):
    """``down(relu(up(x))²)`` for x [..., D] -> [..., D]; ``pair_x``: x quantized for up, ``dy_fp8``: the
    output's gradient slab."""
    x2d = x.reshape(-1, up.in_features)  # x2d: [M, D]
    tokens = x2d.shape[0]
    y = _SquaredReLUMLPFn.apply(
        x2d, up.weight, down.weight, up.gemms(tokens, x.device), down.gemms(tokens, x.device), pair_x, dy_fp8
    )
    return y.reshape(*x.shape[:-1], down.out_features)


class _SquaredReLUMLPFn(torch.autograd.Function):
    """Both linears and the squared ReLU between them, whose output and gradient exist only as FP8."""

    @staticmethod
    def forward(ctx, x2d, w_up, w_down, up: LinearGEMMs, down: LinearGEMMs, pair_x, dy_fp8):
        need_dx, need_dw_up, need_dw_down = ctx.needs_input_grad[:3]
        h, saved_up = up.forward(x2d, w_up, need_dx=need_dx, need_dw=need_dw_up, pair_x=pair_x)  # [M, F]
        spec = down.recipe.fprop.a
        x_used, x_record = down.delayed.x_used, down.delayed.x_record
        pair_r = gemm.fp8_operand_pair(
            h, spec, down.recipe.wgrad.b, f"{down.name} x", amax=x_used, record=x_record, squared_relu=True
        )  # r = relu(h)²: [M, F] as fprop and wgrad operands
        y, saved_down = down.forward(None, w_down, need_dx=True, need_dw=need_dw_down, pair_x=pair_r)
        saved = {"h": h} | {f"up.{k}": v for k, v in saved_up.items()}
        save_operands(ctx, saved | {f"down.{k}": v for k, v in saved_down.items()})
        ctx.up, ctx.down, ctx.x_dtype, ctx.dy_fp8 = up, down, x2d.dtype, dy_fp8
        return y  # y: [M, D]

    @staticmethod
    def backward(ctx, dy):
        up, down = ctx.up, ctx.down
        saved = saved_operands(ctx)
        h = saved.pop("h")
        dr, dw_down = down.backward(_part(saved, "down."), dy, h.dtype, dy_fp8=ctx.dy_fp8)  # dr: [M, F]
        dy_used, dy_record = up.delayed.dy_used, up.delayed.dy_record
        pair_dh = gemm.fp8_operand_pair(
            h, up.recipe.dgrad.a, up.recipe.wgrad.a, f"{up.name} dy", amax=dy_used, record=dy_record,
            squared_relu=True, dout=dr,
        )  # dh = 2·dr·h where h > 0: [M, F] as dgrad and wgrad operands  # fmt: skip
        dx, dw_up = up.backward(_part(saved, "up."), None, ctx.x_dtype, pair_dy=pair_dh)
        return dx, dw_up, dw_down, None, None, None, None


def _part(saved: dict, prefix: str) -> dict:
    return {k.removeprefix(prefix): v for k, v in saved.items() if k.startswith(prefix)}

"""model/grad_slab.py on CPU: the split's backward hands on the consumers' shared buffer (no copy) when
every block's gradient was written into it, and falls back to the concatenation, with the same values,
when a consumer allocated its own, a block has no gradient, or a block is read twice."""

from __future__ import annotations

import pytest
import torch

from inkling_fp4.model import grad_slab
from inkling_fp4.model.grad_slab import split_with_grad_slab

WIDTHS = [5, 7, 3]


class _ScaleInto(torch.autograd.Function):
    """A consumer y = 2 x whose backward writes dx into ``into()`` when given (as the kernels do)."""

    @staticmethod
    def forward(ctx, x, into):
        ctx.into = into
        return 2 * x

    @staticmethod
    def backward(ctx, dy):
        dx = ctx.into() if ctx.into is not None else torch.empty_like(dy)
        dx.copy_(2 * dy)
        return dx, None


class _Probe(torch.autograd.Function):
    """Identity that records the gradient reaching it (what in_proj's backward would receive)."""

    seen: list = []

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        _Probe.seen.append(g)
        return g


def _run(consume, monkeypatch=None, forbid_concat=False):
    """Loss of the consumed blocks; returns (t.grad, the gradient the probe saw, the slab)."""
    torch.manual_seed(0)
    t = torch.randn(2, 4, sum(WIDTHS), requires_grad=True)
    if forbid_concat:
        monkeypatch.setattr(grad_slab, "concatenate", lambda *a: pytest.fail("fell back to concatenating"))
    _Probe.seen = []
    blocks, slab = split_with_grad_slab(_Probe.apply(t), WIDTHS)
    weights = [torch.randn(b.shape) for b in blocks]
    loss = sum((y * w).sum() for y, w in zip(consume(blocks, slab), weights, strict=True) if y is not None)
    loss.backward()
    want = torch.cat([w * 2 if i in consume.scaled else w for i, w in enumerate(weights)], -1)
    for i in consume.unused:
        want[..., sum(WIDTHS[:i]) : sum(WIDTHS[: i + 1])] = 0
    return t.grad, want, _Probe.seen[0], slab


def _consumer(fn, scaled=(0, 1, 2), unused=()):
    fn.scaled, fn.unused = scaled, unused
    return fn


def test_blocks_written_in_place_reach_the_producer_as_the_buffer(monkeypatch):
    def consume(blocks, slab):
        return [_ScaleInto.apply(b, slab.into(i)) for i, b in enumerate(blocks)]

    got, want, seen, slab = _run(_consumer(consume), monkeypatch, forbid_concat=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert seen.is_contiguous() and seen.shape == (2, 4, sum(WIDTHS))
    assert slab.buffer is None  # released after the backward


@pytest.mark.parametrize("case", ["own_buffer", "unused_block", "read_twice"])
def test_fallbacks_give_autograds_gradient(case):
    if case == "own_buffer":  # the middle consumer allocates its own gradient

        def consume(blocks, slab):
            return [_ScaleInto.apply(b, None if i == 1 else slab.into(i)) for i, b in enumerate(blocks)]

        fn = _consumer(consume)
    elif case == "unused_block":  # the last block feeds nothing

        def consume(blocks, slab):
            return [_ScaleInto.apply(b, slab.into(i)) for i, b in enumerate(blocks[:2])] + [None]

        fn = _consumer(consume, unused=(2,))
    else:  # block 0 is read by its in-place consumer and by a plain op: the gradients add up

        def consume(blocks, slab):
            ys = [_ScaleInto.apply(b, slab.into(i)) for i, b in enumerate(blocks)]
            ys[0] = ys[0] + 3 * blocks[0]
            return ys

        fn = _consumer(consume)
    got, want, _, _ = _run(fn)
    if case == "read_twice":
        torch.manual_seed(0)
        torch.randn(2, 4, sum(WIDTHS))
        w0 = torch.randn(2, 4, WIDTHS[0])
        want[..., : WIDTHS[0]] = w0 * 2 + w0 * 3  # d/dx (2x + 3x), summed as autograd does
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_wrong_buffer_is_refused():
    from inkling_fp4.model.glue_kernels.common import grad_buffer

    like = torch.zeros(2, 3, 4)
    assert grad_buffer(None, like).shape == like.shape
    wide = torch.zeros(2, 3, 9)
    assert grad_buffer(lambda: wide[..., 2:6], like).data_ptr() == wide[..., 2:6].data_ptr()
    with pytest.raises(ValueError, match="gradient buffer must be"):
        grad_buffer(lambda: torch.zeros(2, 3, 5), like)
    with pytest.raises(ValueError, match="gradient buffer must be"):
        grad_buffer(lambda: torch.zeros(3, 2, 4).transpose(0, 1), like)


def test_placeholders_share_one_cached_zero_per_dtype():
    """A placeholder is zeros of its shape, expanded from a scalar that is made once per device and
    dtype (no fill per placeholder), and an FP8 slab recognises its blocks' placeholders by it."""
    a = grad_slab.zeros_placeholder((4, 6), torch.bfloat16, torch.device("cpu"))
    b = grad_slab.zeros_placeholder((2, 3, 5), torch.bfloat16, "cpu")
    c = grad_slab.zeros_placeholder((4, 6), torch.float32, "cpu")
    assert a.shape == (4, 6) and b.shape == (2, 3, 5) and c.dtype == torch.float32
    assert a.stride() == (0, 0) and b.stride() == (0, 0, 0)
    assert a.data_ptr() == b.data_ptr() != c.data_ptr()
    assert not a.any() and not b.any() and not c.any()
    scaling = grad_slab.FP8Scaling(torch.ones(1), torch.zeros(1), e5m2=True)
    like = torch.empty((), dtype=torch.bfloat16).expand(2, 3, sum(WIDTHS))
    slab = grad_slab.GradSlab(like, WIDTHS, scaling)
    block = slab.block(1)
    assert block.placeholder.data_ptr() == a.data_ptr() and block.placeholder.shape == (2, 3, WIDTHS[1])
    assert slab.holds(block.placeholder, 1) and slab.holds(block.placeholder.reshape(6, WIDTHS[1]), 1)
    assert not slab.holds(torch.zeros(2, 3, WIDTHS[1], dtype=torch.bfloat16), 1)  # values, not the bytes
    assert not slab.holds(block.placeholder, 0)  # another block's width

"""The Triton glue kernels (model/glue_kernels/) against the references of inkling_fp4.model (the
dispatcher that picks them: test_glue_dispatch.py).

- Kernel tests (marked ``gpu``): values and gradients against the plain references (``fn.reference``)
  and against autograd through them in FP64. On a CUDA device ``pytest -m gpu tests/test_glue_kernels.py``
  runs them there; on CPU the parent test ``test_kernels_under_triton_interpreter`` runs them in a
  child pytest with TRITON_INTERPRET=1 (``TRITON_INTERPRET=1 python -m pytest -m gpu`` on this file runs
  them directly). Fresh random inputs each run (the seed is printed), rows that no tile divides,
  widths that are not powers of two, strided views as the model passes them.

Tolerances, and why:
- exact (``torch.equal``): h = x + y of add_rms_norm; squared_relu forward and backward (a product of
  two BF16 numbers is exact in FP32, so both round once; the backward's ``2 dout h`` equals the
  reference's ``dout r + dout r`` for normal numbers); the dh-only backward of add_rms_norm.
- norms, forward: the sum over D runs in another order, so FP32 outputs agree to ``NORM_RTOL``
  (~12 FP32 ulps; seen: <= 5) and BF16 outputs to one BF16 ulp, at most 1% of them differing.
  Against FP64, every output is the FP64 value rounded to nearest, up to that same FP32 noise.
- dt_softplus, forward: exp and log1p are libm functions whose last bit differs between
  implementations (torch's CPU kernels are not correctly rounded either): ``SOFTPLUS_ULPS`` FP32 ulps.
- gradients: relative norm ||got - ref|| / ||ref|| against autograd through the reference in FP64 on
  the same input values: ``GRAD_RTOL`` per gradient dtype (BF16: its unit roundoff 2^-8, FP32: FP32
  noise amplified by the norm backward's cancellation).
"""

from __future__ import annotations

import random

import pytest
import torch

from inkling_fp4.model import compiled, mamba2, mlp, norm
from interpreter import INTERPRET, kernel_test, run_interpreted

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
EPS = 1e-5
NORM_RTOL = 1.5e-6
SOFTPLUS_ULPS = 4
GRAD_RTOL = {torch.float32: 2e-5, torch.bfloat16: 4.5e-3}
BF, F32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def _seed():
    seed = random.randrange(2**31)
    print(f"input seed = {seed}")
    torch.manual_seed(seed)


def _randn(*shape, dtype=F32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def _fp32_ulp(v: torch.Tensor) -> torch.Tensor:
    v = v.float().abs()
    return torch.nextafter(v, torch.full_like(v, float("inf"))) - v


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """The spacing of BF16 numbers at |v| (v = m 2^e, m in [0.5, 1): 2^(e - 8)); 2^-133 at 0."""
    _, e = torch.frexp(v.double())
    ulp = torch.ldexp(torch.ones_like(v, dtype=torch.float64), (e - 8).clamp_min(-133))
    return torch.where(v == 0, 2.0**-133, ulp)


def _assert_norm_close(got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor | None) -> None:
    """got vs the reference in the same dtype, and (unless None) vs the FP64 value ``exact`` rounded once."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == F32:
        torch.testing.assert_close(got, ref, rtol=NORM_RTOL, atol=1e-30)
        bound = None if exact is None else NORM_RTOL * exact.abs() + 0.5 * _fp32_ulp(exact).double()
    else:
        diff = (got.double() - ref.double()).abs()
        assert (diff <= _bf16_ulp(ref)).all(), f"more than one BF16 ulp apart: max {diff.max().item():.3e}"
        assert (got != ref).double().mean() <= 0.01, "too many BF16 outputs differ from the reference"
        bound = None if exact is None else NORM_RTOL * exact.abs() + 0.5 * _bf16_ulp(exact)
    if exact is None:
        return
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"not the FP64 value rounded: worst excess {(err - bound).max().item():.3e}"


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def _run(fn, leaves, douts, wide=False):
    """Outputs of fn(*leaves) and the leaves' gradients for the output gradients douts (None: unused);
    with ``wide`` everything in FP64."""
    cast = (lambda t: t.double()) if wide else (lambda t: t)
    leaves = [cast(t.detach()).clone().requires_grad_(t.is_floating_point()) for t in leaves]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    used = [(o, cast(d)) for o, d in zip(outs, douts, strict=True) if d is not None]
    torch.autograd.backward([o for o, _ in used], [d for _, d in used])
    return [o.detach() for o in outs], [t.grad for t in leaves if t.requires_grad]


def _assert_grads(got, ref, dtypes, what):
    for i, (g, r, dtype) in enumerate(zip(got, ref, dtypes, strict=True)):
        assert g.dtype == dtype and g.shape == r.shape, f"{what} grad {i}: {g.dtype} {tuple(g.shape)}"
        err = _rel(g, r)
        assert err < GRAD_RTOL[dtype], f"{what} grad {i}: relative error {err:.2e}"


@pytest.mark.slow
def test_kernels_under_triton_interpreter():
    """Run every kernel test (marked ``gpu``) on CPU in a child process with TRITON_INTERPRET=1."""
    run_interpreted(__file__, "-m", "gpu")


# --- rms_norm / add_rms_norm ----------------------------------------------------------------------------


def _adversarial_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, D] with row 0 zeros, row 1 one nonzero, row 2 large (1e15: the sum of squares is finite)."""
    x = x.clone()
    x[0] = 0
    x[1] = 0
    x[1, x.shape[1] // 3] = -3.5
    x[2] = x[2] * 1e15
    return x


@kernel_test
@pytest.mark.parametrize("D", [96, 768])
@pytest.mark.parametrize("x_dtype,out_dtype", [(F32, None), (F32, BF), (BF, BF), (BF, F32)])
def test_rms_norm_values_and_grads(D, x_dtype, out_dtype):
    from inkling_fp4.model.glue_kernels.norm_kernels import rms_norm

    R = 70  # two backward programs of CHUNK_ROWS (64), the second cut short
    x = _adversarial_rows(_randn(R, D) * torch.rand(R, 1, device=DEVICE) * 4).to(x_dtype)
    w = _randn(D)
    dout = _randn(R, D, dtype=out_dtype or x_dtype)
    fn = lambda x, w: rms_norm(x, w, EPS, out_dtype)  # noqa: E731
    ref = lambda x, w: norm.rms_norm.reference(x, w, EPS, out_dtype)  # noqa: E731
    ref64 = lambda x, w: norm.rms_norm.reference(x, w, EPS, torch.float64)  # noqa: E731
    (out,), grads = _run(fn, [x, w], [dout])
    (want,), _ = _run(ref, [x, w], [dout])
    (exact,), grads64 = _run(ref64, [x, w], [dout], wide=True)
    _assert_norm_close(out, want, exact)
    _assert_grads(grads, grads64, [x_dtype, F32], "rms_norm")


def _add_norm_ref64(h_dtype):
    """add_rms_norm in FP64 with h rounded to h_dtype on the way (the value, not the gradient), as the
    reference rounds it."""

    def ref(x, y, w):
        h = x + y
        h = h + (h.to(h_dtype).double() - h).detach()
        return h, norm.rms_norm.reference(h, w, EPS, torch.float64)

    return ref


@kernel_test
@pytest.mark.parametrize("D", [96, 768])
@pytest.mark.parametrize("x_dtype,y_dtype", [(F32, BF), (BF, BF), (F32, F32)])
def test_add_rms_norm_values_and_grads(D, x_dtype, y_dtype):
    from inkling_fp4.model.glue_kernels.norm_kernels import add_rms_norm

    R = 70
    x = _adversarial_rows(_randn(35, 2, D, scale=3).flatten(0, 1)).to(x_dtype)
    y = _randn(R, D).to(y_dtype)
    y[0] = 0  # row 0 of h stays all zeros
    w = _randn(D)
    h_dtype = torch.promote_types(x_dtype, y_dtype)
    dh, dnormed = _randn(R, D, dtype=h_dtype), _randn(R, D, dtype=BF)
    fn = lambda x, y, w: add_rms_norm(x, y, w, EPS, BF)  # noqa: E731
    ref = lambda x, y, w: norm.add_rms_norm.reference(x, y, w, EPS, BF)  # noqa: E731
    (h, out), grads = _run(fn, [x, y, w], [dh, dnormed])
    (h_want, want), _ = _run(ref, [x, y, w], [dh, dnormed])
    (_, exact), grads64 = _run(_add_norm_ref64(h_dtype), [x, y, w], [dh, dnormed], wide=True)
    assert h.dtype == h_dtype and torch.equal(h, h_want)
    _assert_norm_close(out, want, exact)
    _assert_grads(grads, grads64, [x_dtype, y_dtype, F32], "add_rms_norm")


@kernel_test
def test_add_rms_norm_dh_path_is_exact_and_outputs_may_be_dropped():
    """With a zero gradient of the norm, dx is dh itself; an unused h or normed output is no error."""
    from inkling_fp4.model.glue_kernels.norm_kernels import add_rms_norm

    R, D = 70, 96
    x, y, w = _randn(R, D), _randn(R, D, dtype=BF), _randn(D)
    dh = _randn(R, D)
    fn = lambda *a: add_rms_norm(*a, EPS, BF)  # noqa: E731
    _, (dx, dy, dw) = _run(fn, [x, y, w], [dh, torch.zeros(R, D, dtype=BF, device=DEVICE)])
    assert torch.equal(dx, dh) and torch.equal(dy, dh.to(BF)) and torch.equal(dw, torch.zeros_like(w))
    _, (dx, dy, dw) = _run(fn, [x, y, w], [dh, None])
    assert torch.equal(dx, dh) and torch.equal(dy, dh.to(BF)) and dw is None
    dnormed = _randn(R, D, dtype=BF)
    _, got = _run(fn, [x, y, w], [None, dnormed])
    _, grads64 = _run(_add_norm_ref64(F32), [x, y, w], [None, dnormed], wide=True)
    _assert_grads(got, grads64, [F32, BF, F32], "add_rms_norm without dh")


@kernel_test
def test_norms_propagate_overflow_nan_and_inf_as_the_reference():
    """FP32 rows of 1e30 (the sum of squares overflows: the reference writes zeros), one NaN, one inf."""
    from inkling_fp4.model.glue_kernels.norm_kernels import add_rms_norm, rms_norm

    R, D = 9, 96
    x, w = _randn(R, D), _randn(D)
    x[1] = x[1] * 1e30
    x[4, 7] = float("nan")
    x[6, 50] = float("inf")
    dout = _randn(R, D)
    cases = [
        (rms_norm, norm.rms_norm.reference),
        (  # add_rms_norm: the same rows through h = x + 0
            lambda x, w, eps, dt: add_rms_norm(x, torch.zeros_like(x), w, eps, dt)[1],
            lambda x, w, eps, dt: norm.add_rms_norm.reference(x, torch.zeros_like(x), w, eps, dt)[1],
        ),
    ]
    for fn, ref in cases:
        (out,), (dx, _) = _run(lambda x, w, fn=fn: fn(x, w, EPS, F32), [x, w], [dout])
        (want,), (dx_want, _) = _run(lambda x, w, ref=ref: ref(x, w, EPS, F32), [x, w], [dout])
        torch.testing.assert_close(out, want, rtol=NORM_RTOL, atol=1e-30, equal_nan=True)
        zeros = torch.zeros(D, device=DEVICE)
        assert torch.equal(out[1], zeros), "an overflowing row normalises to zeros"
        assert torch.equal(dx[1], zeros)
        assert dx[4].isnan().all() and dx_want[4].isnan().all()
        ok = torch.ones(R, dtype=torch.bool, device=DEVICE)
        ok[[4, 6]] = False  # NaN rows: the gradient's NaN pattern is the reference's own business
        torch.testing.assert_close(dx[ok], dx_want[ok], rtol=1e-4, atol=1e-6)


# --- skip_gated_rms_norm --------------------------------------------------------------------------------


def _gated_inputs(Bsz, L, H, P, dtype, d_dtype=F32):
    """y [B, L, H, P] contiguous (the scan's output); x and z views into wider tensors, as in the model."""
    E = H * P
    y = _randn(Bsz, L, H, P, dtype=dtype)
    xbc = _randn(Bsz, L, E + 40, dtype=dtype)  # x || B || C
    zx = _randn(Bsz, L, E + 24, dtype=dtype)  # z || ...
    D = (torch.rand(H, device=DEVICE) * 2).to(d_dtype)
    w = _randn(E)
    y[0, 0] = 0  # a zero row: s = D x then
    xbc[0, 0] = 0
    zx[0, 1] = -1e30  # silu(z) = -0: the group's u is zero
    return y, xbc, zx, D, w


def _gated_fn(fn, H, P, G, out_dtype):
    E = H * P

    def call(y, xbc, zx, D, w):
        x = xbc[..., :E].unflatten(-1, (H, P))
        z = zx[..., 3 : 3 + E]
        return fn(y, x, D, z, w, G, EPS, out_dtype)

    return call


@kernel_test
@pytest.mark.parametrize("H,P,G", [(6, 16, 2), (12, 64, 2), (8, 8, 8)])  # group widths 48, 384, 8
@pytest.mark.parametrize("dtype,out_dtype", [(BF, BF), (F32, None)])
def test_skip_gated_rms_norm_values_and_grads(H, P, G, dtype, out_dtype):
    from inkling_fp4.model.glue_kernels.gated_norm_kernels import skip_gated_rms_norm

    Bsz, L = 2, 35
    leaves = _gated_inputs(Bsz, L, H, P, dtype)
    dout = _randn(Bsz, L, H * P, dtype=out_dtype or F32)
    (out,), grads = _run(_gated_fn(skip_gated_rms_norm, H, P, G, out_dtype), leaves, [dout])
    ref = norm.skip_gated_rms_norm.reference
    (want,), _ = _run(_gated_fn(ref, H, P, G, out_dtype), leaves, [dout])
    (exact,), grads64 = _run(_gated_fn(ref, H, P, G, torch.float64), leaves, [dout], wide=True)
    # NOTE elementwise against FP64 only through the reference: where y + x D cancels, s keeps the FP32
    # rounding of its terms (the reference's too), which is no bound relative to the output
    _assert_norm_close(out, want, None)
    assert _rel(out, exact) < (NORM_RTOL if out.dtype == F32 else 2.0**-8)
    _assert_grads(grads, grads64, [dtype, dtype, dtype, F32, F32], "skip_gated_rms_norm")


@kernel_test
def test_skip_gated_rms_norm_all_bf16_rounds_the_skip_sum_like_the_reference():
    """With a BF16 D the reference rounds x D and then y + x D to BF16; so does the kernel."""
    from inkling_fp4.model.glue_kernels.gated_norm_kernels import skip_gated_rms_norm

    H, P, G = 6, 16, 3
    y, xbc, zx, D, w = _gated_inputs(1, 37, H, P, BF, d_dtype=BF)
    out = _gated_fn(skip_gated_rms_norm, H, P, G, None)(y, xbc, zx, D, w.to(BF))
    want = _gated_fn(norm.skip_gated_rms_norm.reference, H, P, G, None)(y, xbc, zx, D, w.to(BF))
    assert out.dtype == BF
    diff = (out.double() - want.double()).abs()
    assert (diff <= _bf16_ulp(want)).all() and (out != want).double().mean() <= 0.01


# --- squared_relu ---------------------------------------------------------------------------------------


@kernel_test
@pytest.mark.parametrize("dtype", [BF, F32])
def test_squared_relu_is_exact(dtype):
    from inkling_fp4.model.glue_kernels.pointwise_kernels import squared_relu

    h = _randn(37, 300, dtype=dtype, scale=3)  # 11100 elements: the flat blocks cut the last
    h[0, :8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e20, -1e20, 1e-20])
    dout = _randn(37, 300, dtype=dtype)
    (out,), _ = _run(squared_relu, [h], [dout])
    (want,), _ = _run(mlp.squared_relu.reference, [h], [dout])
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    # the backward: normal-range values (NOTE 2 x a product that rounds into the subnormals may differ)
    h2 = _randn(37, 300, dtype=dtype, scale=3)
    h2[0, :3] = torch.tensor([0.0, -0.0, float("nan")])
    _, (dh,) = _run(squared_relu, [h2], [dout])
    _, (dh_want,) = _run(mlp.squared_relu.reference, [h2], [dout])
    assert dh.dtype == dtype
    torch.testing.assert_close(dh, dh_want, rtol=0, atol=0, equal_nan=True)


# --- dt_softplus ----------------------------------------------------------------------------------------


@kernel_test
@pytest.mark.parametrize("dtype", [BF, F32])
@pytest.mark.parametrize("H", [24, 5])
def test_dt_softplus_values_and_grads(dtype, H):
    from inkling_fp4.model.glue_kernels.pointwise_kernels import dt_softplus

    R, W = 301, H + 11
    base = (torch.rand(R, W, device=DEVICE) * 60 - 30).to(dtype)  # both sides of the threshold 20
    bias = torch.rand(H, device=DEVICE) * -5 - 2  # softplus^-1 of dt in [1e-3, 0.1]: -7 .. -2
    base[0, 2 : 2 + H] = (20.0 - bias).to(dtype)  # v = dt + bias at the threshold
    base[1, 2:6] = torch.tensor([float("inf"), -float("inf"), float("nan"), -1e30])
    dout = _randn(R, H)

    def call(fn):
        return lambda base, bias: fn(base[:, 2 : 2 + H], bias)  # a column slice, as dt_raw is

    (out,), _ = _run(call(dt_softplus), [base, bias], [dout])
    (want,), _ = _run(call(mamba2.dt_softplus.reference), [base, bias], [dout])
    assert out.dtype == F32 and out.shape == want.shape
    assert torch.equal(out.isnan(), want.isnan())
    ok = want.isfinite()
    assert torch.equal(out[~ok & ~want.isnan()], want[~ok & ~want.isnan()])
    ulps = ((out[ok] - want[ok]).abs() / _fp32_ulp(want[ok])).max().item()
    assert ulps <= SOFTPLUS_ULPS, f"{ulps} ulps from the reference"
    fin = base[:, 2 : 2 + H].isfinite().all(1)  # gradients on the finite rows (the reference's
    fin[1] = False  # softplus backward is exp-based there too, compare where both are defined)
    (_, grads64) = _run(call(mamba2.dt_softplus.reference), [base[fin], bias], [dout[fin]], wide=True)
    (_, grads) = _run(call(dt_softplus), [base[fin], bias], [dout[fin]])
    _assert_grads(grads, grads64, [dtype, F32], "dt_softplus")


# --- arguments and routing ------------------------------------------------------------------------------


@kernel_test
def test_bad_arguments_are_refused():
    from inkling_fp4.model.glue_kernels.gated_norm_kernels import skip_gated_rms_norm
    from inkling_fp4.model.glue_kernels.norm_kernels import add_rms_norm, rms_norm

    x = _randn(4, 96)
    with pytest.raises(ValueError, match="float64"):
        rms_norm(x.double(), _randn(96), EPS)
    with pytest.raises(ValueError, match="one shape"):
        add_rms_norm(x, x[:1], _randn(96), EPS, BF)
    y = _randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match="n_groups"):
        skip_gated_rms_norm(y, y, _randn(4), _randn(2, 3, 32), _randn(32), 3, EPS)
    if not INTERPRET:
        with pytest.raises(ValueError, match="CUDA"):
            rms_norm(x.cpu(), _randn(96).cpu(), EPS)


@kernel_test
def test_model_functions_route_to_their_kernels(monkeypatch):
    """Each decorated function of the model runs the autograd Function of its kernel on the device
    (under the interpreter the fast form is forced on CPU tensors), with the reference's result."""
    if DEVICE == "cpu":
        monkeypatch.setattr(compiled, "fast_forms_on", lambda first: True)
    H, P, G = 4, 8, 2
    y, x = _randn(3, 5, H, P), _randn(3, 5, H, P)
    z, w = _randn(3, 5, H * P), _randn(H * P)
    cases = [
        (norm.rms_norm, (z, w, EPS, BF), "_RMSNorm"),
        (norm.add_rms_norm, (z, z.to(BF), w, EPS, BF), "_AddRMSNorm"),
        (norm.skip_gated_rms_norm, (y, x, _randn(H), z, w, G, EPS, None), "_SkipGatedRMSNorm"),
        (mlp.squared_relu, (z.to(BF),), "_SquaredReLU"),
        (mamba2.dt_softplus, (z[..., :H], _randn(H)), "_DtSoftplus"),
    ]
    for fn, args, function in cases:
        leaves = [a.detach().requires_grad_() if torch.is_tensor(a) else a for a in args]
        got = fn(*leaves)
        want = fn.reference(*args)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, r in zip(got, want, strict=True):
            assert type(g.grad_fn).__name__ == function + "Backward", f"{fn.__name__}: {g.grad_fn}"
            assert g.dtype == r.dtype and _rel(g, r) < 2.0**-8, fn.__name__

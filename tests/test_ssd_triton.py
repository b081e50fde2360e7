"""The Triton SSD scan (ssd_triton) against the chunked reference (ssd_reference): values and gradients.

Three layers, each independent of the one above:

- CPU, plain torch: the kernels' torch twins composed into the whole forward and backward equal autograd
  through ssd_reference in FP64. This checks the hand-derived backward without Triton.
- CPU, Triton interpreter: every kernel against its twin, and ssd_triton against ssd_reference. Triton
  picks the interpreter when a kernel is defined, so these tests run in a child pytest process with
  TRITON_INTERPRET=1 (test_under_triton_interpreter) and the setting never leaks into other tests.
  ``TRITON_INTERPRET=1 python -m pytest tests/test_ssd_triton.py`` runs them directly.
- GPU (@pytest.mark.gpu): training shapes, BF16 and FP32, chunk 64 and 128.

Inputs are fresh random each run (the seed is in every failure message), with document boundaries at
chunk edges, at the first and last positions and inside chunks, and lengths that are not a multiple of the
chunk. NaN/Inf are not checked by the kernel (that would cost a device sync per call); they propagate.
"""

from __future__ import annotations

import random

import pytest
import torch

from interpreter import interpreted, run_interpreted

pytest.importorskip("triton")

from inkling_fp4.errors import UserError  # noqa: E402
from inkling_fp4.model.ssd import ssd_reference  # noqa: E402
from inkling_fp4.model.ssd_kernels.chunk_cumsum import chunk_cumsum, chunk_cumsum_ref  # noqa: E402
from inkling_fp4.model.ssd_kernels.chunk_scan import chunk_scan, chunk_scan_ref  # noqa: E402
from inkling_fp4.model.ssd_kernels.chunk_states import chunk_states, chunk_states_ref  # noqa: E402
from inkling_fp4.model.ssd_kernels.chunking import padded_segments  # noqa: E402
from inkling_fp4.model.ssd_kernels.scan_grads_bc import scan_grads_bc, scan_grads_bc_ref  # noqa: E402
from inkling_fp4.model.ssd_kernels.scan_grads_x import scan_grads_x, scan_grads_x_ref  # noqa: E402
from inkling_fp4.model.ssd_kernels.state_grads import state_grads, state_grads_ref  # noqa: E402
from inkling_fp4.model.ssd_kernels.tuning import INTERPRET  # noqa: E402
from inkling_fp4.model.ssd_triton import ssd_triton  # noqa: E402

GRAD_NAMES = ("dx", "ddt", "dA", "dB", "dC", "dinit")


def make_inputs(
    seed, b, l, h, g, p, n, *, docs=False, init=False, chunk=16, dtype=torch.float32, device="cpu"
):
    """Random SSD inputs: dt log-uniform in [1e-3, 2], A in [-4, -0.1], documents of random lengths."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    x = randn(b, l, h, p)
    dt = torch.exp(torch.empty(b, l, h).uniform_(-6.9, 0.7, generator=gen))
    A = -torch.exp(torch.empty(h).uniform_(-2.3, 1.4, generator=gen))
    B, C = randn(b, l, g, n), randn(b, l, g, n)
    state = randn(b, h, p, n) if init else None
    doc_ids = None
    if docs:
        starts = torch.rand(b, l, generator=gen) < 0.08
        starts[0, [i for i in (1, chunk, chunk + 1, l - 1) if i < l]] = True  # edges and lone tokens
        doc_ids = starts.long().cumsum(1).to(torch.int32)
    cast = [t.to(device, dtype) for t in (x, B, C)]
    return dict(
        x=cast[0],
        dt=dt.to(device),
        A=A.to(device),
        B=cast[1],
        C=cast[2],
        initial_state=None if state is None else state.to(device),
        doc_ids=None if doc_ids is None else doc_ids.to(device),
    )


def rel(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def reference_fwd_bwd(inp, chunk, dy, dfinal):
    """ssd_reference in FP64 and its autograd gradients, for the loss sum(y dy) + sum(final dfinal)."""
    names = ("x", "dt", "A", "B", "C", "initial_state")
    leaves = {k: inp[k].detach().double().requires_grad_() for k in names if inp[k] is not None}
    y, final = ssd_reference(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk,
        initial_state=leaves.get("initial_state"), doc_ids=inp["doc_ids"],
    )  # fmt: skip
    loss = (y * dy.double()).sum() + (final * dfinal.double()).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return y, final, dict(zip(GRAD_NAMES, grads, strict=False))  # no dinit without an initial state


def triton_fwd_bwd(inp, chunk, dy, dfinal):
    names = ("x", "dt", "A", "B", "C", "initial_state")
    leaves = {k: inp[k].detach().clone().requires_grad_() for k in names if inp[k] is not None}
    y, final = ssd_triton(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk,
        initial_state=leaves.get("initial_state"), doc_ids=inp["doc_ids"],
    )  # fmt: skip
    grads = torch.autograd.grad([y, final], list(leaves.values()), [dy.to(y.dtype), dfinal])
    return y, final, dict(zip(GRAD_NAMES, grads, strict=False))  # no dinit without an initial state


def check_against_reference(seed, inp, chunk, tol, tol_dA=None):
    """NOTE dA sums every position's contribution and those partly cancel, so its relative error is
    the FP32 rounding amplified by that cancellation: it gets its own, looser limit."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = inp["x"]
    dy = torch.randn(x.shape, generator=gen).to(x.device)
    dfinal = torch.randn(x.shape[0], x.shape[2], x.shape[3], inp["B"].shape[3], generator=gen).to(x.device)
    y, final, grads = triton_fwd_bwd(inp, chunk, dy, dfinal)
    y_ref, final_ref, grads_ref = reference_fwd_bwd(inp, chunk, dy, dfinal)
    errors = {"y": rel(y, y_ref), "final": rel(final, final_ref)}
    errors.update({k: rel(grads[k], grads_ref[k]) for k in grads_ref})
    limits = {k: (tol_dA or tol) if k == "dA" else tol for k in errors}
    bad = {k: f"{e:.2e}" for k, e in errors.items() if not e <= limits[k]}
    assert not bad, f"seed {seed}: relative errors over {tol:.0e}: {bad}"
    assert y.dtype == x.dtype and final.dtype == torch.float32
    return errors


# ---- CPU, plain torch: the twins are a correct forward and backward --------------------------------------


def twins_fwd_bwd(inp, chunk, dy, dfinal):
    x, dt, A, B, C, init = (inp[k] for k in ("x", "dt", "A", "B", "C", "initial_state"))
    seg = None if inp["doc_ids"] is None else padded_segments(inp["doc_ids"], chunk)
    dt_t, G = chunk_cumsum_ref(dt, A, chunk)
    states, final = chunk_states_ref(x, dt_t, G, B, init, seg, chunk)
    y = chunk_scan_ref(x, dt_t, G, B, C, states, seg, chunk)
    dstates, dinit = state_grads_ref(dy, G, C, dfinal, seg, chunk)
    dx, ddt_t, dA = scan_grads_x_ref(x, dt_t, G, A, B, C, dy, states, dstates, seg, chunk)
    dB, dC = scan_grads_bc_ref(x, dt_t, G, B, C, dy, states, dstates, seg, chunk)
    ddt = ddt_t[:, :, : x.shape[1]].transpose(1, 2)
    grads = dict(dx=dx, ddt=ddt, dA=dA.sum((0, 2)), dB=dB, dC=dC, dinit=dinit)
    return y, final, grads


@pytest.mark.parametrize(
    "shape, chunk, docs, init",
    [
        ((2, 37, 4, 2, 5, 3), 8, True, True),
        ((1, 16, 3, 1, 4, 6), 16, False, False),
        ((2, 50, 4, 4, 3, 2), 4, True, False),
        ((1, 5, 2, 2, 2, 3), 8, False, True),
    ],
)
def test_twins_compose_to_reference_gradients_fp64(shape, chunk, docs, init):
    seed = random.randrange(2**31)
    inp = make_inputs(seed, *shape, docs=docs, init=init, chunk=chunk, dtype=torch.float64)
    inp = {k: (v.double() if v is not None and v.is_floating_point() else v) for k, v in inp.items()}
    gen = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(inp["x"].shape, generator=gen, dtype=torch.float64)
    b, _, h, p = inp["x"].shape
    dfinal = torch.randn(b, h, p, inp["B"].shape[3], generator=gen, dtype=torch.float64)
    y, final, grads = twins_fwd_bwd(inp, chunk, dy, dfinal)
    y_ref, final_ref, grads_ref = reference_fwd_bwd(inp, chunk, dy, dfinal)
    assert rel(y, y_ref) < 1e-12 and rel(final, final_ref) < 1e-12, f"seed {seed}"
    for k, g in grads_ref.items():
        assert rel(grads[k], g) < 1e-10, f"seed {seed}: {k} off by {rel(grads[k], g):.2e}"


def test_twin_without_final_state_gradient_matches_zero_gradient():
    seed = random.randrange(2**31)
    inp = make_inputs(seed, 1, 20, 2, 1, 4, 4, docs=True, init=True, chunk=8)
    dy = torch.randn(inp["x"].shape)
    G = chunk_cumsum_ref(inp["dt"], inp["A"], 8)[1]
    seg = padded_segments(inp["doc_ids"], 8)
    none = state_grads_ref(dy, G, inp["C"], None, seg, 8)
    zero = state_grads_ref(dy, G, inp["C"], torch.zeros(1, 2, 4, 4), seg, 8)
    assert all(torch.equal(a, z) for a, z in zip(none, zero, strict=True)), f"seed {seed}"


# ---- errors ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRET, reason="the interpreter accepts CPU tensors")
def test_cpu_tensors_are_refused_with_a_clear_error():
    inp = make_inputs(0, 1, 8, 2, 1, 4, 4)
    with pytest.raises(UserError, match="needs CUDA tensors"):
        ssd_triton(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16)


def test_bad_arguments_are_refused():
    inp = make_inputs(0, 1, 8, 4, 2, 4, 4)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    with pytest.raises(UserError, match="chunk_size=48"):
        ssd_triton(*args, 48)
    with pytest.raises(ValueError, match="g dividing h"):
        ssd_triton(inp["x"], inp["dt"], inp["A"], inp["B"][:, :, :1].expand(1, 8, 3, 4), inp["C"], 16)
    with pytest.raises(ValueError, match="initial_state"):
        ssd_triton(*args, 16, initial_state=torch.zeros(1, 4, 4, 5))
    with pytest.raises(ValueError, match="doc_ids"):
        ssd_triton(*args, 16, doc_ids=torch.zeros(1, 7, dtype=torch.int32))


# ---- CPU, Triton interpreter -----------------------------------------------------------------------------


@pytest.mark.slow
def test_under_triton_interpreter():
    """Run this file's CPU tests again in a child process with TRITON_INTERPRET=1."""
    run_interpreted(__file__, "-m", "not gpu", timeout=600)


def check_kernels_against_twins(seed, shape, chunk, device):
    inp = make_inputs(seed, *shape, docs=True, init=True, chunk=chunk, device=device)
    x, dt, A, B, C, init = (inp[k] for k in ("x", "dt", "A", "B", "C", "initial_state"))
    seg = padded_segments(inp["doc_ids"], chunk)
    dy = torch.randn(x.shape, device=device)
    dfinal = torch.randn(init.shape, device=device)

    def same(name, got, want):
        got, want = (t if isinstance(t, tuple) else (t,) for t in (got, want))
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and rel(g, w) < 1e-5, f"seed {seed}: {name} off by {rel(g, w):.2e}"

    dt_t, G = chunk_cumsum_ref(dt, A, chunk)
    same("chunk_cumsum", chunk_cumsum(dt, A, chunk), (dt_t, G))
    states, final = chunk_states_ref(x, dt_t, G, B, init, seg, chunk)
    same("chunk_states", chunk_states(x, dt_t, G, B, init, seg, chunk), (states, final))
    args = (x, dt_t, G, B, C, states, seg, chunk)
    same("chunk_scan", chunk_scan(*args), chunk_scan_ref(*args))
    dstates, dinit = state_grads_ref(dy, G, C, dfinal, seg, chunk)
    same("state_grads", state_grads(dy, G, C, dfinal, seg, chunk), (dstates, dinit))
    args = (x, dt_t, G, A, B, C, dy, states, dstates, seg, chunk)
    same("scan_grads_x", scan_grads_x(*args), scan_grads_x_ref(*args))
    args = (x, dt_t, G, B, C, dy, states, dstates, seg, chunk)
    same("scan_grads_bc", scan_grads_bc(*args), scan_grads_bc_ref(*args))


@interpreted
def test_each_kernel_matches_its_twin():
    # p = 24 and n = 20 are not powers of two: the blocks are padded and masked.
    check_kernels_against_twins(random.randrange(2**31), (2, 37, 2, 1, 24, 20), 16, "cpu")


@interpreted
@pytest.mark.parametrize(
    "shape, chunk, docs, init",
    [
        ((2, 21, 4, 2, 16, 32), 16, True, True),  # 2 chunks, the last partial; 2 heads per group
        ((1, 20, 2, 2, 16, 16), 32, False, False),  # one partial chunk; a group per head
    ],
)
def test_fp32_matches_reference(shape, chunk, docs, init):
    seed = random.randrange(2**31)
    check_against_reference(
        seed, make_inputs(seed, *shape, docs=docs, init=init, chunk=chunk), chunk, 2e-5, tol_dA=2e-4
    )


@interpreted
def test_bf16_matches_reference_within_bf16_rounding():
    # Operands rounded to BF16 (as tensor cores take them), FP32 accumulation: errors near 3e-3. dA is
    # a sum of da dt over one head's 48 positions that often cancels, so its relative error varies more
    # (up to ~2.5e-2 here; ~2e-3 with a few hundred positions).
    seed = random.randrange(2**31)
    inp = make_inputs(seed, 1, 48, 2, 1, 16, 32, docs=True, init=True, dtype=torch.bfloat16)
    check_against_reference(seed, inp, 16, 1e-2, tol_dA=6e-2)


@interpreted
def test_extreme_decay_and_single_token():
    seed = random.randrange(2**31)
    inp = make_inputs(seed, 1, 24, 2, 1, 16, 16, docs=True, init=True)
    inp["A"] = torch.tensor([-60.0, -1e-4])  # exp underflows to 0 within a step / almost no decay
    inp["dt"][:, :8] = 0.0  # dt = 0: neither decays nor feeds the state
    # G reaches -1e3 within a chunk: its FP32 differences G_t - G_s carry ~1e-5 absolute error.
    check_against_reference(seed, inp, 16, 5e-5, tol_dA=5e-4)
    one = make_inputs(seed, 2, 1, 2, 1, 16, 16, init=True)
    check_against_reference(seed, one, 16, 2e-5, tol_dA=2e-4)


@interpreted
def test_zero_inputs_give_the_decayed_initial_state_and_nan_propagates():
    inp = make_inputs(random.randrange(2**31), 1, 20, 2, 1, 16, 16, init=True)
    x, dt, A, B, C, init = (inp[k] for k in ("x", "dt", "A", "B", "C", "initial_state"))
    y, final = ssd_triton(torch.zeros_like(x), dt, A, torch.zeros_like(B), C, 16, initial_state=init)
    decay = torch.exp((dt * A).sum(1))  # [b, h]
    torch.testing.assert_close(final, init * decay[..., None, None], rtol=1e-5, atol=0)
    y, _ = ssd_triton(torch.zeros_like(x), dt, A, B, C, 16)
    assert torch.equal(y, torch.zeros_like(y))
    x = x.clone()
    x[0, 5, 1, 3] = float("nan")
    y, final = ssd_triton(x, dt, A, B, C, 16)
    assert y[0, 5:, 1].isnan().any(dim=-1).all() and final[0, 1].isnan().any()
    assert not y[0, :, 0].isnan().any()  # other heads are untouched (earlier tokens of the chunk are not:
    # the chunk's matmul multiplies the NaN by the zero weights of the causal mask)


# ---- GPU -------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("chunk", [64, 128])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("docs", [False, True])
def test_gpu_matches_reference(chunk, dtype, tol, docs):
    seed = random.randrange(2**31)
    inp = make_inputs(
        seed, 2, 1000, 8, 2, 64, 128, docs=docs, init=True, chunk=chunk, dtype=dtype, device="cuda"
    )
    check_against_reference(seed, inp, chunk, tol, tol_dA=3 * tol)


@pytest.mark.gpu
@needs_cuda
def test_gpu_each_kernel_matches_its_twin():
    check_kernels_against_twins(random.randrange(2**31), (2, 300, 8, 2, 64, 128), 64, "cuda")

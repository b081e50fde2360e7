"""The SSD scan: the chunked reference against the token-by-token recurrence, in FP64.

The recurrence is the definition (S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t); the chunked
algorithm is a reorganisation of it, so in FP64 the two agree to rounding (~1e-12) for any G, chunk
size, length, initial state and set of document boundaries.
"""

import pytest
import torch

from inkling_fp4.model.packing import segment_ids
from inkling_fp4.model.ssd import segsum, ssd, ssd_recurrent, ssd_reference, ssd_step
from model_helpers import random_doc_ids, ssd_inputs

TOL = dict(atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "b,l,h,p,g,n,chunk",
    [
        (2, 37, 4, 3, 2, 5, 8),  # length not a multiple of the chunk
        (1, 64, 6, 4, 3, 4, 16),  # exact multiple
        (2, 50, 4, 2, 1, 3, 7),  # G = 1, odd chunk
        (1, 5, 8, 2, 8, 2, 16),  # G = H, chunk longer than the sequence
        (1, 33, 2, 3, 2, 4, 1),  # chunk 1: the recurrence itself
    ],
)
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("with_docs", [False, True])
def test_chunked_equals_recurrence(b, l, h, p, g, n, chunk, with_init, with_docs):
    x, dt, A, B, C = ssd_inputs(b, l, h, p, g, n)
    init = torch.randn(b, h, p, n, dtype=torch.float64) if with_init else None
    docs = random_doc_ids(b, l, n_docs=min(4, l)) if with_docs else None
    y, final = ssd_reference(x, dt, A, B, C, chunk, initial_state=init, doc_ids=docs)
    y_ref, final_ref = ssd_recurrent(x, dt, A, B, C, initial_state=init, doc_ids=docs)
    assert y.shape == x.shape and final.shape == (b, h, p, n)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(final, final_ref, **TOL)


def test_recurrence_matches_the_definition():
    """ssd_recurrent against a loop written straight from the equations, one head at a time."""
    b, l, h, p, g, n = 1, 9, 4, 2, 2, 3
    x, dt, A, B, C = ssd_inputs(b, l, h, p, g, n)
    y, final = ssd_recurrent(x, dt, A, B, C)
    for head in range(h):
        grp = head // (h // g)
        S = torch.zeros(p, n, dtype=torch.float64)
        for t in range(l):
            S = torch.exp(dt[0, t, head] * A[head]) * S + dt[0, t, head] * torch.outer(
                x[0, t, head], B[0, t, grp]
            )
            torch.testing.assert_close(y[0, t, head], S @ C[0, t, grp], **TOL)
        torch.testing.assert_close(final[0, head], S, **TOL)


def test_document_boundaries_equal_separate_runs():
    b, l, h, p, g, n = 1, 45, 4, 3, 2, 4
    x, dt, A, B, C = ssd_inputs(b, l, h, p, g, n)
    init = torch.randn(b, h, p, n, dtype=torch.float64)
    docs = torch.zeros(b, l, dtype=torch.int32)
    cuts = [0, 16, 17, 30, l]  # a one-token document, and a boundary on a chunk edge (16)
    for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        docs[:, s:e] = i % 2
    y, final = ssd_reference(x, dt, A, B, C, 8, initial_state=init, doc_ids=docs)
    for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        part = [t[:, s:e] for t in (x, dt)] + [A] + [t[:, s:e] for t in (B, C)]
        y_doc, final_doc = ssd_reference(*part, 8, initial_state=init if i == 0 else None)
        torch.testing.assert_close(y[:, s:e], y_doc, **TOL)
    torch.testing.assert_close(final, final_doc, **TOL)


def test_adversarial_inputs():
    b, l, h, p, g, n = 1, 20, 2, 2, 1, 2
    x, dt, A, B, C = ssd_inputs(b, l, h, p, g, n)
    init = torch.randn(b, h, p, n, dtype=torch.float64)
    # dt = 0 everywhere: no decay and no input, the initial state is read out unchanged.
    y, final = ssd_reference(x, torch.zeros_like(dt), A, B, C, 8, initial_state=init)
    torch.testing.assert_close(final, init, **TOL)
    torch.testing.assert_close(y, torch.einsum("bhpn,blgn->blhp", init, C), **TOL)
    # Huge decay (exp underflows to 0) must give finite outputs equal to the recurrence.
    big = dt * 1e4
    y, final = ssd_reference(x, big, A, B, C, 8)
    y_ref, final_ref = ssd_recurrent(x, big, A, B, C)
    assert torch.isfinite(y).all() and torch.isfinite(final).all()
    torch.testing.assert_close(y, y_ref, atol=1e-8, rtol=1e-8)
    # Zeros in, zeros out; length 1.
    y, final = ssd_reference(torch.zeros_like(x), dt, A, B, C, 8)
    assert y.abs().max() == 0 and final.abs().max() == 0
    y, final = ssd_reference(x[:, :1], dt[:, :1], A, B[:, :1], C[:, :1], 8)
    torch.testing.assert_close(y, ssd_recurrent(x[:, :1], dt[:, :1], A, B[:, :1], C[:, :1])[0], **TOL)


def test_fp32_inputs_and_autocast_keep_the_scan_in_fp32():
    x, dt, A, B, C = ssd_inputs(2, 40, 4, 8, 2, 8, dtype=torch.float32)
    y, final = ssd_reference(x, dt, A, B, C, 16)
    assert y.dtype == torch.float32 and final.dtype == torch.float32
    y64, final64 = ssd_recurrent(*(t.double() for t in (x, dt, A, B, C)))
    torch.testing.assert_close(y.double(), y64, atol=1e-4, rtol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ac, final_ac = ssd_reference(x, dt, A, B, C, 16)
    torch.testing.assert_close(y_ac, y)  # autocast would have run the einsums in BF16
    yb, finalb = ssd_reference(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), 16)
    assert yb.dtype == torch.bfloat16 and finalb.dtype == torch.float32


def test_gradcheck_reference():
    torch.manual_seed(0)
    x, dt, A, B, C = ssd_inputs(1, 6, 2, 2, 1, 2)
    init = torch.randn(1, 2, 2, 2, dtype=torch.float64)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    args = [t.clone().requires_grad_() for t in (x, dt, A, B, C, init)]

    def f(x, dt, A, B, C, init):
        return ssd_reference(x, dt, A, B, C, 3, initial_state=init, doc_ids=docs)

    assert torch.autograd.gradcheck(f, args, fast_mode=True)


def test_gradients_equal_the_recurrence():
    x, dt, A, B, C = ssd_inputs(2, 19, 4, 3, 2, 4)
    init = torch.randn(2, 4, 3, 4, dtype=torch.float64)
    docs = random_doc_ids(2, 19, 3)
    w_y, w_s = torch.randn_like(x), torch.randn_like(init)
    grads = []
    for fn in (lambda *a: ssd_reference(*a[:5], 8, a[5], docs), lambda *a: ssd_recurrent(*a[:5], a[5], docs)):
        args = [t.clone().requires_grad_() for t in (x, dt, A, B, C, init)]
        y, s = fn(*args)
        ((y * w_y).sum() + (s * w_s).sum()).backward()
        grads.append([a.grad for a in args])
    for g1, g2 in zip(*grads, strict=True):
        torch.testing.assert_close(g1, g2, **TOL)


def test_step_with_zero_dt_leaves_the_state_alone():
    x, dt, A, B, C = ssd_inputs(2, 1, 4, 3, 2, 5)
    state = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    _, new = ssd_step(state, x[:, 0], torch.zeros_like(dt[:, 0]), A, B[:, 0], C[:, 0])
    assert torch.equal(new, state)


def test_segsum_and_segments():
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    s = segsum(a)
    assert s[2, 0] == 5.0 and s[1, 1] == 0.0 and s[0, 1] == float("-inf")
    docs = torch.tensor([[3, 3, 7, 7, 3, 3]])
    assert segment_ids(docs).tolist() == [[0, 0, 1, 1, 2, 2]]


def test_dispatcher_runs_the_reference_on_cpu():
    x, dt, A, B, C = ssd_inputs(1, 10, 2, 2, 1, 2)
    for impl in ("auto", "triton", "reference"):
        y, final = ssd(x, dt, A, B, C, 4, impl=impl)
        torch.testing.assert_close(y, ssd_reference(x, dt, A, B, C, 4)[0], **TOL)

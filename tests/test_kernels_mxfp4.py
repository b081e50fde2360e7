"""The Triton MXFP4 kernel (numerics/kernels/mxfp4_quantize.py) against the torch reference (mxfp4.py).

Round to nearest must give ``mxfp4.quantize_ref``'s codes and E8M0 scale bytes bit for bit; stochastic
rounding must give the reference's scales, one of the two E2M1 neighbours for every element (the
reference rounding with r = 0 or r = 255), and an unbiased mean (a z-test against the exact
expectation over the 256 values of r). The block values the kernel writes in the same pass must equal
the reference's ``block_values`` bit for bit (round to nearest; with stochastic rounding, the decode of
the same call's codes), BF16 subnormals and NaN blocks included, with or without the codes; a GEMM
operand quantized with values must multiply to the same result as one decoded from its codes.

Where the kernel runs:

- CPU, Triton interpreter (``test_interp_*``): small shapes, in a child pytest process with
  TRITON_INTERPRET=1 (``test_under_triton_interpreter``);
  ``TRITON_INTERPRET=1 python -m pytest tests/test_kernels_mxfp4.py`` runs them directly.
- GPU (``@pytest.mark.gpu``): training-sized shapes, and the dispatch of ``mxfp4.quantize`` itself.

Inputs are fresh random each run (the seed is printed with any failure) plus adversarial blocks: a
power-of-two amax with every E2M1 midpoint and its float neighbours at exponents from FP32 subnormal to
near FLT_MAX, zero blocks, ±0, huge and tiny magnitudes.
"""

from __future__ import annotations

import random

import pytest
import torch

from interpreter import interpreted, run_interpreted

pytest.importorskip("triton")

from inkling_fp4.errors import NumericsError  # noqa: E402
from inkling_fp4.numerics import formats, mxfp4  # noqa: E402
from inkling_fp4.numerics.kernels import mxfp4_quantize  # noqa: E402
from inkling_fp4.precision import gemm  # noqa: E402
from inkling_fp4.precision.recipes import OperandQuant  # noqa: E402

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _seed() -> int:
    seed = random.randrange(2**31)
    print(f"input seed = {seed}")  # shown with any failure
    return seed


def kernel_quantize(x: torch.Tensor, **kw) -> mxfp4.MXFP4Tensor:
    """The kernel's codes and scale bytes as the reference's tensor type."""
    codes, scales = mxfp4_quantize.quantize(x, **kw)
    return mxfp4.MXFP4Tensor(codes=codes, scales=scales, shape=x.shape)


def kernel_quantize_with_values(
    x: torch.Tensor, **kw
) -> tuple[mxfp4.MXFP4Tensor | None, torch.Tensor | None]:
    codes, scales, values = mxfp4_quantize.quantize_with_values(x, **kw)
    return (None if codes is None else mxfp4.MXFP4Tensor(codes=codes, scales=scales, shape=x.shape)), values


def assert_same(got: mxfp4.MXFP4Tensor, ref: mxfp4.MXFP4Tensor, what: str) -> None:
    """Codes, scale bytes and shape identical."""
    assert tuple(got.shape) == tuple(ref.shape), what
    for name in ("codes", "scales"):
        a, b = getattr(got, name).cpu(), getattr(ref, name)
        assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape, f"{what}: {name} layout"
        bad = (a != b).nonzero()
        assert len(bad) == 0, f"{what}: {len(bad)} {name} differ, first at {bad[0].tolist()}"


def check_quantize(x: torch.Tensor, device: str) -> None:
    got = kernel_quantize(x.to(device))
    assert_same(got, mxfp4.quantize_ref(x), f"quantize {tuple(x.shape)} {x.dtype}")


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same dtype, shape and bit patterns (any NaN matches any NaN: payloads are not the format)."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: layout"
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[got.dtype]
    differ = (got.view(ints) != want.view(ints)) & ~(got.isnan() & want.isnan())
    bad = differ.nonzero()
    assert len(bad) == 0, f"{what}: {len(bad)} values differ, first at {bad[0].tolist()}"


def check_values(x: torch.Tensor, device: str) -> mxfp4.MXFP4Tensor:
    """One pass writes the reference's codes, scales and BF16 block values; values alone (no codes)
    and FP32 values agree. Returns the reference quantization."""
    ref = mxfp4.quantize_ref(x)
    what = f"values {tuple(x.shape)} {x.dtype}"
    got, values = kernel_quantize_with_values(x.to(device))
    assert_same(got, ref, what)
    assert_same_bits(values, ref.block_values(torch.bfloat16), what)
    none, values_only = kernel_quantize_with_values(x.to(device), keep_codes=False)
    assert none is None
    assert_same_bits(values_only, ref.block_values(torch.bfloat16), f"{what}, no codes")
    _, values32 = kernel_quantize_with_values(x.to(device), values_dtype=torch.float32)
    assert_same_bits(values32, ref.block_values(torch.float32), f"{what}, FP32")
    return ref


def normal(shape, dtype: torch.dtype, seed: int, spread: float = 1.0) -> torch.Tensor:
    """Gaussian values times a per-row scale exp(N(0, spread))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g) * spread)
    return x.to(dtype)


def _nextafter(x: torch.Tensor, toward: float) -> torch.Tensor:
    """The neighbour of x (in x's dtype) toward ``toward``; zeros (underflowed midpoints) stay."""
    if x.dtype == torch.float32:
        return torch.nextafter(x, torch.full_like(x, toward))
    bits = x.view(torch.int16).int()
    step = torch.where((toward > x.float()) == (x.float() >= 0), 1, -1)
    return torch.where(x == 0, x, (bits + step).to(torch.int16).view(x.dtype))


def adversarial(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[16, 256] of 32-element blocks, shuffled: at each exponent k, a block of amax exactly 4·2^k (so
    the scale is 2^k and m·2^k hits the E2M1 midpoint m exactly) holding every midpoint, its float
    neighbours on both sides, 6·2^k, a saturating 7.75·2^k and -0; plus zero, ±0, huge and tiny blocks."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float16:
        exponents = (-24, -16, -14, -3, 0, 8, 13)
    else:  # -150..-127: FP32-subnormal amaxes and the clamp of shared_exp at -127
        exponents = (-150, -140, -128, -127, -126, -124, -60, -3, 0, 9, 60, 125)
    blocks = []
    for k in exponents:
        for sign in (1.0, -1.0):
            mids = (torch.tensor(E2M1_MIDPOINTS) * 2.0**k * sign).to(dtype)
            edge = torch.tensor([4.0, 6.0, 7.75], dtype=torch.float32) * 2.0**k * sign
            blocks.append(
                torch.cat([edge.to(dtype), mids, _nextafter(mids, 0.0), _nextafter(mids, 1e30),
                           -mids, torch.tensor([-0.0], dtype=dtype)])
            )  # fmt: skip
    huge = 6e4 if dtype == torch.float16 else 3e38
    tiny = 1e-7 if dtype == torch.float16 else 1e-44
    blocks.append(torch.zeros(32, dtype=dtype))
    blocks.append(torch.tensor([0.0, -0.0] * 16, dtype=dtype))
    blocks.append((torch.rand(32, generator=g) * 2 - 1).mul(huge).to(dtype))
    blocks.append((torch.rand(32, generator=g) * 2 - 1).mul(tiny).to(dtype))
    rows = torch.stack(blocks)  # [n_blocks, 32]
    filler = torch.randn(16 * 8 - rows.shape[0], 32, generator=g).to(dtype) * 50
    return torch.cat([rows, filler])[torch.randperm(16 * 8, generator=g)].reshape(16, 256)


def check_stochastic(got: mxfp4.MXFP4Tensor, x: torch.Tensor, what: str) -> None:
    """``got`` = stochastic quantization of x [rows, N]: scales of round-to-nearest, codes one of the
    two reference outcomes, mean unbiased against the exact expectation over the 256 values of r."""
    nearest = mxfp4.quantize_ref(x)
    assert torch.equal(got.scales.cpu(), nearest.scales), f"{what}: scales differ from RN"
    inverse = formats.pow2_float(127 - nearest.scales.int())  # 2^-shared_exp, [rows, N/32]
    v = (x.float().unflatten(-1, (-1, 32)) * inverse[..., None]).clamp(-6, 6).flatten(-2)
    r = torch.arange(256, dtype=torch.float32).reshape(256, 1, 1).expand(256, *v.shape)
    outcomes = formats.e2m1_encode_stochastic(v.expand(256, *v.shape), r)  # [256, rows, N]
    values = formats.e2m1_decode(outcomes).double()
    mean, var = values.mean(0), values.var(0, correction=0)
    codes = formats.unpack_nibbles(got.codes.cpu())
    ok = (codes == outcomes[0]) | (codes == outcomes[255])
    assert bool(ok.all()), f"{what}: {int((~ok).sum())} codes are not a neighbour of the input"
    z = float((formats.e2m1_decode(codes).double() - mean).sum() / var.sum().sqrt())
    assert abs(z) < 5.0, f"{what}: biased, z = {z:.2f}"


# -- CPU: the interpreter ------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_interp_quantize_matches_reference(dtype):
    seed = _seed()
    spread = 1.0 if dtype == torch.float16 else 4.0  # FP16 would overflow
    check_quantize(normal((16, 256), dtype, seed, spread=spread), "cpu")
    check_quantize(normal((2, 5, 96), dtype, seed + 1, spread=spread), "cpu")  # leading dims, 3 blocks
    check_quantize(normal((13, 320), dtype, seed + 2, spread=spread), "cpu")  # partial tiles in both dims
    check_quantize(normal((3, 32), dtype, seed + 3).t().contiguous().t().reshape(3, 32), "cpu")


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_interp_adversarial_blocks(dtype):
    x = adversarial(dtype, _seed())
    check_quantize(x, "cpu")
    scale_bytes = mxfp4.quantize_ref(x).scales
    assert (scale_bytes == 0).any() and (scale_bytes > 127).any(), "extreme scales were not exercised"


@interpreted
def test_interp_strided_and_empty_inputs():
    seed = _seed()
    base = normal((64, 40), torch.float32, seed)
    check_quantize(base.t(), "cpu")  # [40, 64], column-major: copied to unit-stride rows
    check_quantize(normal((4, 6, 128), torch.bfloat16, seed)[:, ::2], "cpu")  # row-strided view
    empty = kernel_quantize(torch.zeros(0, 64))
    assert empty.codes.shape == (0, 32) and empty.scales.shape == (0, 2)


@interpreted
def test_interp_stochastic_rounding():
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = normal((64, 64), torch.bfloat16, seed, spread=2.0)
    check_stochastic(kernel_quantize(x, stochastic=True, generator=gen), x, f"seed={seed}")
    # 4 + 3/8 of a step (2) above 4 in a block of amax 4: P(round up to 6) = 96/256 exactly.
    flat = torch.full((64, 64), 4.75)
    flat[:, ::32] = 4.0
    up = formats.unpack_nibbles(kernel_quantize(flat, stochastic=True, generator=gen).codes) == 7
    samples = up.unflatten(1, (2, 32))[:, :, 1:]
    rate, p = samples.float().mean().item(), 96 / 256
    assert abs(rate - p) < 5 * (p * (1 - p) / samples.numel()) ** 0.5, f"round-up rate {rate}, expected {p}"


@interpreted
def test_interp_stochastic_is_reproducible():
    x = normal((16, 64), torch.float32, _seed())
    a = kernel_quantize(x, stochastic=True, generator=torch.Generator().manual_seed(1))
    b = kernel_quantize(x, stochastic=True, generator=torch.Generator().manual_seed(1))
    c = kernel_quantize(x, stochastic=True, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, c.codes)


@interpreted
def test_interp_non_finite_blocks_get_the_nan_scale():
    x = normal((4, 96), torch.bfloat16, _seed())
    x[1, 40] = float("nan")
    x[2, 95] = float("-inf")
    t = kernel_quantize(x)
    nan_blocks = torch.zeros(4, 3, dtype=torch.bool)
    nan_blocks[1, 1] = nan_blocks[2, 2] = True
    assert torch.equal(t.scales == 255, nan_blocks)
    assert torch.isnan(t.dequantize()[1, 32:64]).all() and not torch.isnan(t.dequantize()[0]).any()


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interp_block_values_match_reference(dtype):
    seed = _seed()
    check_values(normal((16, 256), dtype, seed, spread=4.0), "cpu")
    check_values(normal((2, 3, 96), dtype, seed + 1, spread=4.0), "cpu")  # leading dims, 3 blocks
    check_values(normal((13, 320), dtype, seed + 2, spread=4.0), "cpu")  # partial tiles in both dims


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_interp_block_values_of_adversarial_blocks(dtype):
    """Zeros and ±0, every E2M1 midpoint and its neighbours, scale bytes 0 and 1 (values down to the
    BF16 subnormal 2^-128) and amaxes near FLT_MAX (scale byte 252, values up to 1.5·2^127)."""
    ref = check_values(adversarial(dtype, _seed()), "cpu")
    values = ref.block_values(torch.float32)
    if dtype != torch.float16:  # FP16 spans neither end of the E8M0 range
        assert bool(((values != 0) & (values.abs() < 2.0**-126)).any()), "no subnormal values"
        assert (ref.scales <= 1).any() and (ref.scales == 252).any(), "extreme scales were not exercised"
        assert float(values.abs().max()) == 1.5 * 2.0**127


@interpreted
def test_interp_block_values_with_stochastic_rounding():
    """Values are the decode of the same call's codes; with no codes kept the same seed gives the same
    values (the draw does not depend on what is written)."""
    seed = _seed()
    x = normal((32, 128), torch.bfloat16, seed, spread=2.0)
    t, values = kernel_quantize_with_values(x, stochastic=True, generator=torch.Generator().manual_seed(seed))
    check_stochastic(t, x, f"seed={seed}")
    assert_same_bits(values, t.block_values(torch.bfloat16), f"SR values, seed={seed}")
    _, values_only = kernel_quantize_with_values(
        x, stochastic=True, generator=torch.Generator().manual_seed(seed), keep_codes=False
    )
    assert_same_bits(values_only, values, f"SR values without codes, seed={seed}")


@interpreted
def test_interp_non_finite_blocks_give_nan_values():
    x = normal((4, 96), torch.float32, _seed())
    x[1, 40] = float("nan")
    x[2, 95] = float("inf")
    x[3, 0] = -3e38  # finite, near -FLT_MAX: its block stays finite
    t, values = kernel_quantize_with_values(x)
    nan_elements = torch.zeros(4, 96, dtype=torch.bool)
    nan_elements[1, 32:64] = nan_elements[2, 64:96] = True
    assert torch.equal(values.isnan(), nan_elements)
    assert_same_bits(values, t.block_values(torch.bfloat16), "values with NaN blocks")
    assert torch.equal(t.scales == 255, nan_elements[:, ::32])


@pytest.mark.slow
def test_under_triton_interpreter():
    """Run every ``test_interp_*`` in a child process with TRITON_INTERPRET=1 (about 15 s)."""
    run_interpreted(__file__, "-k", "interp")


# -- CPU: no kernel launch -----------------------------------------------------------------------------


def test_cpu_tensors_take_the_reference_path():
    x = normal((4, 64), torch.float32, _seed())
    assert_same(mxfp4.quantize(x), mxfp4.quantize_ref(x), "dispatch on CPU")
    with pytest.raises(ValueError, match="32"):
        mxfp4_quantize.quantize_rows(torch.zeros(4, 48), torch.zeros(4, 24), torch.zeros(4, 1), seed=None)


def test_cpu_quantize_with_values_is_the_reference_and_its_decode():
    x = normal((4, 96), torch.float32, _seed(), spread=3.0)
    ref = mxfp4.quantize_ref(x)
    t, values = mxfp4.quantize_with_values(x)
    assert_same(t, ref, "CPU quantize_with_values")
    assert_same_bits(values, ref.block_values(torch.bfloat16), "CPU values")
    none, values_only = mxfp4.quantize_with_values(x, keep_codes=False, dtype=torch.float32)
    assert none is None
    assert_same_bits(values_only, ref.block_values(torch.float32), "CPU FP32 values")
    x[2, 7] = float("nan")
    with pytest.raises(NumericsError, match="non-finite"):
        mxfp4.quantize_with_values(x, name="x")


@pytest.mark.parametrize("rht", [False, True], ids=["rows", "rht-tokens"])
def test_gemm_operands_with_values_multiply_like_decoded_ones(rht):
    """gemm.quantize(values=True) (codes kept or not) gives the emulated GEMM result of the operand
    decoded from its codes, bit for bit; the transposed RHT operand is the wgrad case."""
    seed = _seed()
    x = normal((24, 64), torch.float32, seed, spread=2.0)  # [M, K]
    w = normal((40, 64), torch.float32, seed + 1)  # [N, K]
    spec = OperandQuant("mxfp4", (1, 32), rht=rht)
    signs = tuple(float(s) for s in torch.where(torch.rand(16) < 0.5, -1.0, 1.0).tolist())
    kw = dict(transpose=True, signs=signs) if rht else {}
    a_in, b_in = (x.t(), w.t()) if rht else (x, w)  # rht: [K, M] and [K, N] quantized along K's transpose
    decoded = gemm.emulated_matmul(gemm.quantize(a_in, spec, **kw), gemm.quantize(b_in, spec, **kw))
    for codes in (True, False):
        a = gemm.quantize(a_in, spec, codes=codes, values=True, **kw)
        b = gemm.quantize(b_in, spec, codes=codes, values=True, **kw)
        assert a.values is not None and a.values.dtype == torch.bfloat16 and a.decode_scale is None
        assert (a.q is None) == (not codes)
        assert torch.equal(gemm.emulated_matmul(a, b), decoded), f"codes={codes}"


# -- GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("check", [check_quantize, check_values], ids=["codes", "block-values"])
def test_gpu_kernel_matches_reference(dtype, check):
    seed = _seed()
    spread = 1.0 if dtype == torch.float16 else 4.0
    check(normal((1024, 4096), dtype, seed, spread=spread), "cuda")
    check(normal((3, 333, 2080), dtype, seed + 1, spread=spread), "cuda")
    check(adversarial(dtype, seed), "cuda")


@pytest.mark.gpu
@on_gpu
def test_gpu_stochastic_and_dispatch():
    seed = _seed()
    x = normal((256, 512), torch.bfloat16, seed, spread=2.0)
    gen = torch.Generator().manual_seed(seed)
    check_stochastic(kernel_quantize(x.cuda(), stochastic=True, generator=gen), x, f"seed={seed}")
    cuda_gen = torch.Generator(device="cuda").manual_seed(seed)
    check_stochastic(mxfp4.quantize(x.cuda(), stochastic=True, generator=cuda_gen), x, "dispatch SR")
    assert_same(mxfp4.quantize(x.cuda()), mxfp4.quantize_ref(x), "dispatch")
    x[7, 100] = float("nan")
    with pytest.raises(NumericsError, match="non-finite"):
        mxfp4.quantize(x.cuda(), name="x")
    unchecked = mxfp4.quantize(x.cuda(), check=False)
    assert torch.isnan(unchecked.dequantize()[7, 96:128]).all()
    with pytest.raises(NumericsError, match="block size 32"):
        mxfp4.quantize(torch.zeros(4, 48, device="cuda"))


@pytest.mark.gpu
@on_gpu
def test_gpu_block_values_dispatch_and_gemm():
    seed = _seed()
    x = normal((256, 512), torch.bfloat16, seed, spread=2.0)
    ref = mxfp4.quantize_ref(x)
    t, values = mxfp4.quantize_with_values(x.cuda())
    assert_same(t, ref, "dispatch")
    assert_same_bits(values, ref.block_values(torch.bfloat16), "dispatch values")
    none, values_only = mxfp4.quantize_with_values(x.cuda(), keep_codes=False)
    assert none is None
    assert_same_bits(values_only, ref.block_values(torch.bfloat16), "dispatch values, no codes")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t, values = mxfp4.quantize_with_values(x.cuda(), stochastic=True, generator=gen)
    check_stochastic(t, x, "dispatch SR")
    assert_same_bits(values, t.block_values(torch.bfloat16).cpu(), "dispatch SR values")
    spec = OperandQuant("mxfp4", (1, 32))
    w = normal((384, 512), torch.float32, seed + 1).cuda()
    fused = gemm.emulated_matmul(
        gemm.quantize(x.cuda(), spec, codes=False, values=True),
        gemm.quantize(w, spec, codes=False, values=True),
    )
    assert torch.equal(fused, gemm.emulated_matmul(gemm.quantize(x.cuda(), spec), gemm.quantize(w, spec)))
    x[7, 100] = float("nan")
    with pytest.raises(NumericsError, match="non-finite"):
        mxfp4.quantize_with_values(x.cuda(), keep_codes=False, name="x")
    _, unchecked = mxfp4.quantize_with_values(x.cuda(), keep_codes=False, check=False)
    assert bool(unchecked[7, 96:128].isnan().all()) and int(unchecked.isnan().sum()) == 32

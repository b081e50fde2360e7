"""The Triton NVFP4 kernels (numerics/kernels) against the torch reference (numerics/nvfp4.py).

Round to nearest must give the reference's codes, E4M3 scale bytes and amax bit for bit; stochastic
rounding must give the reference's scales, one of the two E2M1 neighbours for every element (exactly
the reference rounding with r = 0 or r = 255), and an unbiased mean (a z-test against the exact
expectation over the 256 values of r).

Where the kernels run:

- CPU, Triton interpreter (``test_interp_*``): small shapes. Triton picks the interpreter when a kernel
  is defined, so these run in a child pytest process with TRITON_INTERPRET=1
  (``test_under_triton_interpreter``); ``TRITON_INTERPRET=1 python -m pytest tests/test_kernels_nvfp4.py``
  runs them directly.
- GPU (``@pytest.mark.gpu``): training-sized shapes, and the dispatch of ``nvfp4.quantize`` itself.

Inputs are fresh random each run (the seed is printed with any failure) plus adversarial blocks: every
E2M1 midpoint and its float neighbours at normal and subnormal E4M3 scales, zero blocks, ±0, blocks
that underflow the scale, huge and tiny tensor amaxes.
"""

from __future__ import annotations

import random

import pytest
import torch

from interpreter import interpreted, run_interpreted

pytest.importorskip("triton")

from inkling_fp4.errors import NumericsError  # noqa: E402
from inkling_fp4.numerics import formats, nvfp4  # noqa: E402
from inkling_fp4.numerics.hadamard import rht_signs  # noqa: E402
from inkling_fp4.numerics.kernels import available, triton_nvfp4  # noqa: E402
from inkling_fp4.numerics.kernels.nvfp4_quantize import quantize_rows  # noqa: E402
from inkling_fp4.numerics.kernels.nvfp4_rht import (  # noqa: E402
    RowValues,
    quantize_rht_t_tiles,
    rht_t_abs_max,
    sign_bits,
)

# The interpreter evaluates with numpy, which warns where the kernels divide by zero on purpose
# (1/0 = inf, then clamped to FLT_MAX, as in the reference).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _seed() -> int:
    seed = random.randrange(2**31)
    print(f"input seed = {seed}")  # shown with any failure
    return seed


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same(got: nvfp4.NVFP4Tensor, ref: nvfp4.NVFP4Tensor, what: str) -> None:
    """Codes, scale bytes, amax and shape identical."""
    assert tuple(got.shape) == tuple(ref.shape), what
    for name in ("codes", "scales"):
        a, b = _bytes(getattr(got, name)).cpu(), _bytes(getattr(ref, name)).cpu()
        bad = (a != b).nonzero()
        assert len(bad) == 0, f"{what}: {len(bad)} {name} differ, first at {bad[0].tolist()}"
    assert torch.equal(got.amax.cpu(), ref.amax.cpu()), f"{what}: amax {got.amax} != {ref.amax}"


def _nextafter(x: torch.Tensor, toward: float) -> torch.Tensor:
    """The neighbour of x (in x's dtype) toward ``toward``."""
    if x.dtype == torch.float32:
        return torch.nextafter(x, torch.full_like(x, toward))
    bits = x.view(torch.int16).int()
    step = torch.where((toward > x.float()) == (x.float() >= 0), 1, -1)
    return (bits + step).to(torch.int16).view(x.dtype)


def adversarial(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[48, 128]: one block per case, with global amax 2688 so that S_enc = 1 and a block of max 6·2^k
    has scale exactly 2^k: its elements m·2^k hit the E2M1 midpoints m exactly."""
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for k in (-9, -8, -7, -6, -3, 0, 4, 8):  # 2^-9..2^-7: subnormal E4M3 scales
        mids = torch.tensor(E2M1_MIDPOINTS + (6.0,), dtype=dtype) * 2.0**k
        for signed in (mids, -mids):
            blocks.append(
                torch.cat([signed, _nextafter(signed[:7], 0.0), torch.tensor([6.0 * 2.0**k], dtype=dtype)])
            )
            blocks.append(
                torch.cat([signed, _nextafter(signed[:7], 1e30), torch.tensor([6.0 * 2.0**k], dtype=dtype)])
            )
    blocks.append(torch.full((16,), 2688.0, dtype=dtype))  # the global amax: scale 448
    blocks.append(torch.zeros(16, dtype=dtype))
    blocks.append(torch.tensor([0.0, -0.0] * 8, dtype=dtype))
    blocks.append(torch.randn(16, generator=g).to(dtype) * 1e-4)  # underflows: scale byte 0, codes ±6
    blocks.append(torch.randn(16, generator=g).to(dtype) * 3e-2)  # subnormal scales off the grid
    blocks.append(torch.cat([torch.tensor([6.0]), -torch.rand(15, generator=g) * 0.2]).to(dtype))  # -> -0
    rows = torch.stack(blocks)  # [n_blocks, 16]
    filler = torch.randn(48 * 8 - rows.shape[0], 16, generator=g).to(dtype) * 50
    flat = torch.cat([rows, filler])[torch.randperm(48 * 8, generator=g)]
    return flat.reshape(48, 128)


def normal(shape, dtype: torch.dtype, seed: int, spread: float = 1.0) -> torch.Tensor:
    """Gaussian values times a per-row scale exp(N(0, spread))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g) * spread)
    return x.to(dtype)


def rht_exact(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """BF16-representable values whose magnitudes span less than 2^12: every 16-term RHT sum is exact
    in FP32, so any summation order (butterfly, BLAS) rounds to the same BF16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x = torch.sign(x) * x.abs().clamp(2.0**-6, 30.0)
    return x.bfloat16().to(dtype)


# -- checks shared by the interpreter and the GPU tests ------------------------------------------------


def check_quantize(x: torch.Tensor, device: str, block_2d: bool = False) -> None:
    ref = nvfp4.quantize_ref(x, block_2d=block_2d)
    got = triton_nvfp4.quantize(x.to(device), block_2d=block_2d)
    assert_same(got, ref, f"quantize {tuple(x.shape)} {x.dtype} 2d={block_2d}")


def check_rht_t(x: torch.Tensor, device: str, signs: torch.Tensor | None = None) -> None:
    ref = nvfp4.quantize_rht_t_ref(x, signs)
    got = triton_nvfp4.quantize_rht_t(x.to(device), signs)
    assert_same(got, ref, f"quantize_rht_t {tuple(x.shape)} {x.dtype} {x.stride()}")


def sr_bounds(y: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Reference stochastic rounding of y [rows, N] with the reference block scales: the codes for
    r = 0 and r = 255 (the two possible outcomes) and the exact mean and variance over r."""
    _, s_dec = nvfp4.tensor_scales(amax)
    encode = nvfp4.block_encode_scales(scales, s_dec)  # [rows, N/16]
    v = (y.float().unflatten(-1, (-1, 16)) * encode[..., None]).clamp(-6, 6).flatten(-2)
    r = torch.arange(256, dtype=torch.float32).reshape(256, *([1] * v.dim())).expand(256, *v.shape)
    outcomes = formats.e2m1_encode_stochastic(v.expand(256, *v.shape), r)  # [256, rows, N]
    values = formats.e2m1_decode(outcomes)
    return (
        outcomes[0],
        outcomes[255],
        values.mean(0, dtype=torch.float64),
        values.double().var(0, correction=0),
    )


def check_stochastic(got: nvfp4.NVFP4Tensor, y: torch.Tensor, what: str) -> None:
    """``got`` = stochastic quantization of y (the already transformed input for the RHT path)."""
    nearest = nvfp4.quantize_ref(y)
    assert torch.equal(_bytes(got.scales).cpu(), _bytes(nearest.scales)), f"{what}: scales differ from RN"
    assert torch.equal(got.amax.cpu(), nearest.amax), what
    low, high, mean, var = sr_bounds(y, nearest.scales.float(), nearest.amax)
    codes = formats.unpack_nibbles(got.codes.cpu())
    ok = (codes == low) | (codes == high)
    assert bool(ok.all()), f"{what}: {int((~ok).sum())} codes are not a neighbour of the input"
    drawn = formats.e2m1_decode(codes).double()
    z = float((drawn - mean).sum() / var.sum().sqrt())
    assert abs(z) < 5.0, f"{what}: biased, z = {z:.2f}"


def check_fake_quantize(x: torch.Tensor, device: str) -> None:
    ref = nvfp4.quantize_ref(x)
    got = triton_nvfp4.fake_quantize(x.to(device), keep_codes=True)
    assert got.values.dtype == torch.bfloat16
    assert torch.equal(got.values.cpu(), ref.block_values(torch.bfloat16)), "block values"
    assert torch.equal(got.decode_scale.cpu(), ref.decode_scale), "decode scale"
    assert_same(got.quantized, ref, "fake_quantize codes")
    assert torch.equal(triton_nvfp4.block_values(got.quantized).cpu(), ref.block_values()), "block_values"


# -- CPU: the interpreter ------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_interp_quantize_matches_reference(dtype):
    seed = _seed()
    check_quantize(normal((32, 64), dtype, seed), "cpu")
    spread = 1.0 if dtype == torch.float16 else 3.0  # FP16 would overflow
    check_quantize(normal((2, 24, 80), dtype, seed + 1, spread=spread), "cpu")  # leading dims, 5 blocks
    check_quantize(normal((48, 128), dtype, seed + 2), "cpu", block_2d=True)
    check_quantize(normal((40, 32), dtype, seed + 3), "cpu", block_2d=True)  # a partial 16-row tile


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interp_adversarial_blocks(dtype):
    seed = _seed()
    x = adversarial(dtype, seed)
    check_quantize(x, "cpu")
    check_quantize(x, "cpu", block_2d=True)
    scale_bytes = nvfp4.quantize_ref(x).scales.view(torch.uint8)
    assert ((scale_bytes > 0) & (scale_bytes < 8)).any(), "no subnormal scale was exercised"


@interpreted
def test_interp_extreme_tensor_scales():
    seed = _seed()
    base = normal((16, 64), torch.float32, seed, spread=2.0)
    base[0, 0] = 1.0
    for amax in (3.0e38, 1e30, 1e-30, 1e-40):  # FLT_MAX-scale, huge, tiny, and an FP32 subnormal amax
        check_quantize(base / base.abs().max() * amax, "cpu")
    check_quantize(torch.zeros(16, 32), "cpu")
    wide = base.clone()
    wide[1] *= 1e-30  # one tensor, blocks 30 decades apart
    check_quantize(wide, "cpu")


@pytest.fixture(params=[False, True], ids=["row-loads", "wide-loads"])
def rht_loads(request, monkeypatch):
    """The RHT kernel's two ways of loading a 16-token group (``nvfp4_rht.WIDE_LOADS``): the same bits."""
    from inkling_fp4.numerics.kernels import nvfp4_rht

    monkeypatch.setattr(nvfp4_rht, "WIDE_LOADS", request.param)
    return request.param


@interpreted
def test_interp_rht_t_matches_reference(rht_loads):
    seed = _seed()
    check_rht_t(rht_exact((48, 64), torch.bfloat16, seed), "cpu")
    check_rht_t(rht_exact((32, 40), torch.float32, seed + 1), "cpu", rht_signs("random", seed=seed))
    check_rht_t(rht_exact((16, 24), torch.float16, seed + 3), "cpu")
    base = rht_exact((24, 64), torch.bfloat16, seed + 2)  # x = base.t(): a column-major [64, 24] input
    check_rht_t(base.t(), "cpu")
    zeros_and_spikes = torch.zeros(32, 16, dtype=torch.bfloat16)
    zeros_and_spikes[5, 3] = -7.0
    check_rht_t(zeros_and_spikes, "cpu")


@interpreted
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_interp_rht_t_tilings(groups, rht_loads):
    """Token groups per program, partial tiles in both dims, codes and values from one pass."""
    x = rht_exact((48, 40), torch.bfloat16, _seed())
    ref = nvfp4.quantize_rht_t_ref(x)
    bits = sign_bits(rht_signs("fixed"))
    amax = rht_t_abs_max(x, bits, block_n=32, groups=groups)
    codes = torch.empty(40, 24, dtype=torch.uint8)
    scales = torch.empty(40, 3, dtype=torch.uint8)
    values = torch.empty(40, 48, dtype=torch.bfloat16)
    quantize_rht_t_tiles(x, bits, amax, seed=None, codes=codes, scales=scales, values=values,
                         block_n=32, groups=groups)  # fmt: skip
    got = nvfp4.NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), amax.reshape(()), ref.shape)
    assert_same(got, ref, f"groups={groups}")
    assert torch.equal(values, ref.block_values()), "block values"


@interpreted
@pytest.mark.parametrize("tile", [None, (128, 1, 1), (32, 4, 1)])
def test_interp_pair_pass_equals_the_two_quantizers(tile, rht_loads, monkeypatch):
    """x's fprop row values and its saved Q(RHT(xᵀ)) from one pass: the bits of the two passes (values,
    codes, scale bytes, decode scales), the row values also the reference's; partial tiles included."""
    from inkling_fp4.numerics.kernels import nvfp4_rht

    if tile is not None:
        monkeypatch.setattr(nvfp4_rht, "QUANTIZE_TILE", tile)
    seed = _seed()
    inputs = [
        normal((48, 64), torch.bfloat16, seed, spread=3.0),
        rht_exact((32, 80), torch.float32, seed + 1),
        adversarial(torch.bfloat16, seed),
        adversarial(torch.float32, seed + 2),
    ]
    inputs[0][5, :16] = 0.0  # an all-zero row block
    for x in inputs:
        amax, amax_t = triton_nvfp4.abs_max_pair(x)
        rows, tokens = triton_nvfp4.fake_quantize_pair(x, amax, amax_t)
        want_rows = triton_nvfp4.fake_quantize(x, amax=amax)
        want_t = triton_nvfp4.fake_quantize_rht_t(x, keep_codes=True, dtype=None, amax=amax_t)
        assert torch.equal(rows.values, want_rows.values), "row values"
        assert torch.equal(rows.values, nvfp4.quantize_ref(x).block_values(torch.bfloat16)), "reference"
        assert torch.equal(rows.decode_scale, want_rows.decode_scale), "row decode scale"
        assert rows.quantized is None and tokens.values is None
        assert_same(tokens.quantized, want_t.quantized, "rht codes")
        assert torch.equal(tokens.decode_scale, want_t.decode_scale), "rht decode scale"


@interpreted
def test_interp_pair_pass_of_a_gradient_draws_as_the_two_quantizers():
    """dy's pair (stochastic rounding both ways, values both ways, each with its GEMM partner's scale):
    with the generator in the same state, the two calls' draws and bits, output scales included."""
    seed = _seed()
    dy = normal((64, 48), torch.bfloat16, seed, spread=2.0)
    partners = (torch.tensor(0.37), torch.tensor(3.0e-3))
    for stochastic in ((True, True), (True, False), (False, True)):
        amax, amax_t = triton_nvfp4.abs_max_pair(dy)
        g = torch.Generator().manual_seed(seed)
        rows, tokens = triton_nvfp4.fake_quantize_pair(
            dy, amax, amax_t, stochastic=stochastic, generator=g, keep_codes_t=False, scale_with=partners
        )
        g.manual_seed(seed)
        want_rows = triton_nvfp4.fake_quantize(
            dy, stochastic=stochastic[0], generator=g, amax=amax, scale_with=partners[0]
        )
        want_t = triton_nvfp4.fake_quantize_rht_t(
            dy, stochastic=stochastic[1], generator=g, amax=amax_t, scale_with=partners[1]
        )
        for got, want in ((rows, want_rows), (tokens, want_t)):
            assert torch.equal(got.values, want.values), stochastic
            assert torch.equal(got.decode_scale, want.decode_scale)
            assert torch.equal(got.output_scale, want.output_scale)
        assert tokens.quantized is None
        if stochastic == (True, True):
            both = rows, tokens
    g.manual_seed(seed + 1)  # another seed: other draws in both halves, so the draws above were compared
    other = triton_nvfp4.fake_quantize_pair(dy, amax, amax_t, stochastic=(True, True), generator=g,
                                            keep_codes_t=False)  # fmt: skip
    for got, before in zip(other, both, strict=True):
        assert not torch.equal(got.values, before.values)


@interpreted
def test_interp_pair_pass_edges():
    empty = torch.zeros(0, 32, dtype=torch.bfloat16)
    rows, tokens = triton_nvfp4.fake_quantize_pair(empty, *triton_nvfp4.abs_max_pair(empty))
    assert rows.values.shape == (0, 32) and tokens.quantized.shape == (32, 0)
    x = torch.ones(24, 32)
    with pytest.raises(NumericsError, match="first dim 24"):
        triton_nvfp4.fake_quantize_pair(x, torch.ones(()), torch.ones(()))
    bad = torch.ones(16, 32)
    bad[3, 4] = float("inf")
    with pytest.raises(NumericsError):
        triton_nvfp4.fake_quantize_pair(bad, *triton_nvfp4.abs_max_pair(bad))


@interpreted
def test_interp_module_tiles_steer_the_launchers(monkeypatch):
    """The tiles a benchmark sets (several features or rows a thread, partial tiles) give the
    reference's bits through the launchers' defaults, stochastic rounding the default tile's draws."""
    from inkling_fp4.numerics.kernels import nvfp4_quantize, nvfp4_rht

    x = rht_exact((48, 40), torch.bfloat16, _seed())
    xr = x[:, :32].contiguous()  # rows: blocks of 16 along the features
    sr_default = triton_nvfp4.fake_quantize_rht_t(
        x, stochastic=True, generator=torch.Generator().manual_seed(3)
    )
    rows_sr_default = triton_nvfp4.fake_quantize(
        xr, stochastic=True, generator=torch.Generator().manual_seed(3)
    )
    monkeypatch.setattr(nvfp4_rht, "QUANTIZE_TILE", (128, 1, 1))
    monkeypatch.setattr(nvfp4_rht, "AMAX_TILE", (64, 2, 1))
    monkeypatch.setattr(nvfp4_quantize, "ROW_TILE", (4, 64, 1))
    launched = []  # (kernel, tile) of each launch: the attributes reach the launches

    class Spy:
        def __init__(self, kernel, keys):
            self.kernel, self.keys = kernel, keys

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append((self.kernel.fn.__name__, kw.get("AMAX_ONLY"), *(kw[k] for k in self.keys)))
                return self.kernel[grid](*args, **kw)

            return launch

    monkeypatch.setattr(
        nvfp4_rht, "_rht_kernel", Spy(nvfp4_rht._rht_kernel, ("BLOCK_N", "GROUPS", "num_warps"))
    )
    rows_kernel = nvfp4_quantize._quantize_rows_kernel
    monkeypatch.setattr(
        nvfp4_quantize, "_quantize_rows_kernel", Spy(rows_kernel, ("BLOCK_M", "BLOCK_N", "num_warps"))
    )
    got = triton_nvfp4.fake_quantize_rht_t(x, keep_codes=True)
    assert launched == [("_rht_kernel", True, 64, 2, 1), ("_rht_kernel", False, 128, 1, 1)], launched
    ref = nvfp4.quantize_rht_t_ref(x)
    assert_same(got.quantized, ref, "rht under other tiles")
    assert torch.equal(got.values, ref.block_values()), "rht values under other tiles"
    rows = triton_nvfp4.fake_quantize(xr, keep_codes=True)
    assert launched[-1] == ("_quantize_rows_kernel", None, 4, 64, 1), launched
    assert_same(rows.quantized, nvfp4.quantize_ref(xr), "rows under another tile")
    sr = triton_nvfp4.fake_quantize_rht_t(x, stochastic=True, generator=torch.Generator().manual_seed(3))
    rows_sr = triton_nvfp4.fake_quantize(xr, stochastic=True, generator=torch.Generator().manual_seed(3))
    assert torch.equal(sr.values, sr_default.values), "stochastic rht draws depend on the tile"
    assert torch.equal(rows_sr.values, rows_sr_default.values), "stochastic row draws depend on the tile"


@interpreted
def test_interp_fake_quantize_and_block_values():
    seed = _seed()
    check_fake_quantize(normal((32, 64), torch.bfloat16, seed), "cpu")
    check_fake_quantize(adversarial(torch.float32, seed), "cpu")
    x = rht_exact((32, 48), torch.bfloat16, seed + 1)
    ref = nvfp4.quantize_rht_t_ref(x)
    got = triton_nvfp4.fake_quantize_rht_t(x, keep_codes=True)
    assert torch.equal(got.values, ref.block_values()), "rht block values"
    assert torch.equal(got.decode_scale, ref.decode_scale)
    assert_same(got.quantized, ref, "fake_quantize_rht_t codes")
    only_values = triton_nvfp4.fake_quantize(x, block_2d=True)
    assert only_values.quantized is None
    assert torch.equal(only_values.values, nvfp4.quantize_ref(x, block_2d=True).block_values())


@interpreted
def test_interp_abs_max_pair_serves_both_quantizers():
    """One read of x gives max |x| and max |rht(x.t())|; quantizing with them equals quantizing alone."""
    seed = _seed()
    x = rht_exact((48, 32), torch.bfloat16, seed)
    signs = rht_signs("random", seed % 1000)
    amax_x, amax_t = triton_nvfp4.abs_max_pair(x, signs)
    ref_rows, ref_t = nvfp4.quantize_ref(x), nvfp4.quantize_rht_t_ref(x, signs)
    assert torch.equal(amax_x, ref_rows.amax) and torch.equal(amax_t, ref_t.amax), f"seed={seed}"
    rows = triton_nvfp4.fake_quantize(x, keep_codes=True, amax=amax_x)
    assert_same(rows.quantized, ref_rows, "rows with a shared amax")
    cols = triton_nvfp4.fake_quantize_rht_t(x, signs, keep_codes=True, dtype=None, amax=amax_t)
    assert cols.values is None
    assert_same(cols.quantized, ref_t, "rht_t codes only, with a shared amax")
    x[5, 3] = float("nan")
    assert all(torch.isinf(a) for a in triton_nvfp4.abs_max_pair(x)), "NaN must surface in both amaxes"
    bad = triton_nvfp4.fake_quantize(x, check_finite=False)  # the caller checks the amax later
    assert torch.isinf(bad.amax)


@interpreted
def test_interp_stochastic_rounding(rht_loads):
    seed = _seed()
    x = normal((64, 64), torch.bfloat16, seed)
    gen = torch.Generator().manual_seed(seed)
    check_stochastic(triton_nvfp4.quantize(x, stochastic=True, generator=gen), x, f"rows seed={seed}")
    xr = rht_exact((64, 48), torch.bfloat16, seed + 1)
    got = triton_nvfp4.quantize_rht_t(xr, stochastic=True, generator=gen)
    check_stochastic(got, nvfp4.rht(xr.t().contiguous()), f"rht seed={seed}")
    # One value per block position, 3/8 of a step above a grid point: P(up) = 96/256 exactly.
    flat = torch.full((64, 64), 1.0 + 0.375 * 0.5)
    flat[:, ::16] = 6.0  # block amax 6 -> scale 1, so v = 1.1875 between 1 and 1.5
    flat[0, 0] = 2688.0  # S_enc = 1
    up = formats.unpack_nibbles(triton_nvfp4.quantize(flat, stochastic=True, generator=gen).codes) == 3
    samples = up[1:].unflatten(1, (4, 16))[:, :, 1:]  # rows and elements with v = 1.1875
    rate, p = samples.float().mean().item(), 96 / 256
    assert abs(rate - p) < 5 * (p * (1 - p) / samples.numel()) ** 0.5, f"round-up rate {rate}, expected {p}"


@interpreted
def test_interp_stochastic_is_reproducible():
    x = normal((16, 32), torch.float32, _seed())
    a = triton_nvfp4.quantize(x, stochastic=True, generator=torch.Generator().manual_seed(1))
    b = triton_nvfp4.quantize(x, stochastic=True, generator=torch.Generator().manual_seed(1))
    c = triton_nvfp4.quantize(x, stochastic=True, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, c.codes)


@interpreted
def test_interp_non_finite_inputs():
    x = normal((16, 32), torch.bfloat16, _seed())
    x[3, 7] = float("nan")
    assert torch.isinf(triton_nvfp4.quantize(x).amax), "NaN must surface as a non-finite amax"
    with pytest.raises(NumericsError, match="non-finite"):
        triton_nvfp4.fake_quantize(x, name="x")
    x[3, 7] = float("-inf")
    with pytest.raises(NumericsError, match="non-finite"):
        triton_nvfp4.fake_quantize_rht_t(x, name="x")
    assert torch.isinf(triton_nvfp4.quantize_rht_t(x).amax)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().reshape(-1).view(torch.int32)


def check_decode_and_output_scales(device: str) -> None:
    """The quantize passes write 1/S_enc (and its product with a partner's decode scale) bit for bit
    as ``nvfp4.tensor_scales`` (of the pass's amax) and one FP32 multiply compute them, over tensor
    amaxes from 0 and subnormal to near FLT_MAX, and partners whose product is subnormal or overflows."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(16, 32, generator=g)
    cases = {
        "random": base * 3,
        "zeros": torch.zeros(16, 32),
        "equal": torch.full((16, 32), -0.7),
        "huge": base * 3e37,
        "tiny": base * 1e-38,
        "subnormal": base * 1e-42,
        "wide": base * torch.logspace(-30, 30, 32),
    }
    partners = [None] + [torch.tensor(p, device=device) for p in (1.0, 3.0e-39, 1.0e30, float("inf"))]
    quantizers = (
        lambda x, **kw: triton_nvfp4.fake_quantize(x, keep_codes=True, **kw),
        lambda x, **kw: triton_nvfp4.fake_quantize(x, block_2d=True, **kw),
        lambda x, **kw: triton_nvfp4.fake_quantize_rht_t(x, dtype=None, **kw),
    )
    for i, (label, x) in enumerate(cases.items()):
        for j, quantize in enumerate(quantizers):  # each case, quantizer and partner meet in turn
            dtype, partner = (torch.float32, torch.bfloat16)[i % 2], partners[(i + j) % len(partners)]
            gen = torch.Generator().manual_seed(seed)
            xd = x.to(device, dtype)
            fused = quantize(xd, stochastic=j == 0, generator=gen, scale_with=partner, check_finite=False)
            what = f"{label} {dtype} quantizer {j} partner={partner} seed={seed}"
            if j < 2:
                assert torch.equal(fused.amax.cpu(), nvfp4.quantize_ref(x.to(dtype)).amax), what
            s_dec = nvfp4.tensor_scales(fused.amax)[1]
            assert fused.decode_scale.shape == (), what
            assert torch.equal(_bits(fused.decode_scale), _bits(s_dec)), what
            if partner is None:
                assert fused.output_scale is None, what
            else:
                assert torch.equal(_bits(fused.output_scale), _bits(s_dec * partner)), what
                assert torch.equal(_bits(fused.output_scale), _bits(partner * s_dec)), what
    empty = triton_nvfp4.fake_quantize(torch.zeros(0, 32, device=device), scale_with=partners[1] / 2)
    assert float(empty.decode_scale) == 1.0 and float(empty.output_scale) == 0.5


@interpreted
def test_interp_decode_and_output_scales_equal_the_reference():
    check_decode_and_output_scales("cpu")


@interpreted
def test_interp_device_seed_equals_the_host_seed():
    """Inside a CUDA graph the quantizers derive their seed on the device from (base word, delta); it
    must be the eager formula's seed bit for bit, for generator seeds whose products wrap mod 2^64:
    the same codes, rows and RHT tiles, NVFP4 and MXFP4."""
    from inkling_fp4.numerics.kernels import mxfp4_quantize, seeds

    rng = random.Random(_seed())
    x = normal((32, 64), torch.float32, rng.randrange(2**31))
    bits = sign_bits(rht_signs("fixed"))
    for _ in range(3):
        initial, first, draw = rng.randrange(2**64), rng.randrange(0, 2**40, 4), rng.randrange(0, 400, 4)
        host = seeds.SEED_FLOOR + seeds.mix64((initial * seeds.PHI + first + draw) % 2**64) % seeds.SEED_SPAN
        base = (initial * seeds.PHI + first) % 2**64
        device = seeds.DeviceSeed(
            torch.tensor([base - 2**64 if base >= 2**63 else base]), seeds.SEED_FLOOR + draw
        )
        outs = []
        for seed in (host, device):
            amax = triton_nvfp4.abs_max(x)
            codes, scales = torch.empty(32, 32, dtype=torch.uint8), torch.empty(32, 4, dtype=torch.uint8)
            quantize_rows(x, amax, block_2d=False, seed=seed, codes=codes, scales=scales, values=None)
            t_codes, t_scales = torch.empty(64, 16, dtype=torch.uint8), torch.empty(64, 2, dtype=torch.uint8)
            amax_t = rht_t_abs_max(x, bits)
            quantize_rht_t_tiles(x, bits, amax_t, seed=seed, codes=t_codes, scales=t_scales, values=None)
            mx_codes, mx_scales = (
                torch.empty(32, 32, dtype=torch.uint8),
                torch.empty(32, 2, dtype=torch.uint8),
            )
            mxfp4_quantize.quantize_rows(x, mx_codes, mx_scales, seed=seed)
            row_values = torch.empty(32, 64, dtype=torch.bfloat16)  # the pair pass's row seed
            rows = RowValues(row_values, amax, torch.empty(1), seed=seed)
            quantize_rht_t_tiles(x, bits, amax_t, seed=None, codes=None, scales=None, values=None, rows=rows)
            outs.append((codes, t_codes, mx_codes, row_values))
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b), (initial, first, draw)
    with pytest.raises(RuntimeError, match="CUDA generator"):
        with seeds.capturing(seeds.GraphSeeds(torch.device("cpu"))):
            triton_nvfp4.quantize(x, stochastic=True, generator=torch.Generator().manual_seed(1))


@interpreted
def test_interp_amax_words_are_fresh_zeros(monkeypatch):
    """Each amax pass gets zeroed words nobody else uses, across refills of the pool: a word that was
    reused would keep an earlier, larger maximum."""
    from inkling_fp4.numerics.kernels import amax as amax_module

    monkeypatch.setattr(amax_module, "POOL_WORDS", 5)
    monkeypatch.setattr(amax_module, "_pools", {})
    seed = _seed()
    words = [amax_module.zeroed_words(n, torch.device("cpu")) for n in (1, 2, 2, 3, 1, 6)]
    assert all(not w.any() for w in words) and [w.numel() for w in words] == [1, 2, 2, 3, 1, 6]
    spans = {
        (w.untyped_storage().data_ptr(), w.storage_offset() + i) for w in words for i in range(w.numel())
    }
    assert len(spans) == 15, "zeroed words must never overlap"
    before = amax_module.zeroed_words(1, torch.device("cpu"))
    amax_module.start_new_pool(torch.device("cpu"))  # what a CUDA graph capture does first and last
    after = amax_module.zeroed_words(1, torch.device("cpu"))
    assert after.untyped_storage().data_ptr() != before.untyped_storage().data_ptr() and not after.any()
    x = normal((32, 64), torch.bfloat16, seed)
    for scale in (1e6, 1.0, 0.0):
        xs = x * scale
        assert torch.equal(triton_nvfp4.fake_quantize(xs).amax, nvfp4.quantize_ref(xs).amax), scale
        pair = triton_nvfp4.abs_max_pair(xs)
        assert torch.equal(pair[0], nvfp4.quantize_ref(xs).amax), scale
        assert torch.equal(pair[1], nvfp4.quantize_rht_t_ref(xs).amax), scale


@pytest.mark.slow
def test_under_triton_interpreter():
    """Run every ``test_interp_*`` in a child process with TRITON_INTERPRET=1 (about 20 s)."""
    run_interpreted(__file__, "-k", "interp")


# -- CPU: no kernel launch -----------------------------------------------------------------------------


def test_available_follows_device_and_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert available() == torch.cuda.is_available()


def test_launch_arguments_are_validated():
    with pytest.raises(ValueError, match="16 values"):
        sign_bits(torch.tensor([1.0] * 15 + [0.5]))
    assert sign_bits(torch.tensor([-1.0] + [1.0] * 14 + [-1.0])) == 1 | (1 << 15)
    x = torch.zeros(32, 32)
    with pytest.raises(ValueError, match="groups"):
        quantize_rht_t_tiles(x, 0, x, seed=None, codes=None, scales=None, values=None, groups=3)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_rows(x, x, block_2d=True, seed=None, codes=None, scales=None, values=None, block_m=8)
    with pytest.raises(ValueError, match="multiple of 16"):
        rht_t_abs_max(torch.zeros(20, 16), 0)


# -- GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_kernels_match_reference(dtype, rht_loads):
    seed = _seed()
    check_quantize(normal((1024, 4096), dtype, seed, spread=2.0), "cuda")
    check_quantize(normal((1024, 2048), dtype, seed + 1), "cuda", block_2d=True)
    check_quantize(adversarial(dtype, seed), "cuda")
    check_quantize(adversarial(dtype, seed), "cuda", block_2d=True)
    for amax in (3.0e38, 1e-30, 1e-40):
        x = normal((64, 256), torch.float32, seed + 2)
        check_quantize((x / x.abs().max() * amax).to(dtype), "cuda")
    check_rht_t(rht_exact((2048, 1536), dtype, seed + 3), "cuda")
    check_rht_t(
        rht_exact((4096, 512), dtype, seed + 4).t().contiguous().t(), "cuda", rht_signs("random", seed)
    )
    check_fake_quantize(normal((512, 1024), dtype, seed + 5), "cuda")


@pytest.mark.gpu
@on_gpu
def test_gpu_stochastic_and_dispatch(rht_loads):
    seed = _seed()
    x = normal((128, 512), torch.bfloat16, seed)
    gen = torch.Generator().manual_seed(seed)
    check_stochastic(triton_nvfp4.quantize(x.cuda(), stochastic=True, generator=gen), x, f"rows seed={seed}")
    xr = rht_exact((512, 256), torch.bfloat16, seed + 1)
    got = triton_nvfp4.quantize_rht_t(xr.cuda(), stochastic=True, generator=gen)
    check_stochastic(got, nvfp4.rht(xr.t().contiguous()), f"rht seed={seed}")
    # nvfp4.quantize on CUDA tensors goes through the kernels and checks finiteness itself.
    assert_same(nvfp4.quantize(x.cuda()), nvfp4.quantize_ref(x), "dispatch")
    assert_same(nvfp4.quantize_rht_t(xr.cuda()), nvfp4.quantize_rht_t_ref(xr), "dispatch rht")
    x[0, 0] = float("nan")
    with pytest.raises(NumericsError):
        nvfp4.quantize(x.cuda())


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("tile", [None, (128, 2, 2), (256, 1, 2)])
def test_gpu_pair_pass_equals_the_two_quantizers(tile, rht_loads, monkeypatch):
    """At a training shape on the GPU: x's pair pass gives the two passes' bits, under other tiles too."""
    from inkling_fp4.numerics.kernels import nvfp4_rht

    if tile is not None:
        monkeypatch.setattr(nvfp4_rht, "QUANTIZE_TILE", tile)
    x = normal((4096, 1024), torch.bfloat16, _seed(), spread=2.0).cuda()
    amax, amax_t = triton_nvfp4.abs_max_pair(x)
    rows, tokens = triton_nvfp4.fake_quantize_pair(x, amax, amax_t)
    assert torch.equal(rows.values, triton_nvfp4.fake_quantize(x, amax=amax).values)
    want = triton_nvfp4.fake_quantize_rht_t(x, keep_codes=True, dtype=None, amax=amax_t)
    assert_same(tokens.quantized, want.quantized, "pair rht")
    assert torch.equal(rows.values.cpu(), nvfp4.quantize_ref(x.cpu()).block_values(torch.bfloat16))
    partners = (torch.tensor(0.5, device="cuda"), torch.tensor(2.0e-3, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(7)
    rows, tokens = triton_nvfp4.fake_quantize_pair(
        x, amax, amax_t, stochastic=(True, True), generator=g, keep_codes_t=False, scale_with=partners
    )
    g.manual_seed(7)
    want_rows = triton_nvfp4.fake_quantize(x, stochastic=True, generator=g, amax=amax, scale_with=partners[0])
    want_t = triton_nvfp4.fake_quantize_rht_t(
        x, stochastic=True, generator=g, amax=amax_t, scale_with=partners[1]
    )
    assert torch.equal(rows.values, want_rows.values) and torch.equal(tokens.values, want_t.values)
    assert torch.equal(rows.output_scale, want_rows.output_scale)


@pytest.mark.gpu
@on_gpu
def test_gpu_decode_and_output_scales_equal_torch():
    """On CUDA too, the kernel-written 1/S_enc and output scales equal torch's eager computation."""
    check_decode_and_output_scales("cuda")


@pytest.mark.gpu
@on_gpu
def test_gpu_seed_follows_cuda_generator_state():
    """Seeds from a CUDA generator come from its host-side (seed, offset): fresh per draw, replayed
    after ``manual_seed``, no device read."""
    from inkling_fp4.numerics.kernels import seeds

    gen = torch.Generator(device="cuda").manual_seed(5)
    first = [seeds.draw_seed(gen) for _ in range(3)]
    assert len(set(first)) == 3 and all(2**32 <= s < 2**62 for s in first)
    gen.manual_seed(5)
    assert [seeds.draw_seed(gen) for _ in range(3)] == first
    # captured draws: device seeds whose replays give the same seeds and leave the same generator state
    gen.manual_seed(5)
    graph_seeds = seeds.GraphSeeds(torch.device("cuda"))
    with seeds.capturing(graph_seeds):
        captured = [seeds.draw_seed(gen) for _ in range(3)]
    assert gen.get_offset() == 0, "a capture does not move the generator: its replays do"
    assert [d.delta for d in captured] == [2**32, 2**32 + 4, 2**32 + 8]
    for replay in range(2):
        graph_seeds.before_replay()
        assert gen.get_offset() == 12 * (replay + 1)
        base = graph_seeds.base.item() % 2**64
        want = [seeds.seed_at(gen, 12 * replay + 4 * i) for i in range(3)]
        got = [
            seeds.SEED_FLOOR + seeds.mix64((base + d.delta - 2**32) % 2**64) % seeds.SEED_SPAN
            for d in captured
        ]
        assert got == want

"""The Triton FP8 quantizers (numerics/kernels/fp8_quantize.py) against the torch reference (fp8.py).

Every output must equal the reference bit for bit: FP8 bytes, FP32 scale_inv. Inputs are fresh random
each run (the seed is printed with a failure) plus adversarial ones: zero blocks, ±0, a huge dynamic
range, subnormal results, values at the format's max, E4M3 and E5M2.

Where the kernels run: on CPU under the Triton interpreter (``test_interp_*``, small shapes, in a child
pytest process with TRITON_INTERPRET=1, as in test_kernels_nvfp4.py), and on CUDA (``@pytest.mark.gpu``)
through the public dispatch of ``fp8.quantize_*`` at training-like shapes.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from bits import same_bits
from interpreter import interpreted, run_interpreted

pytest.importorskip("triton")

from inkling_fp4.numerics import fp8  # noqa: E402
from inkling_fp4.numerics.kernels import fp8_quantize as kern  # noqa: E402
from inkling_fp4.numerics.kernels.amax import abs_max  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def _input(m: int, n: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    seed = random.randrange(2**31)
    print(f"input seed = {seed}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g) * torch.pow(10.0, torch.empty(m, 1).uniform_(-20, 20, generator=g))
    b = min(n, 128)
    x[0, :b] = 0.0  # a zero block (scale 1)
    x[1, :b] = -0.0
    x[2, :b] = (torch.linspace(-1e-3, 1e-3, 128) * torch.tensor([1.0, 1e-6]).repeat(64))[:b]  # subnormals
    x[3, 0] = 3.0e38  # near FLT_MAX
    return x.to(dtype).to(device)


def check_all(x: torch.Tensor, dtype: torch.dtype, **launch) -> None:
    """Every kernel mode against the reference on x [M, N] (M a multiple of 128 for the transposed).
    ``launch``: ``hardware_cast`` and / or ``config`` for ``quantize_fp8``."""
    hw = launch
    ref = fp8.quantize_blockwise_ref(x, (1, 128), dtype)
    out = kern.quantize_fp8(x, dtype, mode=kern.MODE_BLOCKS, rows=True, cols=True, **hw)
    same_bits(out["data"], ref.data, "1x128 data")
    same_bits(out["scale_inv"], ref.scale_inv, "1x128 scale_inv")
    ref_t = fp8.quantize_blockwise_t_ref(x, dtype)
    same_bits(out["data_t"], ref_t.data, "1x128 transposed data")
    same_bits(out["scale_inv_t"], ref_t.scale_inv, "1x128 transposed scale_inv")
    part = x[: x.shape[0] - 37]  # a partial last 128-row tile
    ref = fp8.quantize_blockwise_ref(part, (128, 128), dtype)
    out = kern.quantize_fp8(part, dtype, mode=kern.MODE_TILE, **hw)
    same_bits(out["data"], ref.data, "128x128 data")
    same_bits(out["scale_inv"], ref.scale_inv, "128x128 scale_inv")
    ref = fp8.quantize_tensorwise_ref(x, dtype)
    out = kern.quantize_fp8(x, dtype, mode=kern.MODE_TENSOR, rows=True, cols=True, amax=abs_max(x), **hw)
    same_bits(out["data"], ref.data, "tensorwise data")
    same_bits(out["data_t"], ref.data.t(), "tensorwise transposed data")
    same_bits(out["scale_inv"], ref.scale_inv, "tensorwise scale_inv")


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interp_all_modes_equal_reference(dtype, src_dtype):
    check_all(_input(128, 256, dtype=src_dtype), dtype)


@interpreted
def test_interp_nan_gives_inf_scale_and_odd_width_tensorwise():
    x = _input(128, 128)
    x[5, 7] = float("nan")
    out = kern.quantize_fp8(x, torch.float8_e4m3fn, mode=kern.MODE_BLOCKS, rows=True, cols=True)
    assert torch.isinf(out["scale_inv"][5, 0]) and torch.isinf(out["scale_inv_t"][7, 0])
    assert torch.isfinite(out["scale_inv"][6, 0])
    y = _input(40, 48)  # tensorwise takes any width
    ref = fp8.quantize_tensorwise_ref(y, torch.float8_e5m2)
    out = kern.quantize_fp8(y, torch.float8_e5m2, mode=kern.MODE_TENSOR, amax=abs_max(y))
    same_bits(out["data"], ref.data, "tensorwise data, N=48")


def check_delayed(x: torch.Tensor, dtype: torch.dtype, **launch) -> None:
    """Delayed scaling: the scale from a given amax (below max|x|: the largest values saturate; above
    it; zero: scale 1), the pair's bytes against the reference and against the formula written out
    here, and the record word: max(its old value, max|x|), from the "nothing yet" -1 and from above."""
    fp8_max = fp8.FP8_MAX[dtype]
    own = x.cpu().float().abs().amax()
    givens = (own / 64, (own * 3).clamp(max=3.4e38), torch.zeros(()))
    # one launch per amax, each with another start of the record: the bytes depend on the amax alone,
    # the record on its start alone
    for given, start in zip(givens, (-1.0, float(own) / 2, float("inf")), strict=True):
        amax = given.reshape(1).to(torch.float32).to(x.device)
        record = torch.full((1,), start, device=x.device)
        out = kern.quantize_fp8(
            x, dtype, mode=kern.MODE_TENSOR, rows=True, cols=True, amax=amax, record=record, **launch
        )
        ref = fp8.quantize_tensorwise_ref(x.cpu(), dtype, amax=amax.cpu())
        scale = torch.tensor(fp8_max) / given if given > 0 else torch.tensor(1.0)
        by_hand = (x.cpu().float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
        what = f"delayed amax {float(given):.3g}"
        same_bits(ref.data, by_hand, f"{what}: reference vs the formula")
        same_bits(out["data"], ref.data, f"{what} data")
        same_bits(out["data_t"], ref.data.t(), f"{what} transposed data")
        same_bits(out["scale_inv"], ref.scale_inv, f"{what} scale_inv")
        assert record.item() == max(start, float(own)), (what, start, record.item(), float(own))
        if given == own / 64:  # the values above the delayed amax are clamped to the format's max
            big = x.cpu().float().abs() > float(given)
            codes = out["data"].cpu().float().abs()
            assert big.any() and (codes[big] == fp8_max).all(), what


def _narrow_input(m: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """x [M, N] with N % 128 != 0, the adversarial cases also inside the last, partial block."""
    x = _input(m, n).float()
    last = n - n % 128  # first column of the partial block
    x[4, last:] = 0.0  # a partial block of zeros: amax 0 with its padding, scale 1
    ties = torch.arange(1, n - last + 1) / 64.0  # k/64: ties of E4M3 at scale 1, of E5M2 at 128
    x[5, last:] = ties
    x[5, last] = 448.0  # block amax 448: scale 1 (E4M3), 128 (E5M2), both exact
    x[6, n - 1] = -3.0e38  # the huge value sits next to the padding
    x[7, last:] = torch.linspace(-1e-42, 1e-42, n - last)  # FP32 subnormals
    return x.to(dtype)


def check_padded(x: torch.Tensor, dtype: torch.dtype) -> None:
    """Blocked modes with ``pad_to_block`` against the reference on the zero-padded x; the transposed
    output alone needs no padding and is checked unpadded."""
    xp = F.pad(x, (0, -x.shape[1] % 128))
    out = kern.quantize_fp8(x, dtype, mode=kern.MODE_BLOCKS, rows=True, cols=True, pad_to_block=True)
    ref, ref_t = fp8.quantize_blockwise_ref(xp, (1, 128), dtype), fp8.quantize_blockwise_t_ref(xp, dtype)
    same_bits(out["data"], ref.data, "padded 1x128 data")
    same_bits(out["scale_inv"], ref.scale_inv, "padded 1x128 scale_inv")
    same_bits(out["data_t"], ref_t.data, "padded 1x128 transposed data")
    same_bits(out["scale_inv_t"], ref_t.scale_inv, "padded 1x128 transposed scale_inv")
    n = x.shape[1]
    assert not out["data"][:, n:].view(torch.uint8).any() and not out["data_t"][n:].view(torch.uint8).any()
    assert bool((out["scale_inv_t"][n:] == 1.0).all())  # pad-only blocks: amax 0, scale 1
    assert out["scale_inv"].stride() == (1, x.shape[0]) and out["scale_inv_t"].stride() == (1, xp.shape[1])
    out = kern.quantize_fp8(x, dtype, mode=kern.MODE_BLOCKS, rows=False, cols=True)
    ref_t = fp8.quantize_blockwise_t_ref(x, dtype)
    same_bits(out["data_t"], ref_t.data, "unpadded transposed data (cols only)")
    same_bits(out["scale_inv_t"], ref_t.scale_inv, "unpadded transposed scale_inv (cols only)")
    part = x[: x.shape[0] - 37]
    out = kern.quantize_fp8(part, dtype, mode=kern.MODE_TILE, pad_to_block=True)
    ref = fp8.quantize_blockwise_ref(F.pad(part, (0, -n % 128)), (128, 128), dtype)
    same_bits(out["data"], ref.data, "padded 128x128 data")
    same_bits(out["scale_inv"], ref.scale_inv, "padded 128x128 scale_inv")


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(128, 160), (256, 200), (128, 288)], ids=str)
def test_interp_padded_width_equals_reference_of_padded_input(shape, dtype):
    check_padded(_narrow_input(*shape, dtype=torch.bfloat16 if shape[1] == 200 else torch.float32), dtype)


@interpreted
def test_interp_padded_width_nan_and_contract():
    x = _narrow_input(128, 160)
    x[9, 150] = float("nan")  # in the partial block, beside the padding
    out = kern.quantize_fp8(x, torch.float8_e4m3fn, mode=kern.MODE_BLOCKS, cols=True, pad_to_block=True)
    assert torch.isinf(out["scale_inv"][9, 1]) and torch.isinf(out["scale_inv_t"][150, 0])
    assert torch.isfinite(out["scale_inv"][9, 0]) and torch.isfinite(out["scale_inv_t"][151:]).all()
    for kw in (dict(mode=kern.MODE_BLOCKS), dict(mode=kern.MODE_TILE)):  # no padding asked: an error
        with pytest.raises(ValueError, match="128-element blocks"):
            kern.quantize_fp8(x, torch.float8_e4m3fn, **kw)
    with pytest.raises(ValueError, match="tensorwise"):
        kern.quantize_fp8(x, torch.float8_e4m3fn, mode=kern.MODE_TENSOR, amax=abs_max(x), pad_to_block=True)
    with pytest.raises(ValueError, match="128-element blocks"):  # tokens blocked: M % 128 still needed
        kern.quantize_fp8(x[:100], torch.float8_e4m3fn, mode=kern.MODE_BLOCKS, cols=True, pad_to_block=True)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [(8, 32), *kern.CANDIDATES], ids=str)
def test_interp_every_code_and_tie(dtype, config):
    """Each (warps, CHUNK) the GPU may pick, and the interpreter's: CHUNK 128 keeps the tile in registers."""
    check_all(_every_code_and_tie(dtype), dtype, config=config)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_delayed_scale_and_amax_record(dtype):
    check_delayed(_input(128, 200, dtype=torch.bfloat16), dtype)
    x = _input(128, 128)
    x[9, 3] = float("nan")  # NaN records as Inf: the step's history entry is then dropped
    record = torch.full((1,), -1.0)
    kern.quantize_fp8(
        x, dtype, mode=kern.MODE_TENSOR, rows=True, cols=True, amax=torch.ones(1), record=record
    )  # fmt: skip
    assert torch.isinf(record).all()


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_tensorwise_dispatch_body(dtype):
    """What quantize_tensorwise(_pair) run on CUDA (the amax pass or a delayed amax, the kernel, the
    finiteness check), here on the CPU under the interpreter, against the reference."""
    x = _input(128, 96, dtype=torch.bfloat16)
    x[3, 0] = 1e30  # keep the bf16 range
    for amax in (None, x.float().abs().amax().reshape(1) / 8):
        record = torch.full((1,), -1.0)
        out = fp8._tensorwise_kernel(x, dtype, "op", "x", True, amax, record, cols=True)
        ref = fp8.quantize_tensorwise_ref(x, dtype, amax=amax)
        same_bits(out["data"], ref.data, f"amax {amax}")
        same_bits(out["data_t"], ref.data.t(), f"amax {amax} transposed")
        assert record.item() == x.float().abs().max().item()
    bad = x.clone()
    bad[5, 5] = float("nan")
    with pytest.raises(Exception, match="non-finite"):  # checked from x's own amax, delayed or not
        fp8._tensorwise_kernel(bad, dtype, "op", "x", True, torch.ones(1), None, cols=False)


def test_under_triton_interpreter():
    """Run every ``test_interp_*`` in a child process with TRITON_INTERPRET=1."""
    run_interpreted(__file__, "-k", "interp")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_kernels_equal_reference(dtype):
    x = _input(1024, 1536, device="cuda", dtype=torch.bfloat16)
    check_all(x, dtype)


def _every_code_and_tie(dtype: torch.dtype) -> torch.Tensor:
    """FP32 [256, 128]: every finite value of ``dtype``, every midpoint between neighbours (a tie) and
    the FP32 values just above and below each midpoint, with both signs, shuffled, zero-filled. The
    format's max is among them, so the tensorwise scale is exactly 1 and each value hits its code."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = values[torch.isfinite(values) & (values >= 0)].unique()  # sorted, 0 .. max
    mid = (grid[1:] + grid[:-1]) / 2  # exact in FP32
    near = [torch.nextafter(mid, torch.tensor(float(s) * 1e9)) for s in (1, -1)]
    v = torch.cat([grid, mid, *near])
    v = torch.cat([v, -v])
    x = torch.zeros(256 * 128)
    x[: v.numel()] = v
    return x[torch.randperm(x.numel())].reshape(256, 128)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hardware_cast", [True, False], ids=["instruction", "integer"])
def test_gpu_every_code_and_tie_either_conversion(dtype, hardware_cast):
    """The conversion instruction and the integer bytes against the reference, on every code and tie
    (FP32, and rounded to BF16, whose transposed bytes take another path) and random FP32 and BF16
    input, current and delayed scaling, for every (warps, CHUNK) the autotuner may pick."""
    x = _every_code_and_tie(dtype)
    assert fp8.quantize_tensorwise_ref(x, dtype).scale_inv.item() == 1.0
    inputs = {
        "codes and ties": x.cuda(),
        "codes and ties in BF16": x.cuda().bfloat16(),
        "random BF16": _input(512, 384, device="cuda", dtype=torch.bfloat16),
        "random FP32": _input(512, 384, device="cuda"),
    }
    failures = []
    for config in kern.CANDIDATES:
        for what, inp in inputs.items():
            for check in (check_all, check_delayed):
                try:
                    check(inp, dtype, hardware_cast=hardware_cast, config=config)
                except AssertionError as e:
                    failures.append(
                        f"(warps, CHUNK) {config}, {what}, {check.__name__}: {str(e).splitlines()[0]}"
                    )
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_padded_width_equals_reference(dtype):
    check_padded(_narrow_input(1024, 6176 // 4, dtype=torch.bfloat16).cuda(), dtype)  # 1544 % 128 == 8


@pytest.mark.gpu
@on_gpu
def test_gpu_padded_dispatch_equals_reference():
    x = _narrow_input(512, 800, dtype=torch.bfloat16)
    xp = F.pad(x, (0, -800 % 128))
    rows, cols = fp8.quantize_blockwise_pair(x.cuda(), pad=True)
    same_bits(rows.data, fp8.quantize_blockwise_ref(xp).data, "dispatch padded pair rows")
    same_bits(cols.data, fp8.quantize_blockwise_t_ref(xp).data, "dispatch padded pair cols")
    same_bits(
        cols.scale_inv, fp8.quantize_blockwise_t_ref(xp).scale_inv, "dispatch padded pair cols scale_inv"
    )
    got = fp8.quantize_blockwise_t(x.cuda())  # any width, unpadded
    same_bits(got.data, fp8.quantize_blockwise_t_ref(x).data, "dispatch narrow transposed")
    for block in ((1, 128), (128, 128)):
        got, ref = fp8.quantize_blockwise(x.cuda(), block, pad=True), fp8.quantize_blockwise_ref(xp, block)
        same_bits(got.data, ref.data, f"dispatch padded {block}")
        same_bits(got.scale_inv, ref.scale_inv, f"dispatch padded {block} scale_inv")
    got = fp8.quantize_blockwise(x.cuda().reshape(4, 128, 800), pad=True)  # leading dims kept
    assert got.data.shape == (4, 128, 896) and got.scale_inv.shape == (4, 128, 7)


@pytest.mark.gpu
@on_gpu
def test_gpu_dispatch_equals_reference():
    x = _input(512, 768, device="cuda", dtype=torch.bfloat16)
    xc = x.cpu()
    same_bits(fp8.quantize_tensorwise(x).data, fp8.quantize_tensorwise_ref(xc).data, "dispatch tensorwise")
    for block in ((1, 128), (128, 128)):
        got, ref = fp8.quantize_blockwise(x, block), fp8.quantize_blockwise_ref(xc, block)
        same_bits(got.data, ref.data, f"dispatch {block}")
        same_bits(got.scale_inv, ref.scale_inv, f"dispatch {block} scale_inv")
        same_bits(got.dequantize(), ref.dequantize(), f"dispatch {block} dequantize")
    got, ref = fp8.quantize_blockwise_t(x), fp8.quantize_blockwise_t_ref(xc)
    same_bits(got.data, ref.data, "dispatch transposed")
    bad = x.clone()
    bad[3, 4] = float("inf")
    with pytest.raises(Exception, match="non-finite"):
        fp8.quantize_blockwise(bad)

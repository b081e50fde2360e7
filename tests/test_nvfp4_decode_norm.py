"""The decode pre-norm that writes the NVFP4 rows of its output (``norm_kernels.norm_nvfp4_rows``,
``model/fused_nvfp4_decode.py``): its rows are, bit for bit, what the row quantizer makes of the
norm's BF16 output, and a model whose blocks hand them over decodes the logits, bit for bit, of the
same model whose linears quantize for themselves, with one quantizer launch fewer per block (and per
MLP: its squared ReLU writes down_proj's rows the same way; and per Mamba layer: the fused step
writes out_proj's).

Each producer quantizes rows up to ``ROWS_IN_REGISTERS`` wide in one pass over the registers holding
them, wider ones by reading them back in loops of K. The tests take both ways (forcing the loops), and
hold the one pass, on its own, to the loops and to the torch quantizer.

On CPU the kernels run in a TRITON_INTERPRET=1 child process; on a GPU directly. Fresh random rows
each run, with a zero row, an outlier, tiny values, a row of NaN and one with an Inf among them.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from interpreter import interpreted_parent, kernel_test

pytest.importorskip("triton")

from inkling_fp4.model import fused_nvfp4_decode  # noqa: E402
from inkling_fp4.model.config import ModelConfig  # noqa: E402
from inkling_fp4.model.hybrid import Block, HybridLM  # noqa: E402
from inkling_fp4.precision.config import PrecisionConfig  # noqa: E402
from inkling_fp4.precision.policy import PrecisionPolicy  # noqa: E402
from inkling_fp4.precision.quant_linear import QuantLinear  # noqa: E402

test_kernels_under_triton_interpreter = interpreted_parent(__file__, "-m", "gpu")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _rows(r: int, d: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(r, d, generator=g) * torch.rand(r, 1, generator=g) * 8
    special = [torch.zeros(d), torch.randn(d, generator=g).index_fill_(0, torch.tensor([d // 3]), 5e4),
               torch.randn(d, generator=g) * 1e-7, torch.full((d,), float("nan")),
               torch.randn(d, generator=g).index_fill_(0, torch.tensor([d // 2]), float("inf"))]  # fmt: skip
    for i, row in enumerate(special[: r - 1]):
        x[i + 1] = row
    return x


@pytest.fixture(params=["registers", "loops"])
def row_path(request, monkeypatch):
    """How the producers quantize their rows: from registers in one pass (rows up to
    ``ROWS_IN_REGISTERS`` wide), or read back in loops of K (wider rows; forced here)."""
    from inkling_fp4.numerics.kernels import nvfp4_decode_gemm

    if request.param == "loops":
        monkeypatch.setattr(nvfp4_decode_gemm, "ROWS_IN_REGISTERS", 0)
    return request.param


@kernel_test
@pytest.mark.parametrize("block_m", [1, 4])
# (m, k): one block; K/16 = 3 and 5 blocks of a G of 4 and 8; 17 blocks over two loop steps of K, rows
# past the last program's end
@pytest.mark.parametrize(("m", "k"), [(1, 16), (3, 48), (8, 80), (9, 272)])
def test_the_single_pass_row_quantizer_is_the_two_loop_one(block_m, m, k):
    """The same rows through ``quantize_rows_in_registers`` (one load) and ``quantize_whole_rows`` (two
    loops): the same bits, NaN and Inf rows too; the finite rows are also the torch quantizer's."""
    from inkling_fp4.numerics import nvfp4
    from inkling_fp4.numerics.kernels.nvfp4_decode_gemm import quantize_rows_whole

    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    x = _rows(m, k, g)
    if m > 7:  # a BF16 value near its largest, and a row of FP32 subnormals (S_enc clamped to FLT_MAX)
        x[6] = torch.randn(k, generator=g).index_fill_(0, torch.tensor([k - 1]), -3e38)
        x[7] = torch.randn(k, generator=g) * 1e-39
    x = x.to(torch.bfloat16).to(_device())
    w_decode = torch.tensor([0.37 * random.random() + 1e-3], device=x.device)
    got = quantize_rows_whole(x, w_decode, block_m=block_m, in_registers=True)
    want = quantize_rows_whole(x, w_decode, block_m=block_m)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b)), seed
    finite = x.float().isfinite().all(1)
    ref = nvfp4.quantize_rows(x[finite], check=False)
    values, out_scale, _ = got
    assert torch.equal(_bits(values[finite]), _bits(ref.block_values())), seed
    assert torch.equal(_bits(out_scale[finite]), _bits(ref.decode_scale[:, 0] * w_decode)), seed


@kernel_test
@pytest.mark.parametrize("add", [False, True])
# (r, d): one row, one program of 64 rows with 5 in it, two programs of 8 rows of 512 (the second ragged)
# whose rows the quantizer reads in two blocks of K, the second ragged; rows of 5 blocks in a tile of 8
@pytest.mark.parametrize(("r", "d"), [(1, 48), (5, 64), (9, 320), (6, 80)])
def test_the_norms_rows_are_the_row_quantizers_of_its_output(add, r, d, row_path):
    from inkling_fp4.model.glue_kernels.norm_kernels import norm_forward, norm_nvfp4_rows
    from inkling_fp4.numerics.kernels.nvfp4_decode_gemm import quantize_rows_whole

    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    dev = _device()
    x = _rows(r, d, g).to(dev)  # the residual stream, FP32
    y = (torch.randn(r, d, generator=g) * 2).to(torch.bfloat16).to(dev) if add else None
    w = (1 + torch.randn(d, generator=g) * 0.2).to(dev)
    w_decode = torch.tensor([0.37 * random.random() + 1e-3], device=dev)
    h, normed, values, out_scale, largest = norm_nvfp4_rows(x, y, w, 1e-5, w_decode)
    h_ref = None if y is None else torch.empty_like(x)
    normed_ref, _ = norm_forward(x, y, w, 1e-5, torch.bfloat16, h_ref)
    # the rows are of the output as stored; the output is the plain norm's to its last bit where the two
    # reduce a row's squares in the same order (one row a program here, a tile of rows there: on a GPU
    # the order may differ, so one BF16 step apart)
    values_ref, scale_ref, largest_ref = quantize_rows_whole(normed, w_decode)
    assert (h is None) == (h_ref is None) and (h is None or torch.equal(_bits(h), _bits(h_ref))), seed
    torch.testing.assert_close(normed, normed_ref, rtol=2**-7, atol=0, equal_nan=True, msg=f"seed {seed}")
    for got, want in (
        (values, values_ref),
        (out_scale, scale_ref),
        (largest, largest_ref),
    ):
        assert torch.equal(_bits(got), _bits(want)), seed


@kernel_test
# (r, f): one row; random rows around the five special ones, over two blocks of K, the second ragged;
# rows of 3 and 5 blocks (G = 4, 8)
@pytest.mark.parametrize(("r", "f"), [(1, 64), (7, 272), (3, 48), (6, 80)])
def test_the_squared_relus_rows_are_the_row_quantizers_of_its_output(r, f, row_path):
    from inkling_fp4.model.glue_kernels.pointwise_kernels import squared_relu_nvfp4_rows
    from inkling_fp4.model.mlp import squared_relu
    from inkling_fp4.numerics.kernels.nvfp4_decode_gemm import quantize_rows_whole

    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    h = (_rows(r, f, g) / 16).to(torch.bfloat16).to(_device())  # up_proj's output, negatives included
    w_decode = torch.tensor([0.37 * random.random() + 1e-3], device=h.device)
    out, values, out_scale, largest = squared_relu_nvfp4_rows(h, w_decode)
    out_ref = squared_relu.reference(h)  # the plain PyTorch form: relu(h) * relu(h) in BF16
    values_ref, scale_ref, largest_ref = quantize_rows_whole(out_ref, w_decode)
    for got, want in ((out, out_ref), (values, values_ref), (out_scale, scale_ref), (largest, largest_ref)):
        assert torch.equal(_bits(got), _bits(want)), seed


@kernel_test
# (B, H, P, G): one row of one group; three rows of two groups whose width (64) is one ragged block of K;
# two rows of 3 blocks (G = 4 in registers)
@pytest.mark.parametrize(("bsz", "heads", "p", "g"), [(1, 2, 16, 1), (3, 4, 16, 2), (2, 3, 16, 1)])
def test_the_mamba_steps_rows_are_the_row_quantizers_of_its_output(bsz, heads, p, g, row_path):
    """Three steps in a row (the kernel's counts carry over), a row of NaN in the last: each step's h is
    the plain kernel's, bit for bit, and its rows are the row quantizer's of that h."""
    from inkling_fp4.model.mamba2_decode import mamba_decode
    from inkling_fp4.numerics.kernels.nvfp4_decode_gemm import quantize_rows_whole
    from test_decode_kernels import mamba_inputs

    seed = random.randrange(2**31)
    dev = _device()
    inp = mamba_inputs(seed, bsz, heads, p, g, 8, 4, torch.bfloat16, dev)
    twin = {n: t.clone() for n, t in inp.items()}
    done = torch.zeros(bsz, g + 1, dtype=torch.int32, device=dev)
    w_decode = torch.tensor([0.37 * random.random() + 1e-3], device=dev)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(3):
        row = (torch.randn(inp["zxbcdt"].shape, generator=gen) * 2).to(inp["zxbcdt"])
        if step == 2:
            row[-1, : heads * p] = float("nan")  # z of the last row: its h is NaN
        inp["zxbcdt"], twin["zxbcdt"] = row, row.clone()
        h, values, out_scale, largest = mamba_decode(*inp.values(), g, 1e-5, torch.bfloat16, done=done,
                                                     w_decode=w_decode)  # fmt: skip
        h_ref = mamba_decode(*twin.values(), g, 1e-5, torch.bfloat16)
        values_ref, scale_ref, largest_ref = quantize_rows_whole(h_ref, w_decode)
        for got, want in ((h, h_ref), (values, values_ref), (out_scale, scale_ref), (largest, largest_ref)):
            assert torch.equal(_bits(got), _bits(want)), (seed, step)
    assert (done[:, g] == 3 * g).all(), seed  # each group of each row counted once a step
    assert torch.isinf(largest).all(), seed  # the NaN row reaches the deferred check


def _quantizer_calls(monkeypatch) -> list[int]:
    """Counts the row quantizer's launches (the one the handed-over rows replace)."""
    from inkling_fp4.numerics.kernels import nvfp4_decode_gemm as kernels

    calls, real = [], kernels.quantize_rows_whole
    monkeypatch.setattr(kernels, "quantize_rows_whole", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _prefill(model, prompts, steps: int):
    """(the cache after the prompts, their last logits): the blocks' plain prefill, the same for both."""
    dev = prompts.device
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
        cache = model.allocate_cache(prompts.shape[0], prompts.shape[1] + steps + 1)
        lengths = torch.full((prompts.shape[0],), prompts.shape[1], device=dev)
        return cache, model.prefill(prompts, lengths, cache)


def _decode(model, cache, logits: torch.Tensor, steps: int) -> list[torch.Tensor]:
    out = []
    with torch.no_grad(), torch.autocast(logits.device.type, dtype=torch.bfloat16):
        for _ in range(steps):
            out.append(model.decode_step((out[-1] if out else logits).argmax(-1), cache))
    return out


@kernel_test
def test_blocks_that_hand_over_the_rows_decode_the_same_logits(monkeypatch):
    dev = _device()
    torch.manual_seed(random.randrange(2**31))
    cfg = ModelConfig(preset="tiny", pattern="M*-")  # each kind of block once, the last two with a residual
    model = HybridLM(cfg).to(dev).eval()
    policy = PrecisionPolicy(PrecisionConfig(recipe="nvfp4", activation_scale="row", bf16_first_layers=0,
                                             bf16_last_layers=0), cfg.n_layers)  # fmt: skip
    policy.apply(model)
    policy.freeze_weights(model)
    fused_nvfp4_decode.fuse_nvfp4_decode(model)
    assert all(type(b) is fused_nvfp4_decode.NVFP4DecodeBlock for b in model.layers)
    mlps = sum(type(b.mixer) is fused_nvfp4_decode.NVFP4DecodeMLP for b in model.layers)
    assert sum(type(b.mixer) is fused_nvfp4_decode.NVFP4DecodeMamba for b in model.layers) == 1
    assert mlps == cfg.pattern.count("-") > 0
    # the prefill (the plain blocks' code) only sets up the cache, once for both decodes: prompts that
    # just fill the conv state (the steps read no padding)
    prompts = torch.randint(0, cfg.vocab_size, (2, cfg.conv_kernel - 1), device=dev)
    steps = 2
    cache, logits = _prefill(model, prompts, steps)
    if dev == "cpu":  # the fused Mamba-2 step is CUDA's: here it runs under the interpreter too
        from inkling_fp4.model import mamba2

        for module in (fused_nvfp4_decode, mamba2):
            monkeypatch.setattr(module, "fused_decode_applies", lambda *a: True)
    calls = _quantizer_calls(monkeypatch)
    fused = _decode(model, copy.deepcopy(cache), logits, steps)
    handed = len(calls)
    monkeypatch.setattr(QuantLinear, "hand_over", lambda self, x, rows: None)  # each linear quantizes x
    plain = _decode(model, cache, logits, steps)
    mambas = cfg.pattern.count("M")
    # one fewer per block, per MLP, per Mamba layer
    assert len(calls) - handed == handed + steps * (cfg.n_layers + mlps + mambas)
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(_bits(a), _bits(b))


@kernel_test
def test_the_path_applies_to_no_grad_nvfp4_row_steps_only():
    """Each condition alone turns it off: a BF16 linear, NVFP4 with tensor scales, a grad-enabled
    forward, the plain PyTorch forms (``reference_glue``), a norm output wider than BF16."""
    from inkling_fp4.model.compiled import reference_glue

    dev = _device()
    cfg = ModelConfig(preset="tiny", pattern="M")  # the first block alone: only its linear is asked
    x = torch.randn(2, cfg.d_model, device=dev)

    def linear_of(**precision):
        model = HybridLM(cfg).to(dev)
        if precision:
            policy = PrecisionPolicy(PrecisionConfig(bf16_first_layers=0, bf16_last_layers=0, **precision),
                                     cfg.n_layers)  # fmt: skip
            policy.apply(model)
            policy.freeze_weights(model)
        return fused_nvfp4_decode.first_linear(model.layers[0].mixer)

    row = linear_of(recipe="nvfp4", activation_scale="row")
    with torch.no_grad():
        assert fused_nvfp4_decode.applies(row, x, torch.bfloat16)
        assert not fused_nvfp4_decode.applies(linear_of(), x, torch.bfloat16)
        assert not fused_nvfp4_decode.applies(linear_of(recipe="nvfp4"), x, torch.bfloat16)
        assert not fused_nvfp4_decode.applies(row, x, torch.float32)
        with reference_glue():
            assert not fused_nvfp4_decode.applies(row, x, torch.bfloat16)
    assert not fused_nvfp4_decode.applies(row, x, torch.bfloat16)  # grad enabled


def test_only_a_model_that_decodes_nvfp4_rows_is_converted():
    model = HybridLM(ModelConfig(preset="tiny"))
    assert all(type(b) is Block for b in fused_nvfp4_decode.fuse_nvfp4_decode(model).layers)  # BF16: kept
    PrecisionPolicy(PrecisionConfig(recipe="nvfp4", activation_scale="row"), model.cfg.n_layers).apply(model)
    fused_nvfp4_decode.fuse_nvfp4_decode(model)
    assert all(type(b) is fused_nvfp4_decode.NVFP4DecodeBlock for b in model.layers)
    assert [fused_nvfp4_decode.first_linear(b.mixer).name for b in model.layers[:3]] == [
        "mamba.in_proj", "mlp.up_proj", "attn.qkv_proj"]  # fmt: skip

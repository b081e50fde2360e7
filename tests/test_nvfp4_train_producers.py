"""The training producers that reduce the NVFP4 tensor amaxes of what they write, a linear's x or dy
(``model/fused_nvfp4_train.py``): the pre-norm, the squared ReLU and the gated norm forward, the squared
ReLU's and the norm's backward, and the three writers of in_proj's gradient slab. Their outputs are the
plain kernels' bits, their two amaxes the words the linear's own pass reduces (``rht_t_abs_max``), and a
model whose producers hand them over trains, bit for bit, as the same model whose linears read x and dy
for them, with those reads gone.

On CPU the kernels run in a TRITON_INTERPRET=1 child process; on a GPU directly. Fresh random rows
each run, with a zero row, an outlier, tiny values, a row of NaN and one with an Inf among them.
"""

from __future__ import annotations

import random

import pytest
import torch

from interpreter import interpreted_parent, kernel_test

pytest.importorskip("triton")

from inkling_fp4.config import load_config  # noqa: E402
from inkling_fp4.distributed import DistInfo  # noqa: E402
from inkling_fp4.model import fused_nvfp4_decode, fused_nvfp4_train  # noqa: E402
from inkling_fp4.model.config import ModelConfig  # noqa: E402
from inkling_fp4.model.hybrid import Block, HybridLM  # noqa: E402
from inkling_fp4.model.mamba2 import Mamba2Mixer  # noqa: E402
from inkling_fp4.model.mlp import MLP  # noqa: E402
from inkling_fp4.precision import gemm  # noqa: E402
from inkling_fp4.precision.config import PrecisionConfig  # noqa: E402
from inkling_fp4.precision.policy import PrecisionPolicy  # noqa: E402
from inkling_fp4.trainer.trainer import Trainer  # noqa: E402

test_kernels_under_triton_interpreter = interpreted_parent(__file__, "-m", "gpu")

SIGNS = 0b1011_0011_1000_1101  # an RHT sign mask with both signs in every butterfly stage


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _rows(r: int, d: int, g: torch.Generator, special: bool) -> torch.Tensor:
    x = torch.randn(r, d, generator=g) * torch.rand(r, 1, generator=g) * 8
    if special:
        rows = [torch.zeros(d), torch.randn(d, generator=g).index_fill_(0, torch.tensor([d // 3]), 5e4),
                torch.randn(d, generator=g) * 1e-7, torch.full((d,), float("nan")),
                torch.randn(d, generator=g).index_fill_(0, torch.tensor([d // 2]), float("inf"))]  # fmt: skip
        for i, row in enumerate(rows):
            x[2 * i + 1] = row
    return x


def _own_pass(out: torch.Tensor) -> torch.Tensor:
    """The words the linear's amax pass reduces over out [..., N]: [max |rht(outᵀ)|, max |out|]."""
    from inkling_fp4.numerics.kernels.nvfp4_rht import rht_t_abs_max

    return rht_t_abs_max(out.detach().reshape(-1, out.shape[-1]).contiguous(), SIGNS, with_x_amax=True)


@kernel_test
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize(  # rows a program: 64, 32, 64, 4 x 4, 16, 8 x 2
    "r, d, special",
    [(32, 48, False), (48, 96, True), (16, 40, False), (32, 600, True), (32, 256, False), (32, 2048, False)],
)
def test_the_norms_amaxes_are_the_linears_own_pass(add, r, d, special):
    """The output is the plain kernel's bit for bit: a program runs the plain launch's tiles (its row
    sums) until it holds whole 16-token groups."""
    from inkling_fp4.model.glue_kernels.norm_kernels import add_rms_norm, norm_amax_pair, rms_norm

    dev, seed = _device(), random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    x = _rows(r, d, g, special).to(dev).requires_grad_(True)  # FP32 residual stream
    y = (torch.randn(r, d, generator=g) * 2).bfloat16().to(dev).requires_grad_(True) if add else None
    w = (torch.rand(d, generator=g) + 0.5).to(dev).requires_grad_(True)
    h, normed, words = norm_amax_pair(x, y, w, 1e-5, SIGNS)
    if add:
        h_ref, ref = add_rms_norm(x, y, w, 1e-5, torch.bfloat16)
        assert torch.equal(_bits(h), _bits(h_ref)), seed
    else:
        ref = rms_norm(x, w, 1e-5, torch.bfloat16)
    assert normed.dtype == torch.bfloat16 and torch.equal(_bits(normed), _bits(ref)), seed
    assert torch.equal(words, _own_pass(normed)), (seed, words)
    assert torch.isinf(words).all() == special, seed  # the NaN row reaches both words as +Inf
    if not special:  # the backward is the plain kernel's
        dout = torch.randn(r, d, generator=g).bfloat16().to(dev)
        grads = torch.autograd.grad(normed, [x, w] + ([y] if add else []), dout)
        ref_grads = torch.autograd.grad(ref, [x, w] + ([y] if add else []), dout)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)), seed


@kernel_test
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])  # y's gradient its own buffer, or dx
@pytest.mark.parametrize("r, d, special", [(64, 48, False), (128, 600, True), (16, 40, False)])
def test_the_norms_backward_gives_ys_gradient_amaxes(x_dtype, r, d, special):
    """The block norm's add: the gradient of y (the previous mixer's output, its output projection's dy)
    with the words the projection's own pass over it reduces, and the same gradients as without them."""
    from inkling_fp4.model.glue_kernels.norm_kernels import add_rms_norm, norm_amax_pair

    dev, seed = _device(), random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    x = _rows(r, d, g, False).to(x_dtype).to(dev).requires_grad_(True)
    y = (torch.randn(r, d, generator=g) * 2).bfloat16().to(dev).requires_grad_(True)
    w = (torch.rand(d, generator=g) + 0.5).to(dev).requires_grad_(True)
    dout = _rows(r, d, g, special).bfloat16().to(dev)
    dy_words: list = []
    _, normed, words = norm_amax_pair(x, y, w, 1e-5, None, (SIGNS, dy_words))
    assert words is None  # no forward amaxes asked for
    grads = torch.autograd.grad(normed, [x, y, w], dout)
    ref_grads = torch.autograd.grad(add_rms_norm(x, y, w, 1e-5, torch.bfloat16)[1], [x, y, w], dout)
    assert len(dy_words) == 1 and torch.equal(dy_words[0], _own_pass(grads[1])), (seed, dy_words)
    assert torch.isinf(dy_words[0]).all() == special, seed
    if not special:
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)), seed


@kernel_test
@pytest.mark.parametrize("lead, f, special", [((2, 16), 48, False), ((48,), 600, True), ((16,), 16, False)])
def test_the_squared_relus_amaxes_are_the_linears_own_pass(lead, f, special):
    from inkling_fp4.model.glue_kernels.pointwise_kernels import squared_relu, squared_relu_amax_pair

    dev, seed = _device(), random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    rows = 1
    for n in lead:
        rows *= n
    u = _rows(rows, f, g, special).reshape(*lead, f).bfloat16().to(dev).requires_grad_(True)
    grad_words: list = []
    out, words = squared_relu_amax_pair(u, SIGNS, SIGNS, grad_words)
    ref = squared_relu(u)
    assert torch.equal(_bits(out), _bits(ref)), seed
    assert torch.equal(words, _own_pass(out)), (seed, words)
    assert torch.isinf(words).all() == special, seed
    dout = (torch.randn(*lead, f, generator=g) * 4).bfloat16().to(dev)
    (du,) = torch.autograd.grad(out, u, dout)
    (du_ref,) = torch.autograd.grad(ref, u, dout)
    assert torch.equal(_bits(du), _bits(du_ref)), seed
    assert len(grad_words) == 1 and torch.equal(grad_words[0], _own_pass(du)), (seed, grad_words)
    (du_alone,) = torch.autograd.grad(squared_relu_amax_pair(u, None, SIGNS, grad_words)[0], u, dout)
    assert torch.equal(_bits(du_alone), _bits(du_ref)) and torch.equal(grad_words[1], grad_words[0]), seed


@kernel_test
@pytest.mark.parametrize(
    "r, h, p, g, special",  # rows a program: 128, 64, 256, 2 x 8, 4 x 4
    [
        (32, 4, 16, 2, False),
        (48, 8, 32, 4, True),
        (16, 2, 8, 1, False),
        (32, 8, 64, 1, False),
        (48, 16, 64, 1, True),
    ],  # fmt: skip
)
def test_the_gated_norms_amaxes_are_the_linears_own_pass(r, h, p, g, special):
    """As for the pre-norm: Mamba-2's skip + gated group norm, out_proj's x."""
    from inkling_fp4.model.glue_kernels import gated_norm_kernels as kernels

    dev, seed = _device(), random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    y = _rows(r, h * p, gen, special).reshape(r, h, p).to(dev).requires_grad_(True)
    x = (torch.randn(r, h, p, generator=gen) * 2).to(dev).requires_grad_(True)
    z = (torch.randn(r, h * p, generator=gen) * 3).to(dev).requires_grad_(True)
    D = torch.randn(h, generator=gen).to(dev).requires_grad_(True)
    w = (torch.rand(h * p, generator=gen) + 0.5).to(dev).requires_grad_(True)
    with torch.autocast(dev, dtype=torch.bfloat16):
        out, words = kernels.skip_gated_norm_amax_pair(y, x, D, z, w, g, 1e-5, SIGNS)
        ref = kernels.skip_gated_rms_norm(y, x, D, z, w, g, 1e-5, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(_bits(out), _bits(ref)), seed
    assert torch.equal(words, _own_pass(out)), (seed, words)
    assert torch.isinf(words).all() == special, seed
    if not special:
        dout = torch.randn(r, h * p, generator=gen).bfloat16().to(dev)
        leaves = [y, x, D, z, w]
        grads = torch.autograd.grad(out, leaves, dout)
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)), seed


@kernel_test
@pytest.mark.parametrize("seq, reduced", [(48, True), (40, False)])
@pytest.mark.parametrize("loud", [0, 1, 2])
def test_the_in_proj_slabs_writers_reduce_its_amaxes(seq, reduced, loud):
    """Mamba-2's in_proj gradient as its three consumers write it into one slab (gated norm: dz, conv:
    dxBC, dt softplus: d dt): the same gradient as without the amaxes, and the words the linear's own
    pass over it reduces, handed on by the split; with a sequence length that is not a multiple of 16
    the conv's 16-token groups would cross sequences, so it does not reduce and nothing is handed on.
    ``loud``: the consumer whose gradient holds both amaxes (its upstream gradient 1000x the others')."""
    from inkling_fp4.model.conv_triton import conv_silu_triton
    from inkling_fp4.model.glue_kernels.gated_norm_kernels import skip_gated_rms_norm
    from inkling_fp4.model.glue_kernels.pointwise_kernels import dt_softplus
    from inkling_fp4.model.grad_slab import SlabAmaxes, split_with_grad_slab

    dev, seed = _device(), random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    B, H, P, G, C, K = 2, 4, 16, 2, 96, 4
    widths = [H * P, C, H]  # z, xBC, dt

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev)

    t = rand(B, seq, sum(widths), scale=2).bfloat16()  # in_proj's output
    y, x = rand(B, seq, H, P).bfloat16(), rand(B, seq, H, P).bfloat16()
    D, w, dt_bias = rand(H), rand(H * P), rand(H)
    conv_w, conv_b = rand(C, K, scale=0.5).bfloat16(), rand(C).bfloat16()
    douts = [rand(B, seq, H * P), rand(B, seq, C), rand(B, seq, H)]
    douts[loud] *= 1000

    def in_proj_grad(amaxes):
        leaf = t.clone().requires_grad_(True)
        (z, xBC, dt_raw), slab = split_with_grad_slab(leaf, widths, amaxes)
        into = [slab.into(i) for i in range(3)]
        outs = [
            skip_gated_rms_norm(y, x, D, z, w, G, 1e-5, torch.bfloat16, dz_into=into[0]),
            conv_silu_triton(xBC, conv_w, conv_b, None, None, into[1]),
            dt_softplus(dt_raw, dt_bias, ddt_into=into[2]),
        ]
        torch.autograd.backward([o.float() for o in outs], douts)
        return leaf.grad

    box: list = []
    grad = in_proj_grad(SlabAmaxes(SIGNS, torch.zeros(2, device=dev), box))
    assert torch.equal(_bits(grad), _bits(in_proj_grad(None))), seed
    if reduced:
        assert len(box) == 1 and torch.equal(box[0], _own_pass(grad)), (seed, box)
    else:
        assert box == [], seed


def _nvfp4_model(cfg: ModelConfig, dev: str) -> tuple[HybridLM, PrecisionPolicy]:
    model = HybridLM(cfg).to(dev)
    policy = PrecisionPolicy(PrecisionConfig(recipe="nvfp4", bf16_first_layers=0, bf16_last_layers=0),
                             cfg.n_layers)  # fmt: skip
    policy.apply(model)
    return fused_nvfp4_train.fuse_nvfp4_train(model), policy


def _step(model, policy, ids: torch.Tensor) -> list[torch.Tensor]:
    """The loss and every parameter's gradient of one training step, from a fixed rounding stream."""
    policy.set_generator_seed(7)
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model(ids[:, :-1], targets=ids[:, 1:])
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def _amax_passes(monkeypatch) -> list[int]:
    """Counts the linears' own amax passes (the read that a producer's words replace)."""
    from inkling_fp4.numerics.kernels import triton_nvfp4

    calls, real = [], triton_nvfp4.abs_max_pair
    monkeypatch.setattr(triton_nvfp4, "abs_max_pair", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@kernel_test
def test_a_model_whose_producers_hand_over_the_amaxes_trains_the_same(monkeypatch):
    dev = _device()
    torch.manual_seed(random.randrange(2**31))
    monkeypatch.setattr(gemm, "PRODUCER_NVFP4_AMAXES", True)
    cfg = ModelConfig(preset="tiny", pattern="M*-")  # each kind of block once, the last two with a residual
    model, policy = _nvfp4_model(cfg, dev)
    assert type(model) is fused_nvfp4_train.NVFP4TrainHybridLM
    assert [type(b) for b in model.layers] == [fused_nvfp4_train.NVFP4TrainBlock] * 3
    assert type(model.layers[0].mixer) is fused_nvfp4_train.NVFP4TrainMamba
    ids = torch.randint(0, cfg.vocab_size, (2, 17), device=dev)  # 32 tokens: two 16-token groups
    calls = _amax_passes(monkeypatch)
    handed = _step(model, policy, ids)
    passes_handed = len(calls)
    shared = gemm.shared_nvfp4_amaxes  # each linear reads x and dy for their amaxes, the producers still run
    monkeypatch.setattr(
        gemm, "shared_nvfp4_amaxes", lambda t, row, token, signs, given=None: shared(t, row, token, signs)
    )
    plain = _step(model, policy, ids)
    mlps = cfg.pattern.count("-")
    mambas = cfg.pattern.count("M")
    # per block two fewer (the first linear's x, the output projection's dy), two per MLP (down_proj's x,
    # up_proj's dy), one per Mamba layer (out_proj's x) and on the GPU kernels a second (in_proj's dy,
    # from its gradient slab)
    per_mamba = 2 if dev == "cuda" else 1
    assert len(calls) - passes_handed == passes_handed + 2 * cfg.n_layers + 2 * mlps + per_mamba * mambas
    for a, b in zip(handed, plain, strict=True):
        assert torch.equal(a, b)
    if dev == "cuda":  # the plain layers' forward (on CPU its norms are the torch references)
        monkeypatch.setattr(gemm, "PRODUCER_NVFP4_AMAXES", False)
        for a, b in zip(handed, _step(model, policy, ids), strict=True):
            assert torch.equal(a, b)


@kernel_test
def test_the_producers_hand_over_only_where_the_linear_reads_x_for_both_amaxes(monkeypatch):
    """Each condition alone turns it off: the switch, a BF16 linear, row scales (no tensor amax), the
    FP8 recipe, a no-grad forward, a frozen weight (no wgrad, so no RHT amax), tokens not a multiple
    of 16, a producer output wider than BF16; for dy also an x without a gradient (no dgrad)."""
    dev = _device()
    cfg = ModelConfig(preset="tiny", pattern="-")
    x = torch.randn(2, 16, cfg.d_model, device=dev, requires_grad=True)

    def linear_of(**precision):
        model = HybridLM(cfg).to(dev)
        if precision:
            PrecisionPolicy(PrecisionConfig(bf16_first_layers=0, bf16_last_layers=0, **precision),
                            cfg.n_layers).apply(model)  # fmt: skip
        return model.layers[0].mixer.up_proj

    nvfp4 = linear_of(recipe="nvfp4")
    monkeypatch.setattr(gemm, "PRODUCER_NVFP4_AMAXES", False)
    assert nvfp4.producer_amax_signs(x) is None
    monkeypatch.setattr(gemm, "PRODUCER_NVFP4_AMAXES", True)
    assert isinstance(nvfp4.producer_amax_signs(x), int)
    assert fused_nvfp4_train.amax_signs(nvfp4, x, torch.bfloat16) == nvfp4.producer_amax_signs(x)
    assert fused_nvfp4_train.amax_signs(nvfp4, x, torch.float32) is None  # no autocast: no BF16 producer
    assert nvfp4.producer_amax_signs(x, grad=True) == nvfp4.producer_amax_signs(x)
    assert nvfp4.producer_amax_signs(x.detach(), grad=True) is None
    assert isinstance(nvfp4.producer_amax_signs(x.detach()), int)
    assert linear_of().producer_amax_signs(x) is None
    assert linear_of(recipe="nvfp4", activation_scale="row").producer_amax_signs(x) is None
    assert linear_of(recipe="fp8").producer_amax_signs(x) is None
    assert nvfp4.producer_amax_signs(x[:, :15]) is None
    assert nvfp4.producer_amax_signs(x[:, :15], grad=True) is None
    with torch.no_grad():
        assert nvfp4.producer_amax_signs(x) is None
    nvfp4.weight.requires_grad_(False)
    assert nvfp4.producer_amax_signs(x) is None and nvfp4.producer_amax_signs(x, grad=True) is None


def test_the_conversion_keeps_the_decode_classes_and_the_trainer_converts_under_nvfp4_only(tmp_path):
    model = HybridLM(ModelConfig(preset="tiny"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    PrecisionPolicy(PrecisionConfig(recipe="nvfp4", activation_scale="row"), model.cfg.n_layers).apply(model)
    fused_nvfp4_decode.fuse_nvfp4_decode(model)  # the sampler first, then the trainer: both kept
    assert fused_nvfp4_train.fuse_nvfp4_train(model) is model
    blocks = {type(b) for b in model.layers}
    mlps = {type(b.mixer) for b in model.layers if isinstance(b.mixer, MLP)}
    mambas = {type(b.mixer) for b in model.layers if isinstance(b.mixer, Mamba2Mixer)}
    assert blocks == {fused_nvfp4_train.NVFP4TrainBlock} and mlps == {fused_nvfp4_train.NVFP4TrainMLP}
    assert mambas == {fused_nvfp4_train.NVFP4TrainMamba}
    fused_nvfp4_decode.fuse_nvfp4_decode(model)  # the trainer first, then the sampler: both kept
    assert {type(b) for b in model.layers} == blocks
    assert all(isinstance(b, fused_nvfp4_decode.NVFP4DecodeBlock) for b in model.layers)
    assert model.state_dict().keys() == state.keys()
    for recipe, fused in (("nvfp4", True), ("fp8", False), ("bf16", False)):
        cfg = load_config("tiny", [f"precision.recipe={recipe}", "train.device=cpu"])
        model = HybridLM(cfg.model)
        Trainer(cfg, tmp_path / recipe, DistInfo(), model)
        assert all(isinstance(b, fused_nvfp4_train.NVFP4TrainBlock) is fused for b in model.layers)
        assert all(type(b) is Block for b in model.layers) is not fused

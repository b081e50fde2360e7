"""What the tests of the fused FP8 paths (``model/fused_fp8/mlp.py``, ``in_proj_fp8.py``, ``out_proj_fp8.py``,
``norm_fp8.py``, ``residual_fp8.py``) share: a kernel's FP8 epilogue against its BF16 output quantized
by the reference (:func:`check_fp8_epilogue`), and the model-level check that a small model under
delayed-scaled fp8-tensorwise trains the same with the path as with its linears run one by one, loss,
every gradient and the amax history bit for bit (:func:`fused_path_trains_bit_for_bit`)."""

from __future__ import annotations

import pytest
import torch

from bits import same_bits
from inkling_fp4.model.grad_slab import FP8Scaling
from inkling_fp4.numerics import fp8

CPU_MODEL = dict(pattern="M-*-M-", vocab_size=256, d_model=64, ffn_dim=160, n_heads=4, n_kv_heads=2)
"""The CPU model tests' model: Mamba-2, attention and MLP blocks, the first and last in BF16."""
GPU_MODEL = dict(pattern="M-M*-M-", vocab_size=1024, d_model=256, ffn_dim=1024, n_heads=4, n_kv_heads=2)
"""The GPU model tests' model: five quantized blocks between the BF16 first and last."""


def fused_path_trains_bit_for_bit(
    monkeypatch,
    module,
    fn_name: str,
    *,
    device: str,
    model_kw: dict,
    batch: tuple,
    steps: int,
    autocast: bool,
) -> int:
    """Train ``steps`` optimizer-free steps twice: with ``module.applies`` as it is, and patched to
    False (the unfused path). The first step scales currently (the history has no step yet, so no
    fused path runs), the later ones from the history. Asserts the two runs equal bit for bit and that
    the unfused run never called ``module.<fn_name>``; returns how often the fused run did."""
    from inkling_fp4.model.config import ModelConfig
    from inkling_fp4.model.fused_fp8.layers import fuse_fp8
    from inkling_fp4.model.hybrid import HybridLM
    from inkling_fp4.precision.config import PrecisionConfig
    from inkling_fp4.precision.policy import PrecisionPolicy

    real_applies, real_fn = module.applies, getattr(module, fn_name)
    runs = []
    for fused in (True, False):
        calls = []

        def counted(*args, calls=calls):
            calls.append(1)
            return real_fn(*args)

        monkeypatch.setattr(module, fn_name, counted)
        monkeypatch.setattr(module, "applies", real_applies if fused else lambda *a: False)
        torch.manual_seed(0)
        cfg = ModelConfig(**model_kw)
        model = HybridLM(cfg).to(device)
        if fused:  # as the trainer converts it; the reference is the plain model's own path
            model = fuse_fp8(model)
        pc = PrecisionConfig(recipe="fp8-tensorwise", fp8_scaling="delayed", amax_history=4)
        if device == "cuda":
            pc.backend = "native-fp8"
        policy = PrecisionPolicy(pc, cfg.n_layers)
        policy.apply(model)
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(steps):
            ids = torch.randint(0, cfg.vocab_size, batch, generator=g).to(device)
            model.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = model.forward_hidden(ids).float().square().mean()
            loss.backward()
            out.append([loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
            policy.end_step(skipped=False)
        runs.append((out, policy.amax_history.state.clone(), len(calls)))
    monkeypatch.setattr(module, fn_name, real_fn)
    monkeypatch.setattr(module, "applies", real_applies)
    (fused_out, fused_state, n_fused), (plain_out, plain_state, n_plain) = runs
    assert n_plain == 0, n_plain
    for step, (a, b) in enumerate(zip(fused_out, plain_out, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same_bits(x, y, f"step {step} {'loss' if i == 0 else f'gradient {i}'}")
    same_bits(fused_state, plain_state, "amax history")
    return n_fused


def delayed_linear(in_features: int, out_features: int, name: str, amaxes: tuple[float, float, float]):
    """(a QuantLinear under delayed fp8-tensorwise, its AmaxHistory) on CPU, the history ready with the
    delayed amaxes of x, dy and W given (seeded weights)."""
    from inkling_fp4.precision.amax_history import AmaxHistory
    from inkling_fp4.precision.quant_linear import QuantLinear
    from inkling_fp4.precision.recipes import fp8_tensorwise_recipe

    torch.manual_seed(0)
    lin = QuantLinear(in_features, out_features, layer_idx=0, name=name)
    history = AmaxHistory(1, 2, torch.device("cpu"))
    lin.recipe, lin.amax_history, lin.amax_index = fp8_tensorwise_recipe(delayed=True), history, 0
    history.state[0, :, 0] = torch.tensor(amaxes)
    history.ready = True
    return lin, history


def count_fp8_slab_takes(monkeypatch, blocks: int) -> dict[str, int]:
    """Count the backwards that took a gradient from an FP8 slab of ``blocks`` blocks
    (``GradSlab.fp8_operands``): as the bytes its consumers' kernels wrote (every block's placeholder
    arrived), or with values quantized into it. A fused path whose kernels stopped writing bytes trains
    the same bits through the values, so only this count shows it."""
    from inkling_fp4.model.grad_slab import GradSlab

    taken, real = {"bytes": 0, "values": 0}, GradSlab.fp8_operands

    def counting(self, grads, dgrad, wgrad):
        if len(grads) == blocks:
            held = all(self.holds(g, i) for i, g in enumerate(grads))
            taken["bytes" if held else "values"] += 1
        return real(self, grads, dgrad, wgrad)

    monkeypatch.setattr(GradSlab, "fp8_operands", counting)
    return taken


def check_applies(module, applies, x: torch.Tensor, history) -> None:
    """What every fused path's ``applies`` (here a function of the input x [B, L, C], 16 | B L) shares:
    off on CPU (no FP8 epilogues there), on with the GPU kernels (``module.fast_forms_on`` patched),
    off at 30 tokens (not 16 | tokens), before ``history`` has a step and in a no-grad forward."""
    assert not applies(x)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "fast_forms_on", lambda t: True)
        assert applies(x)
        assert not applies(x[:, :15])
        history.ready = False
        assert not applies(x)
        history.ready = True
        with torch.no_grad():
            assert not applies(x)


def check_fp8_epilogue(produce, values: torch.Tensor, e5m2: bool, device) -> None:
    """A kernel's FP8 epilogue against its BF16 output ``values``, at a delayed amax where some values
    saturate and at one where none do: ``produce(scaling)`` runs the kernel storing FP8 under
    ``scaling`` (checking its other outputs itself) and returns the bytes (uint8, values' shape), which
    must equal ``values`` quantized by the torch reference, and the record word must hold max |values|."""
    own = values.float().abs().amax()
    dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    for amax in (own / 16, own * 2):
        record = torch.full((1,), -1.0, device=device)
        q = produce(FP8Scaling(amax.reshape(1).to(device), record, e5m2))
        assert q.dtype == torch.uint8 and q.shape == values.shape, (q.dtype, tuple(q.shape))
        ref = fp8.quantize_tensorwise_ref(values.cpu(), dtype, amax=amax.reshape(1).cpu())
        same_bits(q.view(dtype).cpu(), ref.data, f"FP8 bytes, amax {float(amax):.3g}")
        assert record.item() == own.item(), (record.item(), own.item())


def residual_rows(g: torch.Generator, R: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) for a norm kernel's test: the FP32 residual stream x [R, D], whose rows range over six
    decades of magnitude, and a BF16 mixer output y [R, D] to add to it."""
    x = torch.randn(R, D, generator=g) * torch.pow(10.0, torch.empty(R, 1).uniform_(-3, 3, generator=g))
    return x, torch.randn(R, D, generator=g).to(torch.bfloat16)

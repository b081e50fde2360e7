"""The glue dispatcher (model/compiled.py) on CPU, without triton: CPU tensors, ``reference_glue()``
and tracing run the reference, a CUDA tensor runs the named kernel function with the same arguments,
and importing (and running) the model on CPU never imports triton. The kernels themselves:
test_glue_kernels.py."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from inkling_fp4.model import mamba2, mlp, norm
from inkling_fp4.model.compiled import cuda_kernel, reference_glue

EPS = 1e-5
BF = torch.bfloat16


class _FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: what the dispatcher judges by."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_cuda_kernel_dispatch_routes_by_device_context_and_tracing(monkeypatch):
    calls = []

    def kernel(a, b, scale):
        calls.append((a, b, scale))
        return "kernel"

    probe = types.ModuleType("inkling_fp4.model.glue_kernels.dispatch_probe")
    probe.add = kernel
    monkeypatch.setitem(sys.modules, probe.__name__, probe)

    @cuda_kernel("dispatch_probe.add")
    def add(a, b, scale):
        """a + b, scaled."""
        return (a + b) * scale

    a, b = torch.randn(3), torch.randn(3)
    assert add.__name__ == "add" and add.__doc__ == "a + b, scaled."
    assert torch.equal(add.reference(a, b, 2.0), (a + b) * 2.0)
    assert torch.equal(add(a, b, 2.0), (a + b) * 2.0) and calls == []
    fake = a.as_subclass(_FakeCuda)
    assert add(fake, b, 2.0) == "kernel"
    assert len(calls) == 1 and calls[0][0] is fake and calls[0][1] is b and calls[0][2] == 2.0
    with reference_glue():
        assert torch.equal(add(fake, b, 2.0), (a + b) * 2.0)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(add(fake, b, 2.0), (a + b) * 2.0)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="module.function"):
        cuda_kernel("add")


def test_cpu_calls_are_the_references():
    H, P, G = 4, 8, 2
    y, x = torch.randn(3, 5, H, P), torch.randn(3, 5, H, P)
    z, w, d = torch.randn(3, 5, H * P), torch.randn(H * P), torch.randn(H)
    cases = [
        (norm.rms_norm, (z, w, EPS, BF)),
        (norm.add_rms_norm, (z, z.to(BF), w, EPS, BF)),
        (norm.skip_gated_rms_norm, (y, x, d, z, w, G, EPS, None)),
        (norm.gated_rms_norm, (z, z * 0.5, w, G, EPS)),
        (mlp.squared_relu, (z.to(BF),)),
        (mamba2.dt_softplus, (z[..., :H], d)),
    ]
    for fn, args in cases:
        got, want = fn(*args), fn.reference(*args)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, r in zip(got, want, strict=True):
            assert g.dtype == r.dtype and torch.equal(g, r), fn.__name__


def test_the_model_on_cpu_never_imports_triton():
    """triton is an optional dependency: importing the model, and a CPU training step, must not need it."""
    code = (
        "import sys, torch, inkling_fp4.model, inkling_fp4.model.hybrid\n"
        "from inkling_fp4.model.config import ModelConfig\n"
        "model = inkling_fp4.model.hybrid.HybridLM(ModelConfig())\n"
        "model(torch.randint(0, model.cfg.vocab_size, (1, 16))).float().sum().backward()\n"
        "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if m.startswith('triton'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]

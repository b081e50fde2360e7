"""GraphedMicroStep: which recipes may be captured, the eager warm-up, and (on a GPU) replayed graphs
against eager steps of the same model: the same losses and gradients, accumulation over micro-batches,
in-place zeroing, and the refusals (another batch shape, gradients replaced behind its back)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.precision import finite_guard
from inkling_fp4.precision.config import PrecisionConfig
from inkling_fp4.precision.graph_capture import graph_blocker
from inkling_fp4.precision.policy import PrecisionPolicy
from inkling_fp4.trainer.graphed_step import GraphedMicroStep

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CFG = dict(pattern="M*-M", d_model=64, vocab_size=96, chunk_size=16)


def _batch(b: int, l: int, vocab: int, device):
    ids = torch.randint(0, vocab, (b, l + 1), device=device)
    mask = torch.rand(b, l, device=device) < 0.9
    return ids[:, :-1].contiguous(), None, ids[:, 1:].contiguous(), mask


def _loss_fn(model, device):
    def loss_fn(ids, docs, tgt, mask):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            return model(ids, doc_ids=docs, targets=tgt, loss_mask=mask)

    return loss_fn


def test_graph_blocker_names_what_cannot_be_captured(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    model = HybridLM(ModelConfig(**CFG))
    for recipe in ("bf16", "fp8", "fp8-tensorwise", "nvfp4", "mxfp4"):  # SR seeds replay from a device word
        policy = PrecisionPolicy(PrecisionConfig(recipe=recipe, backend="emulated"), model.cfg.n_layers)
        policy.apply(model)
        assert graph_blocker(model, 1, cuda) is None, recipe
    assert "single-process" in graph_blocker(model, 2, cuda)
    assert "CUDA device" in graph_blocker(model, 1, cpu)
    monkeypatch.setattr(finite_guard, "_eager", True)
    assert "eager finite checks" in graph_blocker(model, 1, cuda)


def test_warmup_calls_are_eager_steps():
    torch.manual_seed(random.randrange(2**31))
    cpu = torch.device("cpu")
    model = HybridLM(ModelConfig(**CFG))
    twin = copy.deepcopy(model)
    step = GraphedMicroStep(model, _loss_fn(model, cpu), warmup=3)
    scale = torch.tensor(0.25)
    for _ in range(3):
        batch = _batch(2, 32, CFG["vocab_size"], cpu)
        got = step(*batch, scale)
        want = _loss_fn(twin, cpu)(*batch)
        (want * scale).backward()
        assert torch.equal(got, want.detach())
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    step.zero_grad()  # before capture: gradients dropped, as optimizer.zero_grad() does
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        GraphedMicroStep(model, _loss_fn(model, cpu), warmup=0)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("recipe, micro", [("bf16", 2), ("nvfp4", 2), ("bf16", 1), ("nvfp4", 1)])
def test_gpu_replays_equal_eager_steps(recipe, micro):
    """nvfp4: stochastic rounding replayed from the generator's state, fresh amax words per replay and
    the deferred finite record: the graph must round as the eager twin does, step after step. Two
    micro-batches per step add into the captured gradients; one is written by each replay."""
    torch.manual_seed(random.randrange(2**31))
    dev = torch.device("cuda")
    model = HybridLM(ModelConfig(**CFG)).to(dev)
    twin = copy.deepcopy(model)
    policies = []
    for m in (model, twin):
        policy = PrecisionPolicy(PrecisionConfig(recipe=recipe, bf16_first_layers=0, bf16_last_layers=0), 4)
        policy.apply(m)
        policies.append(policy)
    step = GraphedMicroStep(model, _loss_fn(model, dev), warmup=1, accumulate=micro > 1)
    eager = _loss_fn(twin, dev)
    for n_step in range(4):  # step 0: warm-up (+ capture with two micro-batches); then replays
        for _ in range(micro):
            batch = _batch(2, 64, CFG["vocab_size"], dev)
            scale = torch.rand((), device=dev) + 0.5
            got = step(*batch, scale)
            want = eager(*batch)
            (want * scale).backward()
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"step {n_step}")
        finite_guard.raise_if_non_finite()  # the replays' amax copies are checked like eager records
        gens = [p.rng.for_device(dev) for p in policies]
        assert gens[0].get_offset() == gens[1].get_offset(), "the replays drew what the eager steps drew"
        step.zero_grad()
        for p in twin.parameters():
            p.grad = None
    assert step.graph is not None
    grads = [p.grad for p in model.parameters()]
    if micro > 1:  # zeroed in place for the next step's sum
        assert all(torch.count_nonzero(g) == 0 for g in grads)
    else:  # left for the next replay to rewrite: the same tensors, still holding the last step's
        assert all(g is h for g, h in zip(grads, step.grads, strict=True))
        assert all(g is not None and torch.count_nonzero(g) > 0 for g in grads)
    with pytest.raises(ValueError, match="another shape"):
        step(*_batch(2, 32, CFG["vocab_size"], dev), torch.ones((), device=dev))
    next(model.parameters()).grad = None
    with pytest.raises(RuntimeError, match="set_to_none=False"):
        step(*_batch(2, 64, CFG["vocab_size"], dev), torch.ones((), device=dev))
    step.reset()
    assert step.graph is None and step.eager_calls == 0
    if micro == 1:  # dropped: the next eager warm-up must not add to the graph's last gradients
        assert all(p.grad is None for p in model.parameters())


def test_always_masked_takes_the_packed_path_without_a_device_read():
    """One document per row: the fast unmasked path normally (None), the masked one within
    always_masked (what a graph capture and its warm-up run), with the same outputs."""
    from inkling_fp4.model.packing import Packing, always_masked

    torch.manual_seed(random.randrange(2**31))
    doc_ids = torch.zeros(2, 16, dtype=torch.long)
    assert Packing.from_doc_ids(doc_ids) is None
    with always_masked():
        packing = Packing.from_doc_ids(doc_ids)
    assert packing is not None and packing.attn_mask.shape == (2, 1, 16, 16)
    assert torch.equal(packing.attn_mask[0, 0], torch.ones(16, 16, dtype=torch.bool).tril())
    model = HybridLM(ModelConfig(**CFG))
    ids = torch.randint(0, CFG["vocab_size"], (2, 16))
    plain = model(ids, doc_ids=doc_ids)
    with always_masked():
        masked = model(ids, doc_ids=doc_ids)
    torch.testing.assert_close(masked, plain, rtol=1e-5, atol=1e-5)

"""The CUDA-graphed decode step: the same greedy tokens (and logits) as the eager step, the caller's
cache untouched by the capture, a graph that survives a new prefill; buckets and refusals on CPU."""

from __future__ import annotations

import pytest
import torch

from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.graphed_decoder import GraphedDecoder, batch_bucket
from inkling_fp4.model.hybrid import HybridLM


def test_batch_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 64, 65, 256, 600)] == [1, 2, 4, 8, 64, 128, 256, 600]
    with pytest.raises(ValueError):
        batch_bucket(0)


def test_cpu_cache_is_refused():
    model = HybridLM(ModelConfig(pattern="M*-"))
    with pytest.raises(ValueError, match="CUDA"):
        GraphedDecoder(model, model.allocate_cache(2, 8))


def _greedy(step, first_logits, n):
    """n greedy tokens from the prefill's logits, each fed back through ``step``; no host sync."""
    tokens, logits = [], first_logits
    for _ in range(n):
        nxt = logits.argmax(-1)
        tokens.append(nxt)
        logits = step(nxt).float()
    return torch.stack(tokens, 1), logits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["tiny", "peer158m"])
@pytest.mark.parametrize("batch", [1, 3])
def test_graphed_decode_equals_eager(preset, batch):
    torch.manual_seed(0)
    cfg = ModelConfig(preset=preset)
    model = HybridLM(cfg).cuda()
    bucket = batch_bucket(batch)
    prompts = torch.randint(0, cfg.vocab_size, (bucket, 20), device="cuda")
    lengths = torch.randint(1, 21, (bucket,), device="cuda")
    n_new = 24
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cache = model.allocate_cache(bucket, 20 + n_new + 1)
        first = model.prefill(prompts, lengths, cache).float()
        eager_tokens, eager_last = _greedy(lambda t: model.decode_step(t, cache), first, n_new)
        eager_state = [s.ssm.clone() for s in cache.layers if hasattr(s, "ssm")]

        graphed = GraphedDecoder(model, cache)
        model.prefill(prompts, lengths, cache)  # the same cache, refilled: the graph stays valid
        snapshot = cache.lengths.clone()
        graphed_tokens, graphed_last = _greedy(graphed, first, n_new)
    assert torch.equal(graphed_tokens[:batch], eager_tokens[:batch])
    torch.testing.assert_close(graphed_last, eager_last, atol=1e-3, rtol=1e-3)
    assert torch.equal(cache.lengths, snapshot + n_new)
    for mine, ref in zip((s.ssm for s in cache.layers if hasattr(s, "ssm")), eager_state, strict=True):
        torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_capture_leaves_the_cache_as_it_was():
    torch.manual_seed(1)
    cfg = ModelConfig(preset="tiny")
    model = HybridLM(cfg).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cache = model.allocate_cache(4, 16)
        model.prefill(
            torch.randint(0, cfg.vocab_size, (4, 6), device="cuda"), torch.tensor([6, 2, 4, 1]), cache
        )
        before = [t.clone() for s in cache.layers if s is not None for t in vars(s).values()]
        lengths, longest = cache.lengths.clone(), cache.longest
        GraphedDecoder(model, cache)
    after = [t for s in cache.layers if s is not None for t in vars(s).values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert torch.equal(cache.lengths, lengths) and cache.longest == longest


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scale", ["tensor", "row"])
def test_graphed_nvfp4_decode_with_held_weights_equals_eager(scale):
    """NVFP4 with the weights held (the sampler's forward): every replay reduces its activation amax
    into words zeroed inside the graph, so the 30th replay's logits are the eager step's (a word
    zeroed once before the capture would carry every earlier replay's amax into the next, moving the
    scales by up to 2x)."""
    from inkling_fp4.precision.config import PrecisionConfig
    from inkling_fp4.precision.policy import PrecisionPolicy

    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny")
    model = HybridLM(cfg).cuda().eval()
    policy = PrecisionPolicy(PrecisionConfig(recipe="nvfp4", activation_scale=scale), cfg.n_layers)
    policy.apply(model)
    policy.freeze_weights(model)
    prompts = torch.randint(0, cfg.vocab_size, (4, 12), device="cuda")
    lengths = torch.tensor([12, 3, 7, 1], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        cache = model.allocate_cache(4, 48)
        first = model.prefill(prompts, lengths, cache).float()
        eager_tokens, eager_last = _greedy(lambda t: model.decode_step(t, cache), first, 30)
        graphed = GraphedDecoder(model, cache)
        model.prefill(prompts, lengths, cache)
        graphed_tokens, graphed_last = _greedy(graphed, first, 30)
    assert torch.equal(graphed_tokens, eager_tokens)
    torch.testing.assert_close(graphed_last, eager_last, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_torch_twins_are_not_captured():
    from inkling_fp4.model.compiled import reference_glue

    model = HybridLM(ModelConfig(preset="tiny")).cuda()
    with reference_glue(), pytest.raises(ValueError, match="twins"):
        GraphedDecoder(model, model.allocate_cache(2, 8))

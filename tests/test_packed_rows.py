"""The RL trainer's packed forward (rl/packed_rows.py): every token placed once and mapped back,
rows no longer than asked for, and the log-probabilities, entropies, loss and gradients of a packed
forward equal those of the rows padded to the longest (FP32, a hybrid with Mamba-2 and attention)."""

from __future__ import annotations

import torch

from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.rl.config import RLConfig
from inkling_fp4.rl.packed_rows import pack_rows, unpack
from inkling_fp4.rl.policy_loss import PolicyLossFn, forward_logprobs
from inkling_fp4.rl.rollout_batch import RolloutBatch, build_rows, row_lengths

CFG = ModelConfig(pattern="M*-M", vocab_size=97, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64,
                  mamba_heads=4, mamba_head_dim=16, n_groups=1, d_state=8, chunk_size=8)  # fmt: skip


def rollouts(seed: int, n: int = 7):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 97, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]  # fmt: skip
    completions = [torch.randint(3, 97, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(n)]  # fmt: skip
    logps = [[-1.0] * len(c) for c in completions]
    return prompts, completions, logps


def test_every_token_is_placed_once_and_comes_back():
    prompts, completions, logps = rollouts(0, 11)
    ids, tgt, mask, _ = build_rows(prompts, completions, logps, pad_id=0)
    lengths = row_lengths(prompts, completions)
    rows = pack_rows(ids, tgt, lengths, row_len=40, pad_id=0)
    P, S = rows.input_ids.shape
    assert S == 40 and P < ids.shape[0]  # fewer rows than sequences: they share rows
    real = rows.index >= 0
    assert torch.equal(real.sum(1), lengths) and rows.index[real].unique().numel() == int(lengths.sum())
    assert torch.equal(unpack(rows.input_ids, rows.index)[real], ids[real])
    assert torch.equal(unpack(rows.targets, rows.index)[real], tgt[real])
    docs = rows.doc_ids.reshape(-1)[rows.index.clamp(min=0)]
    assert torch.equal(docs[real], torch.arange(len(prompts))[:, None].expand_as(ids)[real])
    assert torch.equal(
        unpack(rows.input_ids, rows.index)[~real], torch.zeros(int((~real).sum()), dtype=torch.long)
    )
    long_rows = pack_rows(ids, tgt, lengths, row_len=4, pad_id=0)  # shorter than a sequence: the longest
    assert long_rows.input_ids.shape[1] == int(lengths.max())


def test_a_packed_forward_equals_the_padded_one():
    torch.manual_seed(0)
    model = HybridLM(CFG).double()
    prompts, completions, logps = rollouts(1)
    ids, tgt, mask, s_logp = build_rows(prompts, completions, logps, pad_id=0)
    lengths = row_lengths(prompts, completions)
    padded = forward_logprobs(model, ids, tgt, True, 0.7)
    packed = forward_logprobs(model, ids, tgt, True, 0.7, lengths, pack=(48, 0))
    for a, b in zip(padded, packed, strict=True):
        assert torch.allclose(a[mask], b[mask], atol=1e-10, rtol=0)
    adv = torch.randn(len(prompts), dtype=torch.float64)
    batch = RolloutBatch(
        ids, tgt, mask, adv, s_logp.double(), s_logp.double(), mask.double(), lengths=lengths
    )
    grads = []
    for pack in (None, (48, 0)):
        model.zero_grad()
        loss = PolicyLossFn(RLConfig(entropy_coef=0.01), 0.7, on_policy=True, pack=pack)(model, batch)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-10, rtol=0)
    # the linears multiply in BF16 whatever the model's dtype, and the packed GEMMs have other shapes, so
    # their FP32 sums may round to another BF16 here and there: a few parts in 1e6 of a gradient's norm
    # (a packing that mixed sequences would be off by its whole size)
    for ga, gb in zip(grads[0][1], grads[1][1], strict=True):
        assert (ga - gb).norm() <= 1e-4 * gb.norm() + 1e-12

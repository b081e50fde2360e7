"""GRPO's pieces and the mismatch figures against hand-computed values, plus random checks of the
identities between them."""

import math

import pytest
import torch

from fresh_seed import fresh_generator
from inkling_fp4.rl import grpo, mismatch


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0]])
    std0 = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    std2 = math.sqrt(0.25)  # unbiased std of [1, 0, 0, 0] = sqrt(0.75 / 3)
    a = grpo.group_advantages(r, "group", eps=0.0)
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std0)
    assert torch.equal(a[1], torch.zeros(4))  # a zero-variance group carries no signal
    assert torch.allclose(a[2], torch.tensor([0.75, -0.25, -0.25, -0.25]) / std2)
    none = grpo.group_advantages(r, "none")
    assert torch.allclose(none[2], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    batch = grpo.group_advantages(r, "batch", eps=0.0)
    assert torch.allclose(batch, none / r.std())
    assert grpo.zero_variance_groups(r).tolist() == [False, True, False]


def test_completions_left_out_of_the_loss_are_left_out_of_the_baseline():
    """A group of wrong answers (0.1) and searches the budget cut (0): with the cut ones counted, the
    wrong answers sit above the baseline (advantage +0.87 after the std) and RL would teach stopping
    early; not counted, the group has no signal. Counted over a subset, the advantages are those of
    the subset alone, in every scale."""
    r = torch.tensor([[0.1, 0.1, 0.0, 0.0], [1.0, 0.1, 0.0, 0.1], [1.0, 0.0, 0.1, 0.0]])
    counted = torch.tensor([[True, True, False, False], [True, True, False, True], [False, True, True, True]])
    lifted = 0.05 / (math.sqrt(0.01 / 3) + 1e-4)  # |r - mean| over the unbiased std, TRL's epsilon
    assert torch.allclose(grpo.group_advantages(r)[0], torch.tensor([1.0, 1.0, -1.0, -1.0]) * lifted)
    for scale in grpo.SCALES:
        a = grpo.group_advantages(r, scale, counted_NG=counted)
        assert torch.equal(a[0], torch.zeros(4)) and torch.equal(a[~counted], torch.zeros(4))
        for i in (1, 2):  # a counted subset gets what it would get alone
            alone = grpo.group_advantages(r[i, counted[i]][None], "group" if scale == "batch" else scale)[0]
            if scale != "batch":
                assert torch.allclose(a[i, counted[i]], alone, atol=1e-6), (scale, i)
        if scale == "batch":  # one std over every counted reward of the batch
            centred = grpo.group_advantages(r, "none", counted_NG=counted)
            assert torch.allclose(a, centred / (r[counted].std() + 1e-4), atol=1e-6)
    assert grpo.zero_variance_groups(r, counted).tolist() == [True, False, False]
    one = torch.tensor([[True, False, False, False]] * 3)  # fewer than two counted: no signal
    assert grpo.zero_variance_groups(r, one).tolist() == [True, True, True]
    assert torch.equal(grpo.group_advantages(r, "group", counted_NG=one), torch.zeros(3, 4))
    # all counted is the plain baseline, fresh rewards
    fresh = torch.rand(6, 8, generator=fresh_generator()).round(decimals=1)
    for scale in grpo.SCALES:
        full = torch.ones(6, 8, dtype=torch.bool)
        assert torch.allclose(grpo.group_advantages(fresh, scale, counted_NG=full),
                              grpo.group_advantages(fresh, scale), atol=1e-6)  # fmt: skip
    assert torch.equal(grpo.zero_variance_groups(fresh, full), grpo.zero_variance_groups(fresh))


def test_clipped_loss_with_asymmetric_bounds_by_hand():
    # one completion of 4 tokens with A = +1 and one with A = -1; ratios chosen around the bounds
    ratios = torch.tensor([[0.5, 1.0, 1.25, 1.5], [0.5, 0.75, 1.0, 1.5]])
    old = torch.zeros(2, 4)
    logp = torch.log(ratios)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 4)
    out = grpo.clipped_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    # A > 0: -min(rho, clip(rho, 0.8, 1.28)) -> rho 0.5 -> -0.5 (unclipped smaller), 1.5 -> -1.28
    # A < 0: -min(-rho, -clip(rho)) = max(rho, clip(rho)) -> 0.5 -> 0.8, 1.5 -> 1.5
    expected = torch.tensor([[-0.5, -1.0, -1.25, -1.28], [0.8, 0.8, 1.0, 1.5]])
    assert torch.allclose(out.loss_BT, expected, atol=1e-6)
    assert out.clipped_high_BT.tolist() == [[False, False, False, True], [False] * 4]
    assert out.clipped_low_BT.tolist() == [[False] * 4, [True, True, False, False]]


def test_aggregations_by_hand_and_as_trainer_weights():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert grpo.aggregate(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert grpo.aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert grpo.aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    g = fresh_generator()
    for mode in grpo.AGGREGATIONS:  # the trainer's form: sum(w L) / trained tokens
        loss = torch.randn(5, 7, generator=g)
        mask = torch.rand(5, 7, generator=g) < 0.7
        mask[:, 0] = True
        w = grpo.token_weights(mask, mode)
        assert (w * loss).sum() / mask.sum() == pytest.approx(
            grpo.aggregate(loss, mask, mode).item(), rel=1e-5
        )


def test_gspo_sequence_ratio_is_shared_by_the_tokens():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.5, -2.0, -2.5], [-1.0, -2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    lr = grpo.log_ratio(logp, old, mask, "sequence")
    assert torch.allclose(lr[0], torch.zeros(3))  # (+0.5 + 0 - 0.5) / 3
    assert torch.allclose(lr[1], torch.tensor([0.5, 0.5, 0.0]))  # (0 + 1) / 2, masked token 0


def test_k3_by_hand_and_nonnegative():
    assert grpo.k3_kl(torch.tensor([0.0]), torch.tensor([0.0])).item() == 0.0
    d = 0.3
    expected = math.exp(d) - d - 1
    assert grpo.k3_kl(torch.tensor([-1.0]), torch.tensor([-0.7])).item() == pytest.approx(expected, rel=1e-5)
    g = fresh_generator()
    x, y = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (grpo.k3_kl(x, y) >= 0).all()


def test_mismatch_figures_tis_and_masking_by_hand():
    sampler = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    trainer = torch.log(torch.tensor([[0.5, 1.0, 0.25], [0.5, 0.5, 0.9]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    s = mismatch.mismatch_stats(trainer, sampler, mask, cap=1.5)
    d = torch.tensor([0.0, math.log(2), math.log(0.5), 0.0, 0.0], dtype=torch.float64)
    assert s["k3"] == pytest.approx(float((torch.exp(-d) + d - 1).mean()))
    assert s["abs_max"] == pytest.approx(math.log(2)) and s["abs_mean"] == pytest.approx(2 * math.log(2) / 5)
    assert (s["ratio_min"], s["ratio_max"]) == (pytest.approx(0.5), pytest.approx(2.0))
    assert s["ratio_mean"] == pytest.approx((1 + 2 + 0.5 + 1 + 1) / 5)
    assert s["frac_over_cap"] == pytest.approx(2 / 5)  # 2.0 > 1.5 and 0.5 < 1 / 1.5
    tis = mismatch.correction_weights(trainer, sampler, mask, "tis", cap=1.5)
    assert torch.allclose(tis, torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.0, 0.0]]))
    masked = mismatch.correction_weights(trainer, sampler, mask, "mask", cap=1.5)
    assert masked.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]  # per token; the padded 0.9 does not count
    assert torch.equal(mismatch.correction_weights(trainer, sampler, mask, "none", cap=1.5), mask.float())


def test_sequence_level_and_bypass_corrections_by_hand():
    """TRL's sequence_truncate / sequence_mask: one weight per completion, exp of its summed log
    ratio; in bypass mode mask only rejects (0 / 1) and tis is refused."""
    sampler = torch.log(torch.full((2, 3), 0.5))
    trainer = torch.log(torch.tensor([[0.5, 1.0, 0.5], [0.4, 0.5, 0.9]]))  # ratios [1, 2, 1], [0.8, 1, pad]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    tis = mismatch.correction_weights(trainer, sampler, mask, "tis", cap=1.5, level="sequence")
    assert torch.allclose(tis, torch.tensor([[1.5, 1.5, 1.5], [0.8, 0.8, 0.0]]))
    masked = mismatch.correction_weights(trainer, sampler, mask, "mask", cap=1.5, level="sequence")
    assert torch.allclose(masked, torch.tensor([[0.0, 0.0, 0.0], [0.8, 0.8, 0.0]]))
    token = mismatch.correction_weights(trainer, sampler, mask, "mask", cap=1.5, reweight=False)
    assert token.tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="bypass"):
        mismatch.correction_weights(trainer, sampler, mask, "tis", cap=1.5, reweight=False)


def test_policy_loss_fn_is_the_formula_with_kl_and_entropy():
    """PolicyLossFn on fixed logits equals sum a * (c * L_clip + kl_coef * k3) - entropy_coef * sum H
    (TRL's order: the correction c weights the surrogate only, the entropy is a plain token sum),
    all of logits / T; its figures sum over the step's micro batches."""
    import torch.nn.functional as F

    from inkling_fp4.rl.config import RLConfig
    from inkling_fp4.rl.policy_loss import PolicyLossFn
    from inkling_fp4.rl.rollout_batch import RolloutBatch

    g = fresh_generator()
    B, L, V, T = 3, 5, 7, 0.7
    logits = torch.randn(B, L, V, generator=g)
    targets = torch.randint(0, V, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) < 0.7
    old = torch.randn(B, L, generator=g) * 0.1 - 2
    ref = torch.randn(B, L, generator=g) * 0.1 - 2
    adv = torch.randn(B, generator=g)
    a = torch.rand(B, L, generator=g)
    c = torch.rand(B, L, generator=g) + 0.5
    batch = RolloutBatch(torch.zeros(B, L, dtype=torch.long), targets, mask, adv, old, old, a, ref_logp=ref,
                         correction=c)  # fmt: skip
    cfg = RLConfig(kl_coef=0.05, entropy_coef=0.01, eps_low=0.2, eps_high=0.28)
    fn = PolicyLossFn(cfg, temperature=T)
    got = fn(lambda ids, doc_ids=None: logits, batch)
    logp_all = F.log_softmax(logits / T, -1)
    logp = logp_all.gather(-1, targets[..., None])[..., 0]
    rho = torch.exp((logp - old) * mask)
    surrogate = -torch.minimum(rho * adv[:, None], rho.clamp(0.8, 1.28) * adv[:, None]) * mask
    kl = (torch.exp(ref - logp) - (ref - logp) - 1) * mask
    ent = -(logp_all.exp() * logp_all).sum(-1) * mask
    want = (a * (c * surrogate + 0.05 * kl)).sum() - 0.01 * ent.sum()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    fn(lambda ids, doc_ids=None: logits, batch)  # a second micro batch of the same step
    figures = fn.figures()
    assert figures["kl_ref"] == pytest.approx(float(kl.sum() / mask.sum()), rel=1e-5)
    fn.new_step()
    assert fn.figures() == {}


def test_on_policy_ratio_is_exactly_one_and_its_gradient_is_the_advantage_weighted_score():
    """With one update per rollout the old log p is the training forward's own: ratio 1 whatever the
    stored old log p, no clipping, and the gradient of the loss is -sum a * A * grad log p."""
    import torch.nn.functional as F

    from inkling_fp4.rl.config import RLConfig
    from inkling_fp4.rl.policy_loss import PolicyLossFn
    from inkling_fp4.rl.rollout_batch import RolloutBatch

    g = fresh_generator()
    B, L, V = 4, 6, 9
    logits = torch.randn(B, L, V, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    far = torch.full((B, L), -30.0)  # a stored old log p that would clip every token
    adv = torch.randn(B, generator=g) * 3
    batch = RolloutBatch(torch.zeros(B, L, dtype=torch.long), targets, mask, adv, far, far, mask.float())
    fn = PolicyLossFn(RLConfig(), on_policy=True)
    fn(lambda ids, doc_ids=None: logits, batch).backward()
    assert fn.figures()["clip_low"] == 0 and fn.figures()["clip_high"] == 0
    logits2 = logits.detach().clone().requires_grad_(True)
    logp = F.log_softmax(logits2, -1).gather(-1, targets[..., None])[..., 0]
    (-(adv[:, None] * logp).sum()).backward()
    assert torch.allclose(logits.grad, logits2.grad, atol=1e-6)

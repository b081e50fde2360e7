"""The policy-gradient loss of one micro batch of rollouts, in the shared trainer's form.

The trainer divides a micro batch's summed loss by the trained-token count of the whole step, so the
loss here is ``sum_bt w_bt * l_bt`` with

    l_bt = L_bt (GRPO's clipped surrogate, rl/grpo.py)
         + kl_coef * k3(logp, ref_logp)          (the KL penalty to the frozen reference, optional)
         - entropy_coef * H_bt                   (an entropy bonus, optional)
    w_bt = the aggregation's token weight x the mismatch correction (rl/grpo.token_weights,
           rl/mismatch.correction_weights; built with the batch, no gradient)

The forward is the trainer's (its precision recipe: NVFP4 forward and the recipe's backward), and
full logits are taken for the log-probabilities and the entropy (a rollout's rows are short).
Figures of the last call (clip fractions, KL, entropy) are kept for the step's metrics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inkling_fp4.rl import grpo
from inkling_fp4.rl.config import RLConfig
from inkling_fp4.rl.rollout_batch import RolloutBatch, token_logprobs


class PolicyLossFn:
    """``loss_fn(train_model, batch)`` for :meth:`Trainer.step`."""

    fits_data = False
    """The clipped surrogate measures no fit to data (near zero, of either sign): the noise monitor
    tests it for finiteness only (``train/monitor.py``)."""

    def __init__(self, cfg: RLConfig):
        self.cfg = cfg
        self._sums: dict[str, torch.Tensor] = {}

    def new_step(self) -> None:
        """Forget the previous optimizer step's figures."""
        self._sums = {}

    def figures(self, sum_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """This step's clip fractions (and KL to the reference), per trained token; with
        ``sum_ranks`` (a sum over the processes of a host tensor) per trained token of every rank."""
        sums = dict(self._sums) if sum_ranks is None else self._summed(sum_ranks)
        n = sums.pop("tokens", None)
        return {} if n is None else {k: float(v / n.clamp(min=1)) for k, v in sums.items()}

    def _summed(self, sum_ranks: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's sums added up. The keys are fixed, not the ones this rank recorded: a rank
        whose step failed before its first loss has none, and every rank must reduce the same tensor."""
        keys = ("tokens", "clip_low", "clip_high") + (("kl_ref",) if self.cfg.kl_coef > 0 else ())
        zero = torch.zeros((), dtype=torch.float64)
        total = sum_ranks(torch.stack([self._sums.get(k, zero).cpu() for k in keys]))
        return dict(zip(keys, total, strict=True))

    def __call__(self, model, b: RolloutBatch) -> torch.Tensor:
        cfg = self.cfg
        logits_BLV = model(b.input_ids, doc_ids=b.doc_ids)
        logp_BL, ent_BL = token_logprobs(logits_BLV, b.targets, entropy=cfg.entropy_coef > 0)
        mask = b.loss_mask
        pl = grpo.clipped_policy_loss(
            logp_BL, b.old_logp, b.advantages, mask, cfg.eps_low, cfg.eps_high, cfg.ratio_level
        )
        loss_BL = pl.loss_BT
        parts = {
            "tokens": mask.sum(),
            "clip_low": pl.clipped_low_BT.sum(),
            "clip_high": pl.clipped_high_BT.sum(),
        }
        if cfg.kl_coef > 0 and b.ref_logp is not None:
            kl_BL = grpo.k3_kl(logp_BL, b.ref_logp) * mask
            loss_BL = loss_BL + cfg.kl_coef * kl_BL
            parts["kl_ref"] = kl_BL.detach().sum()
        if ent_BL is not None:
            loss_BL = loss_BL - cfg.entropy_coef * ent_BL * mask
        for key, value in parts.items():
            self._sums[key] = self._sums.get(key, 0) + value.detach().double()
        return (loss_BL * b.weights).sum()

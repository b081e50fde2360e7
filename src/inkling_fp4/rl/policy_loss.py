"""The policy-gradient loss of one micro batch of rollouts, in the shared trainer's form.

The trainer divides the summed loss by the step's trained-token count; in TRL's order of terms:

    sum_bt a_bt * (c_bt * L_bt + kl_coef * k3(logp, ref_logp)_bt)  -  entropy_coef * sum_bt H_bt

    L_bt   GRPO's clipped surrogate (rl/grpo.py) of the ratio to the old policy
    c_bt   the mismatch correction's importance weight (rl/mismatch.py; 1 without one)
    a_bt   the aggregation's token weight (rl/grpo.token_weights)
    H_bt   the entropy: a plain mean over the step's completion tokens, whatever the aggregation

Log-probabilities and the entropy are those of logits / T (T = sampler.temperature). With one update
per rollout and the trainer's old policy, the old log p is the training forward's own, detached, so
the ratio is exactly 1 whatever the recipe's arithmetic (a no-grad forward would differ under delayed
FP8 scaling). Full logits are computed: rollout rows are short.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inkling_fp4.rl import grpo, mismatch
from inkling_fp4.rl.config import RLConfig
from inkling_fp4.rl.packed_rows import pack_rows, unpack
from inkling_fp4.rl.rollout_batch import RolloutBatch, token_logprobs


class PolicyLossFn:
    """``loss_fn(train_model, batch)`` for :meth:`Trainer.step`."""

    fits_data = False
    """The clipped surrogate measures no fit to data (near zero, of either sign): the noise monitor
    tests it for finiteness only (``trainer/monitor.py``)."""

    def __init__(
        self,
        cfg: RLConfig,
        temperature: float = 1.0,
        on_policy: bool = False,
        pack: tuple[int, int] | None = None,
        correct_from_forward: bool = False,
    ):
        """``pack``: (row length, pad id) to run the forward on packed rows (``rl/packed_rows.py``).
        ``correct_from_forward`` (on-policy only): the correction weights come from this forward's own
        log p, detached, against the sampler's, and the forward keeps its log p and entropy for the
        step's mismatch figures (:meth:`forward_figures`), so a step needs no separate recompute pass.
        """
        if correct_from_forward and not on_policy:
            raise ValueError("correct_from_forward needs on_policy: the old policy is this forward's")
        self.cfg, self.temperature, self.on_policy, self.pack = cfg, temperature, on_policy, pack
        self.correct_from_forward = correct_from_forward
        self._sums: dict[str, torch.Tensor] = {}
        self._forward: list[tuple[torch.Tensor, torch.Tensor]] = []

    def new_step(self) -> None:
        self._sums, self._forward = {}, []

    def forward_figures(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(log p, entropy) [n, L] of this step's micro batches so far, in their row order (None before
        the first): with ``correct_from_forward``, what the mismatch and entropy figures are taken from."""
        if not self._forward:
            return None
        return torch.cat([lp for lp, _ in self._forward]), torch.cat([h for _, h in self._forward])

    def figures(self, sum_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """This step's clip fractions (and KL to the reference) per trained token; with ``sum_ranks``,
        over every rank."""
        sums = dict(self._sums) if sum_ranks is None else self._summed(sum_ranks)
        n = sums.pop("tokens", None)
        return {} if n is None else {k: float(v / n.clamp(min=1)) for k, v in sums.items()}

    def _summed(self, sum_ranks: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's sums added up. NOTE the keys are fixed, not this rank's: a rank whose step failed
        before its first loss has none, and every rank must reduce the same tensor."""
        keys = ("tokens", "clip_low", "clip_high") + (("kl_ref",) if self.cfg.kl_coef > 0 else ())
        zero = torch.zeros((), dtype=torch.float64)
        total = sum_ranks(torch.stack([self._sums.get(k, zero).cpu() for k in keys]))
        return dict(zip(keys, total, strict=True))

    def __call__(self, model, b: RolloutBatch) -> torch.Tensor:
        cfg = self.cfg
        bonus = cfg.entropy_coef > 0
        want_entropy = bonus or self.correct_from_forward
        logp_BL, ent_BL = forward_logprobs(model, b.input_ids, b.targets, want_entropy, self.temperature,
                                           b.lengths, self.pack, entropy_grad=bonus)  # fmt: skip
        mask = b.loss_mask
        old_BL = logp_BL.detach() if self.on_policy else b.old_logp
        pl = grpo.clipped_policy_loss(
            logp_BL, old_BL, b.advantages, mask, cfg.eps_low, cfg.eps_high, cfg.ratio_level
        )
        correction = b.correction
        if self.correct_from_forward:
            correction = mismatch.correction_weights(
                old_BL, b.sampler_logp, mask, cfg.correction, cfg.tis_cap, cfg.correction_level
            )
            self._forward.append((old_BL, ent_BL.detach()))
        loss_BL = pl.loss_BT if correction is None else pl.loss_BT * correction
        parts = {
            "tokens": mask.sum(),
            "clip_low": pl.clipped_low_BT.sum(),
            "clip_high": pl.clipped_high_BT.sum(),
        }
        if cfg.kl_coef > 0 and b.ref_logp is not None:
            kl_BL = grpo.k3_kl(logp_BL, b.ref_logp) * mask
            loss_BL = loss_BL + cfg.kl_coef * kl_BL
            parts["kl_ref"] = kl_BL.detach().sum()
        for key, value in parts.items():
            self._sums[key] = self._sums.get(key, 0) + value.detach().double()
        loss = (loss_BL * b.weights).sum()
        if bonus:
            loss = loss - cfg.entropy_coef * (ent_BL * mask).sum()
        return loss


def forward_logprobs(model, input_ids_BL, targets_BL, entropy: bool, temperature: float, lengths_B=None,
                     pack: tuple[int, int] | None = None, entropy_grad: bool = True):  # fmt: skip
    """(log p of the targets [B, L], entropy [B, L] or None) of ``model``'s logits / T, on the rows as
    they are or packed (``pack`` = (row length, pad id), with ``lengths_B``)."""
    if pack is None or lengths_B is None:
        return token_logprobs(model(input_ids_BL), targets_BL, entropy, temperature, entropy_grad)
    rows = pack_rows(input_ids_BL, targets_BL, lengths_B, *pack)
    logp_PS, ent_PS = token_logprobs(model(rows.input_ids, doc_ids=rows.doc_ids), rows.targets, entropy,
                                     temperature, entropy_grad)  # fmt: skip
    return unpack(logp_PS, rows.index), None if ent_PS is None else unpack(ent_PS, rows.index)

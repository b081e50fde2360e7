"""DAPO's dynamic sampling (rl/dynamic_sampling.py): which groups of an oversampled step train."""

from types import SimpleNamespace

import pytest
import torch

from inkling_fp4.rl import grpo, ranks
from inkling_fp4.rl.dynamic_sampling import kept_groups as kept_of


def kept_groups(rewards_SG, world, keep):
    return kept_of(grpo.zero_variance_groups(rewards_SG), world, keep)


SIGNAL, FLAT = [0.0, 1.0], [1.0, 1.0]


def test_signal_groups_first_in_prompt_order_then_the_others():
    rewards = torch.tensor([FLAT, SIGNAL, FLAT, SIGNAL, SIGNAL, FLAT])
    assert kept_groups(rewards, 1, 2) == [1, 3]
    assert kept_groups(rewards, 1, 3) == [1, 3, 4]
    assert kept_groups(rewards, 1, 4) == [0, 1, 3, 4]  # signal ran out: the first flat one fills
    assert kept_groups(rewards, 1, 6) == list(range(6))


def test_each_rank_keeps_its_share_from_its_own_groups():
    # rank 0 holds groups 0-3 (one with a signal), rank 1 groups 4-7 (three)
    rewards = torch.tensor([FLAT, FLAT, SIGNAL, FLAT, SIGNAL, SIGNAL, FLAT, SIGNAL])
    kept = kept_groups(rewards, 2, 4)
    assert kept == [0, 2, 4, 5]  # one process would keep [2, 4, 5, 7]; a rank trains only its own rows
    assert kept_groups(rewards, 1, 4) == [2, 4, 5, 7]
    for rank in (0, 1):  # the rollout's slicing: this rank's kept groups, as indices into its own share
        dist = SimpleNamespace(rank=rank, world_size=2)
        first = ranks.rank_share(range(8), dist).start
        own = [i - first for i in ranks.rank_share(kept, dist)]
        assert all(0 <= i < 4 for i in own) and [first + i for i in own] == kept[2 * rank : 2 * rank + 2]


def test_equal_rewards_of_any_value_have_no_signal():
    rewards = torch.tensor([[0.5, 0.5], [0.0, 0.1], [0.0, 0.0], [0.2, 0.2]])
    assert kept_groups(rewards, 1, 1) == [1]


@pytest.mark.parametrize("S, world, keep", [(6, 4, 2), (8, 2, 3), (4, 1, 5)])
def test_shares_that_do_not_divide_are_refused(S, world, keep):
    with pytest.raises(ValueError, match="at most all, by equal shares"):
        kept_of(torch.zeros(S, dtype=torch.bool), world, keep)

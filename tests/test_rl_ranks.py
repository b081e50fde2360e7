"""rl/ranks.py in one process (the torchrun test, tests/test_rollout_distributed.py, runs it on two):
each rank's share of a step's prompts, and the step's figures from its completions."""

import pytest
import torch

from inkling_fp4.distributed import DistInfo
from inkling_fp4.rl import ranks


@pytest.mark.parametrize("n", [0, 1, 5, 8, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shares_are_contiguous_and_cover_every_item_once(n, world):
    items = list(range(n))
    shares = [ranks.rank_share(items, DistInfo(rank=r, world_size=world)) for r in range(world)]
    assert [x for share in shares for x in share] == items
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1
    tensor_shares = [
        ranks.rank_share(torch.arange(n), DistInfo(rank=r, world_size=world)) for r in range(world)
    ]
    assert [t.tolist() for t in tensor_shares] == shares


def test_one_process_figures():
    dist = DistInfo()
    rewards, lengths, truncated = [1.0, 0.0, 0.1, 1.0, 0.0, 0.0], [3, 7, 2, 9, 1, 4], [False, True] * 3
    r_PG, n, t = ranks.all_completions(rewards, lengths, truncated, 3, dist)
    assert r_PG.tolist() == [[1.0, 0.0, pytest.approx(0.1)], [1.0, 0.0, 0.0]]
    assert n.tolist() == lengths and t.tolist() == truncated
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, False, True], [False, False, True]])
    assert ranks.token_mean(x, mask, dist) == pytest.approx((1 + 3 + 6) / 3)
    assert ranks.token_mean(x, torch.zeros_like(mask), dist) == 0.0

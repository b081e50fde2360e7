"""The training stages (pretrain, sft, rollout) and compare-baseline."""

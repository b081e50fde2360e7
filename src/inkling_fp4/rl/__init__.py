"""RL: built-in tasks and their rewards, rollouts sampled under NVFP4, the policy update."""

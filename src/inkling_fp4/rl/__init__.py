"""RL: rollouts sampled under NVFP4, rewards, policy update."""

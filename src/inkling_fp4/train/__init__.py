"""Schedules, optimizer, the training loop, checkpoints and metrics."""

"""Run directories: the config and metrics a run records, its lock, checkpoints, schedule, and finding one."""

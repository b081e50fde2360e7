"""The shared trainer: one step and fit loop for every stage (LR, switch, monitor, AdamW, graphs)."""

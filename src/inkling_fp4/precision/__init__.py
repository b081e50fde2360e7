"""Precision recipes, the per-layer policy and QuantLinear: where the paper's recipe becomes behaviour."""

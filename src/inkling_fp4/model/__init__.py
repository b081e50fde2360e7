"""The hybrid Mamba-2 / attention / MLP language model."""

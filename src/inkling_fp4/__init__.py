"""fp4train: train hybrid Mamba-Transformer language models with NVFP4 4-bit forward passes."""

__version__ = "0.1.0"

"""The fused FP8 training paths (delayed scaling): layers.py swaps them in (``fuse_fp8``); each other
module is one producer writing its consumer's operand as FP8, with ``applies`` saying when it runs.
The plain model never imports them.
"""

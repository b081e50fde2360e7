"""Number formats: E2M1, E4M3/E5M2, E8M0 and the NVFP4 / MXFP4 / FP8 quantizers (no nn.Module here)."""

"""Check that the torch reference quantizers give the same bits on CUDA as on CPU.

Why: the reference is the oracle for the Triton kernels and runs on the GPU in their tests, so
torch's CUDA FP32→FP8 casts, divisions and reciprocals must round exactly like the CPU ones.
Compares NVFP4 (1D, 2D, RHT-transposed), MXFP4 and FP8 (tensorwise, 1×128, 128×128) codes and
scale bytes on random and adversarial inputs; prints one line per case and exits 1 on a mismatch.
The ``fp8_*padded`` / ``fp8_t_narrow`` cases compare the FP8 kernel (CUDA) on widths that are not
multiples of 128 with the reference (CPU) on the zero-padded input.
The ``mxfp4*`` cases also compare the MXFP4 kernel (CUDA) with the reference (CPU): codes, scale
bytes and the BF16 block values it writes in the same pass.

    python scripts/check_numerics_cuda.py
"""

from __future__ import annotations

import sys

import torch

from inkling_fp4.numerics import fp8, mxfp4, nvfp4


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    signs = torch.where(torch.rand(256, 512, generator=g) < 0.5, -1.0, 1.0)
    return {
        "normal_bf16": torch.randn(256, 512, generator=g).bfloat16(),
        "normal_fp32": torch.randn(256, 512, generator=g),
        "huge_range": signs * torch.pow(10.0, torch.empty(256, 512).uniform_(-30, 30, generator=g)),
        "tiny": torch.randn(256, 512, generator=g) * 1e-40,
        "zeros": torch.zeros(256, 512),
        "partial_tiles": torch.randn(200, 512, generator=g),
    }


# The RHT's 16-term FP32 sums may round differently under cuBLAS's and MKL's summation orders
# when the terms span more than 24 bits (huge-range inputs): reported, not failed.
ORDER_DEPENDENT = {"rht", "nvfp4_rht_t"}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _differing(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> int:
    """Number of elements whose bits differ between the CPU and the CUDA results."""
    return sum(
        int(
            (
                x.contiguous().view(BITS[x.element_size()])
                != y.cpu().contiguous().view(BITS[y.element_size()])
            ).sum()
        )
        for x, y in zip(a, b, strict=True)
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    cases = {
        "nvfp4_1d": lambda x: (lambda t: (t.codes, t.scales, t.amax))(nvfp4.quantize_ref(x)),
        "nvfp4_2d": lambda x: (lambda t: (t.codes, t.scales, t.amax))(nvfp4.quantize_ref(x, block_2d=True)),
        "nvfp4_rht_t": lambda x: (lambda t: (t.codes, t.scales, t.amax))(nvfp4.quantize_rht_t_ref(x[:192])),
        "rht": lambda x: (nvfp4.rht(x),),
        "mxfp4": lambda x: (lambda t: (t.codes, t.scales))(mxfp4.quantize(x)),
        "mxfp4_ref": lambda x: (lambda t: (t.codes, t.scales))(mxfp4.quantize_ref(x)),
        # CUDA: the kernel's one-pass BF16 block values; CPU: the reference's decode
        "mxfp4_values": lambda x: (lambda t, v: (t.codes, t.scales, v))(*mxfp4.quantize_with_values(x)),
        "mxfp4_values_only": lambda x: mxfp4.quantize_with_values(x, keep_codes=False)[1:],
        "fp8_tensor_e4m3": lambda x: (lambda t: (t.data, t.scale_inv))(fp8.quantize_tensorwise(x)),
        "fp8_tensor_e5m2": lambda x: (lambda t: (t.data, t.scale_inv))(
            fp8.quantize_tensorwise(x, dtype=torch.float8_e5m2)
        ),
        "fp8_1x128": lambda x: (lambda t: (t.data, t.scale_inv))(fp8.quantize_blockwise(x)),
        "fp8_128x128": lambda x: (lambda t: (t.data, t.scale_inv))(
            fp8.quantize_blockwise(x, block=(128, 128))
        ),
        # x and xᵀ in 1x128 blocks from one kernel (CUDA) vs the two references (CPU); 128·k rows
        "fp8_1x128_pair": lambda x: (lambda r, c: (r.data, r.scale_inv, c.data, c.scale_inv))(
            *fp8.quantize_blockwise_pair(x[:128])
        ),
        # widths that are not 128·k (288 = 2·128 + 32, like a 6176-wide in_proj): the kernel writes the
        # zero padding itself (CUDA) vs the references on the F.pad-ded x (CPU); strided views of x
        "fp8_pair_padded": lambda x: (lambda r, c: (r.data, r.scale_inv, c.data, c.scale_inv))(
            *fp8.quantize_blockwise_pair(x[:128, :288], pad=True)
        ),
        "fp8_1x128_padded": lambda x: (lambda t: (t.data, t.scale_inv))(
            fp8.quantize_blockwise(x[:, :200], pad=True)
        ),
        "fp8_t_narrow": lambda x: (lambda t: (t.data, t.scale_inv))(fp8.quantize_blockwise_t(x[:128, :200])),
    }
    failures = 0
    for input_name, x in _inputs().items():
        for case_name, run in cases.items():
            differing = _differing(run(x), run(x.cuda()))
            exact = case_name not in ORDER_DEPENDENT
            failures += exact and differing > 0
            verdict = "ok" if differing == 0 else ("MISMATCH" if exact else "differs (summation order)")
            print(f"{case_name:16s} {input_name:14s} {differing:8d} differing  {verdict}")
    print(f"{failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

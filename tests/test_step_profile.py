"""The kernel groups of trainer/kernel_groups.py (log.profile_steps, bench_pretrain.py --profile):
every Triton kernel of the package lands in its group, not in "other", and the per-step arithmetic of
the breakdown."""

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import step_profile  # noqa: E402

KERNEL_DEF = re.compile(r"@triton\.jit[^\n]*\ndef (\w+_kernel|_conv_\w+)\(")
EXPECTED = {
    "numerics/kernels": "quantize, GEMM epilogue (Triton)",
    "model/ssd_kernels": "SSD scan (Triton)",
    "model/conv_triton.py": "conv (Triton)",
}


def _kernels_under(rel: str) -> list[str]:
    path = ROOT / "src" / "inkling_fp4" / rel
    files = [path] if path.is_file() else sorted(path.glob("*.py"))
    return [name for f in files for name in KERNEL_DEF.findall(f.read_text())]


@pytest.mark.parametrize("rel", sorted(EXPECTED))
def test_every_package_kernel_lands_in_its_group(rel):
    names = _kernels_under(rel)
    assert names, f"no Triton kernels found under {rel}"
    for name in names:
        assert step_profile.category(name) == EXPECTED[rel], name


@pytest.mark.parametrize(
    "kernel, group",
    [
        ("triton_poi_fused_add_mul_0", "fused glue (torch.compile)"),
        ("triton_red_fused__to_copy_rms_norm_1", "fused glue (torch.compile)"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM (cuBLAS / CUTLASS)"),
        ("nvjet_tst_192x192_64x3_2x1_v_bz_coopA_TNT", "GEMM (cuBLAS / CUTLASS)"),
        ("pytorch_flash::flash_bwd_kernel<Flash_bwd_kernel_traits>", "attention"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all-reduce (NCCL)"),
        ("_mamba_decode", "decode step (Triton: Mamba-2 step, GQA decode)"),
        ("_gqa_decode", "decode step (Triton: Mamba-2 step, GQA decode)"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdam>", "optimizer"),
        ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", step_profile.OTHER),
    ],
)
def test_library_kernels(kernel, group):
    assert step_profile.category(kernel) == group


def test_breakdown_is_per_step():
    events = [
        types.SimpleNamespace(key="_quantize_rows_kernel", device_time_total=600.0, count=30),
        types.SimpleNamespace(key="_rht_kernel", device_time_total=300.0, count=9),
        types.SimpleNamespace(key="nvjet_tst_x", cuda_time_total=1200.0, device_time_total=None, count=3),
    ]
    groups = step_profile.breakdown(events, steps=3)
    assert groups["quantize, GEMM epilogue (Triton)"] == (pytest.approx(0.3), 13)
    assert groups["GEMM (cuBLAS / CUTLASS)"] == (pytest.approx(0.4), 1)
    text = step_profile.format_breakdown("nvfp4", groups, wall_ms=1.0)
    assert "GPU busy" in text and "0.70 ms" in text and "GPU idle 0.30 ms" in text


def test_top_kernels_ranks_by_device_time_per_step():
    events = [
        types.SimpleNamespace(key="_rht_kernel", device_time_total=300.0, count=9),
        types.SimpleNamespace(key="void at::native::copy_kernel", device_time_total=900.0, count=60),
        types.SimpleNamespace(key="nvjet_tst_x", device_time_total=600.0, count=3),
    ]
    rows = step_profile.top_kernels(events, steps=3, n=2)
    assert [r[0] for r in rows] == ["void at::native::copy_kernel", "nvjet_tst_x"]
    assert rows[0][1:] == (step_profile.OTHER, pytest.approx(0.3), 20)
    text = step_profile.format_top(rows)
    assert "0.30 ms" in text and "copy_kernel" in text and "GEMM" in text


def _event(name, parent=None, device_us=0.0, seq=-1, device="CPU"):
    return types.SimpleNamespace(
        name=name, cpu_parent=parent, self_device_time_total=device_us, sequence_nr=seq,
        device_type=f"DeviceType.{device}",
    )  # fmt: skip


def test_top_sources_names_the_package_function_and_the_forward_of_a_backward_node():
    """GPU time goes to the innermost package functions around the op; an op of autograd's backward
    (no Python caller) is named by its node and the forward op with the same sequence number."""
    loop = _event("inkling_fp4/train/loop.py(10): step")
    linear = _event("inkling_fp4/precision/quant_linear.py(70): forward", loop)
    cast = _event("aten::_to_copy", linear, seq=7)
    copy_fwd = _event("aten::copy_", cast, device_us=300.0)
    node = _event("autograd::engine::evaluate_function: ToCopyBackward0", seq=7)
    copy_bwd = _event("aten::copy_", _event("aten::_to_copy", node), device_us=500.0)
    kernel = _event("void copy_kernel", device_us=999.0, device="CUDA")  # device events are not ops
    rows = step_profile.top_sources([loop, linear, cast, copy_fwd, node, copy_bwd, kernel], steps=2)
    where = "precision/quant_linear.py(70): forward <- train/loop.py(10): step"
    assert rows == [
        ("aten::copy_", f"ToCopyBackward0 of {where}", 0.25, 0),
        ("aten::copy_", where, 0.15, 0),
    ]
    text = step_profile.format_sources(rows)
    assert "ToCopyBackward0 of precision/quant_linear.py(70)" in text and "0.25 ms" in text

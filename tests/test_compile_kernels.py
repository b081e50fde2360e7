"""scripts/compile_kernels.py compiles, for a GPU this machine lacks, the kernels a kernel test
launches: a kernel that only Triton's compiler refuses (a loop bound it needs as a constexpr, given a
value) fails it with the kernel named, the same kernel written right passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

KERNEL_TEST = """
import torch
import triton
import triton.language as tl

from interpreter import kernel_test


@triton.jit
def _sum_rows(x_ptr, out_ptr, TILES: tl.constexpr, BLOCK: tl.constexpr):
    {rows}
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(rows):
        acc += tl.load(x_ptr + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.arange(0, BLOCK), acc)


@kernel_test
def test_sum_rows():
    x = torch.ones(4, 16)
    out = torch.empty(16)
    _sum_rows[(1,)](x, out, 2, 16)
    assert torch.equal(out, torch.full((16,), 4.0))
"""


def _compile(tmp_path: Path, rows: str) -> subprocess.CompletedProcess:
    test = tmp_path / "test_sum_rows.py"
    test.write_text(KERNEL_TEST.format(rows=rows))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-O", str(ROOT / "scripts" / "compile_kernels.py"), "-m", "gpu", str(test)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_a_kernel_only_the_compiler_refuses_fails_and_the_fixed_one_compiles(tmp_path):
    broken = _compile(tmp_path, "rows = TILES * BLOCK // 8")  # an assigned value: a tensor to the compiler
    assert broken.returncode == 1, broken.stdout[-3000:] + broken.stderr[-2000:]
    assert "_sum_rows does not compile" in broken.stdout and "1 kernel(s) failed" in broken.stdout
    fixed = _compile(tmp_path, "rows: tl.constexpr = TILES * BLOCK // 8")
    assert fixed.returncode == 0, fixed.stdout[-3000:] + fixed.stderr[-2000:]
    assert "compiled for sm_90: _sum_rows x1" in fixed.stdout

"""Count the eager torch ops and Triton launches of one QuantLinear layer's forward + backward.

Why: an emulated NVFP4 training step on a GPU is launch-bound when every quantized linear layer
issues dozens of small eager ops (casts, fills, scalar math) around its Triton quantizers and GEMMs;
the GPU then waits on the host. This script counts, per precision recipe, every aten op the layer
dispatches in one forward + backward (each one that is not a view or an allocation is a kernel
launch on a GPU) and every Triton kernel launch, grouped by name, so a change to the layer can be
measured op by op without a GPU.

It runs anywhere: on CUDA as is, on CPU with the Triton kernels in the interpreter
(``TRITON_INTERPRET=1``, set by this script before triton is imported unless ``--no-interpret``),
which takes the CUDA code path of the quantizers. The layer is built as the model builds it (a
``QuantLinear`` whose recipe and rounding generators come from a ``PrecisionPolicy``), and one
warm-up step runs first so that one-time work (caches, probes) is not counted.

NOTE on CPU, a few ops are CPU-only: the stochastic-rounding seed is drawn with ``torch.randint``
from a CPU generator (a CUDA generator's seed is host-side arithmetic), and BF16 GEMMs widen their
operands to FP32 first (``_to_copy``; on CUDA ``torch.mm(..., out_dtype=float32)``). The FP8 and
MXFP4 quantizers take their Triton kernels only for CUDA tensors, so on CPU those recipes count the
torch reference quantizers, not what a GPU launches. ``--where`` shows where each op comes from.

Usage:
    python scripts/count_linear_ops.py                          # M=256 K=256 N=512, all recipes
    python scripts/count_linear_ops.py --recipes nvfp4 --where  # plus each op's source line
    python scripts/count_linear_ops.py --m 4096 --k 2048 --n 4096 --x-dtype float32

Output per recipe: eager kernel ops (the number that matters), views/allocations (no kernel), host
syncs (``.item()``-like reads), Triton launches, then the ops grouped by name.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

RECIPES = ("bf16", "fp8", "nvfp4", "mxfp4")

# aten ops that launch no device kernel: views, metadata, allocations without a fill.
NO_KERNEL = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view", "_unsafe_view",
    "reshape", "t", "transpose", "permute", "expand", "as_strided", "slice", "select", "unsqueeze",
    "squeeze", "alias", "detach", "unflatten", "flatten", "view_as", "_reshape_alias", "split",
    "unbind", "lift_fresh", "set_", "resize_", "unfold", "diagonal", "narrow", "movedim",
}  # fmt: skip
HOST_SYNC = {"_local_scalar_dense", "item", "is_nonzero", "equal"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=256, help="tokens")
    p.add_argument("--k", type=int, default=256, help="in_features")
    p.add_argument("--n", type=int, default=512, help="out_features")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated: " + ", ".join(RECIPES))
    p.add_argument("--x-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--where", action="store_true", help="print the source line of every eager op")
    p.add_argument("--no-interpret", action="store_true", help="do not set TRITON_INTERPRET=1 on CPU")
    return p.parse_args(argv)


def op_name(func) -> str:
    return func.overloadpacket.__name__


def kind_of(func) -> str:
    name = op_name(func)
    if name in HOST_SYNC:
        return "sync"
    if name in NO_KERNEL or getattr(func, "is_view", False):
        return "no-kernel"
    return "kernel"


def source_line() -> str:
    """The innermost two frames of the package (or this script's layer call) that dispatched an op."""
    frames = [f for f in traceback.extract_stack()[:-3] if "inkling_fp4" in f.filename]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[::-1][:2])


class Census:
    """Counts aten ops (by kind and name) and Triton launches (by kernel name)."""

    def __init__(self, where: bool):
        self.where = where
        self.ops: collections.Counter = collections.Counter()  # (kind, name) -> count
        self.triton: collections.Counter = collections.Counter()
        self.sources: collections.Counter = collections.Counter()  # (name, source) -> count
        self.in_kernel = False
        self.active = False

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        census = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if census.active and not census.in_kernel:
                    kind = kind_of(func)
                    census.ops[(kind, op_name(func))] += 1
                    if census.where and kind != "no-kernel":
                        census.sources[(op_name(func), source_line())] += 1
                return func(*args, **(kwargs or {}))

        return _Mode()

    def patch_triton(self) -> None:
        """Wrap the Triton launch entry points (compiled and interpreted) to count launches and to
        leave out the torch ops the interpreter runs to emulate a kernel."""
        from triton.runtime import interpreter, jit

        census = self
        for cls in (jit.JITFunction, interpreter.InterpretedFunction):
            original = cls.run

            def run(self, *args, _original=original, **kwargs):
                if census.active and not census.in_kernel:
                    census.triton[getattr(self, "__name__", None) or self.fn.__name__] += 1
                previous, census.in_kernel = census.in_kernel, True
                try:
                    return _original(self, *args, **kwargs)
                finally:
                    census.in_kernel = previous

            cls.run = run

    def reset(self) -> None:
        self.ops.clear()
        self.triton.clear()
        self.sources.clear()

    def total(self, kind: str) -> int:
        return sum(c for (k, _), c in self.ops.items() if k == kind)


def make_layer(recipe_name: str, k: int, n: int, device):
    """One QuantLinear in a 3-block model, its recipe and generators set by the precision policy."""
    import torch
    from torch import nn

    from inkling_fp4.precision.config import PrecisionConfig
    from inkling_fp4.precision.policy import PrecisionPolicy
    from inkling_fp4.precision.quant_linear import QuantLinear

    torch.manual_seed(0)
    model = nn.Module()
    model.proj = QuantLinear(k, n, layer_idx=1, name="census")
    model.to(device)
    cfg = PrecisionConfig(recipe=recipe_name, bf16_first_layers=0, bf16_last_layers=0)
    PrecisionPolicy(cfg, n_layers=3, seed=0).apply(model)
    return model.proj


def count(recipe_name: str, args, census: Census, device) -> None:
    import torch

    from inkling_fp4.precision import finite_guard

    layer = make_layer(recipe_name, args.k, args.n, device)
    dtype = getattr(torch, args.x_dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x0 = torch.randn(args.m, args.k, generator=gen).to(device, dtype)
    dy = torch.randn(args.m, args.n, generator=gen).to(device, torch.bfloat16)
    for counted in (False, True):  # the first step fills caches and is not counted
        x = x0.clone().requires_grad_(True)
        layer.weight.grad = None
        with census.mode():
            census.active = counted
            y = layer(x)
            y.backward(dy)
            census.active = False
        finite_guard.raise_if_non_finite()


def report(recipe_name: str, census: Census) -> None:
    print(
        f"{recipe_name:6s} eager kernel ops {census.total('kernel'):4d} | views/allocs "
        f"{census.total('no-kernel'):4d} | host syncs {census.total('sync'):3d} | "
        f"Triton launches {sum(census.triton.values()):3d}"
    )
    for kind in ("kernel", "sync", "no-kernel"):
        items = sorted(((n, c) for (k, n), c in census.ops.items() if k == kind), key=lambda t: (-t[1], t[0]))
        if items:
            print(f"    {kind:9s} " + ", ".join(f"{n} {c}" for n, c in items))
    if census.triton:
        print("    triton    " + ", ".join(f"{n} {c}" for n, c in sorted(census.triton.items())))
    for (name, where), c in sorted(census.sources.items(), key=lambda t: t[0][1]):
        print(f"      {c:3d} x {name:24s} {where}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch  # does not import triton: TRITON_INTERPRET can still be set below

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and not args.no_interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        print(f"unknown recipe(s) {unknown}; choose from {', '.join(RECIPES)}", file=sys.stderr)
        return 2
    print(
        f"one QuantLinear forward + backward, M={args.m} K={args.k} N={args.n}, x {args.x_dtype}, "
        f"device {device} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})"
    )
    census = Census(args.where)
    census.patch_triton()
    for name in recipes:
        census.reset()
        count(name, args, census, device)
        report(name, census)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""All-reduce bandwidth between the GPUs of one host, at the size of a model's gradients.

Why: DDP averages every gradient each step. When two-GPU training scales badly, this says whether the
interconnect is the reason: the time to all-reduce FP32 and BF16 buffers as large as the gradients of
``--params`` parameters (default 344M, hybrid-350m), against the step time.

Usage: torchrun --nproc_per_node 2 scripts/bench_allreduce.py [--params 344e6] [--repeats 5]
Prints, on rank 0, one line per dtype: bytes, milliseconds per all-reduce, algorithm bandwidth
(bytes / time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=344e6, help="elements per buffer")
    ap.add_argument("--repeats", type=int, default=5, help="timed all-reduces per dtype")
    args = ap.parse_args()
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        print("run under torchrun on CUDA GPUs: torchrun --nproc_per_node 2 scripts/bench_allreduce.py",
              file=sys.stderr)  # fmt: skip
        return 2
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    for dtype in (torch.float32, torch.bfloat16):
        buf = torch.ones(int(args.params), dtype=dtype, device="cuda")
        for _ in range(2):  # NCCL sets up its channels on the first calls
            dist.all_reduce(buf)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.repeats):
            dist.all_reduce(buf)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.repeats
        size = buf.numel() * buf.element_size()
        if dist.get_rank() == 0:
            print(f"all_reduce {str(dtype).split('.')[-1]:>8} {size / 1e9:.2f} GB x {dist.get_world_size()} "
                  f"GPUs: {seconds * 1e3:.1f} ms, {size / seconds / 1e9:.0f} GB/s")  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

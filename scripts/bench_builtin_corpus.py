"""Time the default data path from nothing: list the built-in corpus, train its BPE, write its shards.

Run: ``python scripts/bench_builtin_corpus.py [--vocab 4096] [--limit-s 60]``. Uses a fresh temporary
cache (the user's cache is never touched), so it measures a cold first run; then loads again to time
the cached path. Prints one line per stage and the token counts; exits 1 when the cold build takes
longer than ``--limit-s``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from inkling_fp4.data.bpe_training import train_bpe_for
from inkling_fp4.data.config import DataConfig
from inkling_fp4.data.pipeline import build_pretrain_data
from inkling_fp4.data.shards import build_or_load_shards
from inkling_fp4.data.sources import open_source


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--limit-s", type=float, default=60.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = DataConfig(cache_dir=str(Path(tmp) / "cache"), vocab_size=args.vocab)
        t0 = time.perf_counter()
        source = open_source("builtin", cfg)
        t1 = time.perf_counter()
        tokenizer = train_bpe_for(cfg, [source])
        t2 = time.perf_counter()
        shards = build_or_load_shards(
            source, tokenizer, Path(cfg.cache_dir), cfg.val_fraction, cfg.shard_tokens
        )
        t3 = time.perf_counter()
        data = build_pretrain_data(cfg, Path(tmp) / "run", seed=0)
        t4 = time.perf_counter()
        cold = t3 - t0
        print(f"cpu cores            {os.cpu_count()}")
        print(f"list corpus          {t1 - t0:7.2f} s  {source.describe()}")
        print(f"train BPE {args.vocab:<6d}     {t2 - t1:7.2f} s")
        print(
            f"tokenize + shards    {t3 - t2:7.2f} s  train {shards.tokens('train'):,} tokens, "
            f"val {shards.tokens('val'):,} tokens ({shards.documents('val')} documents)"
        )
        print(f"cold total           {cold:7.2f} s  (limit {args.limit_s:.0f} s)")
        print(f"cached reload        {t4 - t3:7.2f} s")
        print(data.describe())
    return 0 if cold <= args.limit_s else 1


if __name__ == "__main__":
    sys.exit(main())

"""Pretraining loader: windows, doc ids, determinism, exact resume, rank sharding, data phases."""

import json

import numpy as np
import pytest
import torch

from data_corpus import data_config, fresh_rng, random_texts, write_jsonl
from inkling_fp4.config import RunConfig, from_dict, to_dict
from inkling_fp4.data.config import DataPhase
from inkling_fp4.data.loader import PretrainLoader, ResolvedPhase, WindowSampler, fixed_windows
from inkling_fp4.data.pipeline import build_pretrain_data, resolve_phases
from inkling_fp4.data.shards import TokenStream
from inkling_fp4.errors import ConfigError, DataError

EOS = 0


def _stream(tmp_path, name, n, low, high, rng):
    """A token stream with values in [low, high) and a document token every ~40 tokens."""
    tokens = rng.integers(low, high, size=n).astype(np.uint16)
    tokens[rng.random(n) < 0.025] = EOS
    tokens[0] = EOS
    path = tmp_path / f"{name}.bin"
    tokens.tofile(path)
    return TokenStream([path], np.dtype(np.uint16)), tokens.astype(np.int64)


def _loader(streams, seq_len, seed, phases=None, rank=0, world=1):
    samplers = [WindowSampler(s, seq_len, seed, i, f"s{i}") for i, s in enumerate(streams)]
    phases = phases or [ResolvedPhase(0, [0], np.ones(1))]
    return PretrainLoader(samplers, phases, seq_len, seed, EOS, rank, world)


def _same(a, b):
    fields = ("input_ids", "targets", "doc_ids", "loss_mask")
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields)


@pytest.fixture
def rng():
    return np.random.default_rng(int.from_bytes(np.random.bytes(4), "little"))


def test_first_epoch_is_a_permutation_of_all_windows(tmp_path, rng):
    stream, tokens = _stream(tmp_path, "a", 1000, 1, 50, rng)
    L = 16
    loader = _loader([stream], L, seed=int(rng.integers(1 << 30)))
    n_windows = (len(tokens) - 1) // L
    batch = loader.next_batch(n_windows)
    assert batch.input_ids.dtype == torch.int64 and batch.doc_ids.dtype == torch.int32
    assert batch.loss_mask.dtype == torch.bool and batch.loss_mask.all()
    assert torch.equal(batch.input_ids[:, 1:], batch.targets[:, :-1])
    starts = []
    for row in batch.input_ids.numpy():
        # the window that starts at a multiple of L and matches this row
        hits = [k for k in range(n_windows) if np.array_equal(tokens[k * L : k * L + L], row)]
        starts.append(hits[0])
    assert sorted(starts) == list(range(n_windows))
    assert starts != sorted(starts)  # shuffled
    assert loader.tokens_seen == n_windows * L


def test_doc_ids_increment_at_each_document_token(tmp_path, rng):
    stream, _ = _stream(tmp_path, "a", 3000, 1, 50, rng)
    batch = _loader([stream], 64, seed=3).next_batch(20)
    x = batch.input_ids.numpy()
    expected = np.cumsum(x == EOS, axis=1)  # brute force: eos seen so far, inclusive
    assert np.array_equal(batch.doc_ids.numpy(), expected)


def test_later_epochs_shift_and_cover_their_windows(tmp_path, rng):
    stream, tokens = _stream(tmp_path, "a", int(rng.integers(300, 600)), 1, 50, rng)
    L = 16
    sampler = WindowSampler(stream, L, int(rng.integers(1 << 30)), 0, "a")
    k = 0
    for epoch in range(4):
        offset, n_windows, _ = sampler._geometry(epoch)
        assert 0 <= offset < L and (epoch > 0 or offset == 0)
        starts = []
        for _ in range(n_windows):
            w = sampler.window(k)
            k += 1
            hits = [
                j
                for j in range(n_windows)
                if np.array_equal(tokens[offset + j * L : offset + j * L + L + 1], w)
            ]
            starts.append(hits[0])
        assert sorted(starts) == list(range(n_windows)), f"epoch {epoch}"


def test_same_seed_same_batches_other_seed_other_batches(tmp_path, rng):
    stream, _ = _stream(tmp_path, "a", 5000, 1, 50, rng)
    seed = int(rng.integers(1 << 30))
    a, b, c = (_loader([stream], 32, s) for s in (seed, seed, seed + 1))
    for _ in range(5):
        x, y, z = a.next_batch(4), b.next_batch(4), c.next_batch(4)
        assert _same(x, y)
    assert not _same(x, z)


def test_resume_gives_the_same_next_batches_across_epochs(tmp_path, rng):
    stream_a, _ = _stream(tmp_path, "a", 700, 1, 50, rng)  # ~43 windows: several epochs below
    stream_b, _ = _stream(tmp_path, "b", 900, 100, 150, rng)
    seed = int(rng.integers(1 << 30))
    phases = [ResolvedPhase(0, [0], np.ones(1)), ResolvedPhase(40 * 16, [0, 1], np.array([0.3, 1.0]))]
    straight = _loader([stream_a, stream_b], 16, seed, phases)
    expected = [straight.next_batch(5) for _ in range(30)]
    for cut in (1, 7, 13, 29):
        first = _loader([stream_a, stream_b], 16, seed, phases)
        for _ in range(cut):
            first.next_batch(5)
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
        resumed = _loader([stream_a, stream_b], 16, seed, phases)
        resumed.load_state_dict(state)
        for i in range(cut, 30):
            assert _same(resumed.next_batch(5), expected[i]), f"cut {cut}, batch {i}"


def test_ranks_partition_the_single_process_stream(tmp_path, rng):
    stream_a, _ = _stream(tmp_path, "a", 4000, 1, 50, rng)
    stream_b, _ = _stream(tmp_path, "b", 4000, 100, 150, rng)
    phases = [ResolvedPhase(0, [0, 1], np.array([0.5, 1.0]))]
    seed = int(rng.integers(1 << 30))
    world, B = 3, 4
    single = _loader([stream_a, stream_b], 32, seed, phases).next_batch(world * B * 2).input_ids
    per_rank = [_loader([stream_a, stream_b], 32, seed, phases, rank=r, world=world) for r in range(world)]
    got = torch.zeros_like(single)
    for step in range(2):
        for r, loader in enumerate(per_rank):
            rows = loader.next_batch(B).input_ids
            for j in range(B):
                got[(step * B + j) * world + r] = rows[j]
    assert torch.equal(got, single)
    assert all(loader.tokens_seen == world * B * 2 * 32 for loader in per_rank)


def test_phase_switches_at_the_right_token(tmp_path, rng):
    stream_a, _ = _stream(tmp_path, "a", 3000, 1, 50, rng)  # source 0: tokens < 50
    stream_b, _ = _stream(tmp_path, "b", 3000, 100, 150, rng)  # source 1: tokens >= 100
    L = 16
    total = int(rng.integers(50, 90)) * L + int(rng.integers(0, L))
    at = float(rng.uniform(0.2, 0.8))
    cfg = data_config(tmp_path, "a", phases=[DataPhase(at=at, sources=["b"])])
    phases = resolve_phases(cfg, ["a", "b"], total)
    switch = int(np.ceil(at * total))
    assert [p.start for p in phases] == [0, switch]
    loader = _loader([stream_a, stream_b], L, 0, phases)
    for g in range(total // L + 2):
        row = loader.next_batch(1).input_ids[0]
        from_b = bool((row >= 100).any())
        assert from_b == (g * L >= switch), f"sample {g} starts at token {g * L}, switch at {switch}"


def test_blend_weights_are_followed(tmp_path, rng):
    stream_a, _ = _stream(tmp_path, "a", 3000, 1, 50, rng)
    stream_b, _ = _stream(tmp_path, "b", 3000, 100, 150, rng)
    w = float(rng.uniform(0.1, 0.9))
    loader = _loader(
        [stream_a, stream_b], 8, int(rng.integers(1 << 30)), [ResolvedPhase(0, [0, 1], np.array([w, 1]))]
    )
    n = 4000
    _, sources = loader.next_windows(n)
    share = sources.count(0) / n
    assert abs(share - w) < 5 * np.sqrt(w * (1 - w) / n)
    assert loader.drawn == [sources.count(0), sources.count(1)]


def test_errors(tmp_path, rng):
    tiny, _ = _stream(tmp_path, "t", 10, 1, 50, rng)
    with pytest.raises(DataError, match="fewer than one sequence"):
        WindowSampler(tiny, 16, 0, 0, "tiny")
    stream, _ = _stream(tmp_path, "a", 500, 1, 50, rng)
    loader = _loader([stream], 16, 0)
    state = loader.state_dict()
    with pytest.raises(DataError, match="seq_len=16.*seq_len=8"):
        _loader([stream], 8, 0).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        _loader([stream], 16, 1).load_state_dict(state)
    with pytest.raises(DataError, match="fewer than one sequence"):
        fixed_windows(tiny, 16, 2)


def test_fixed_windows_spread_and_repeat(tmp_path, rng):
    stream, tokens = _stream(tmp_path, "a", 161, 1, 50, rng)  # exactly 10 windows of 16
    w = fixed_windows(stream, 16, 5)
    assert np.array_equal(w, np.stack([tokens[k * 16 : k * 16 + 17] for k in (1, 3, 5, 7, 9)]))
    assert fixed_windows(stream, 16, 20).shape == (20, 17)


def test_pipeline_end_to_end_and_resume(tmp_path):
    rng = fresh_rng()
    src = write_jsonl(tmp_path / "d.jsonl", random_texts(rng, 150))
    cfg = data_config(tmp_path, str(src), val_fraction=0.1)
    data = build_pretrain_data(cfg, tmp_path / "run", seed=5)
    assert not (tmp_path / "run").exists()  # reads only: the stage writes the run after its checks
    assert data.tokenizer.vocab_size == 512
    lines = data.describe()
    assert "vocab 512" in lines and "tokens" in lines
    batches = [data.train.next_batch(4) for _ in range(6)]
    assert batches[0].input_ids.shape == (4, 16)
    v1, v2 = data.val_batches(3, 2), data.val_batches(3, 2)
    assert len(v1) == 3 and all(_same(a, b) for a, b in zip(v1, v2, strict=True))
    # A fresh process resuming from a checkpointed position, same run directory.
    again = build_pretrain_data(cfg, tmp_path / "run", seed=5)
    fresh = build_pretrain_data(cfg, tmp_path / "run", seed=5)
    for _ in range(3):
        fresh.train.next_batch(4)
    again.train.load_state_dict(fresh.train.state_dict())
    for i in range(3, 6):
        assert _same(again.train.next_batch(4), batches[i])


def test_phases_from_a_recipe_and_their_errors():
    cfg = from_dict(
        RunConfig,
        {
            "data": {
                "phases": [
                    {"at": 0.7, "sources": ["a.jsonl", "b.jsonl"], "weights": [1, 3]},
                    {"at": 0.9, "sources": ["b.jsonl"]},
                ]
            }
        },
    )
    first = cfg.data.phases[0]
    assert isinstance(first, DataPhase) and first.normalized_weights() == [0.25, 0.75]
    assert cfg.data.all_sources() == ["builtin", "a.jsonl", "b.jsonl"]
    assert to_dict(cfg)["data"]["phases"][1] == {"at": 0.9, "sources": ["b.jsonl"], "weights": None}
    with pytest.raises(ConfigError, match="increasing order"):
        from_dict(
            RunConfig, {"data": {"phases": [{"at": 0.9, "sources": ["a"]}, {"at": 0.7, "sources": ["b"]}]}}
        )
    with pytest.raises(ConfigError, match="2 sources but 1 weights"):
        from_dict(RunConfig, {"data": {"phases": [{"at": 0.5, "sources": ["a", "b"], "weights": [1]}]}})
    with pytest.raises(ConfigError, match=r"data.phases\[0\].*at=1.5"):
        from_dict(RunConfig, {"data": {"phases": [{"at": 1.5, "sources": ["a"]}]}})
    with pytest.raises(DataError, match="pass total_tokens"):
        resolve_phases(cfg.data, cfg.data.all_sources(), None)


def test_pipeline_with_phases(tmp_path):
    rng = fresh_rng()
    a = write_jsonl(tmp_path / "a.jsonl", ["alpha " + t for t in random_texts(rng, 60)])
    b = write_jsonl(tmp_path / "b.jsonl", ["beta " + t for t in random_texts(rng, 60)])
    phases = [
        DataPhase(at=0.5, sources=[str(a), str(b)], weights=[1, 1]),
        DataPhase(at=0.75, sources=[str(b)]),
    ]
    cfg = data_config(tmp_path, str(a), phases=phases)
    total = 64 * cfg.seq_len
    data = build_pretrain_data(cfg, tmp_path / "run", seed=1, total_tokens=total)
    assert [p.start for p in data.train.phases] == [0, total // 2, total * 3 // 4]
    assert len(data.sources) == 2 and "phase from token" in data.describe()
    sources = []
    for _ in range(64):
        _, s = data.train.next_windows(1)
        sources += s
    assert set(sources[:32]) == {0} and set(sources[32:48]) == {0, 1} and set(sources[48:]) == {1}

"""precision/graph_capture.py on CPU, with the capture and the amax pool stood in for: what the
training step's and the decode step's graphs rely on."""

from __future__ import annotations

import contextlib

import pytest
import torch

from inkling_fp4.errors import NumericsError
from inkling_fp4.precision import finite_guard
from inkling_fp4.precision.graph_capture import quantized_graph

pytest.importorskip("triton")


def test_quantized_graph_zeroes_amax_words_inside_and_keeps_records_out_of_the_check(monkeypatch):
    from inkling_fp4.numerics.kernels import amax

    events = []

    @contextlib.contextmanager
    def graph(g):
        events.append("capture")
        yield
        events.append("end")

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(amax, "start_new_pool", lambda device: events.append("new pool"))
    monkeypatch.setattr(finite_guard, "MAX_PENDING", 1)  # a record outside a capture checks at once
    finite_guard.discard()
    with quantized_graph(None, torch.device("cpu")) as records:
        events.append("body")
        finite_guard.record(torch.tensor([float("inf")]), "layers.0.x")  # no check inside the capture
    # the pool's fill inside the capture (replayed), a new pool after it for eager code
    assert events == ["capture", "new pool", "body", "end", "new pool"]
    assert [label for _, label in records] == ["layers.0.x"]
    finite_guard.raise_if_non_finite()  # nothing pending: the record went to the capture
    with pytest.raises(NumericsError, match="layers.0.x"):
        finite_guard.record_replay(records)  # after a replay it is checked (MAX_PENDING 1: at once)

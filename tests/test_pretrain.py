"""End-to-end pretraining on CPU with a very small model: the run directory, the precision switch,
the noise monitor under injected faults, exact resume, corrupt checkpoints, interrupts.

Every run here trains a 4-layer hybrid of width 32 on the built-in corpus (30 files, BPE of 512
tokens) for at most 20 steps with NVFP4 GEMMs (stochastic rounding on), so a test takes seconds.
"""

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from inkling_fp4.config import load_config
from inkling_fp4.errors import ConfigError
from inkling_fp4.train import pretrain
from inkling_fp4.trainer import trainer
from model_helpers import SMALL_RUN

pytestmark = pytest.mark.slow

SMALL = [
    *SMALL_RUN,
    "train.steps=20",
    "train.warmup_steps=3",
    "eval.every=10",
    "monitor.warmup=5",
]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture
def train(tmp_path, data_cache):
    """train(name, *overrides) -> (run_dir, step rows, event rows, eval rows)."""

    def _run(name, *overrides, resume=False, baseline=None):
        cfg = load_config("tiny", [*SMALL, f"data.cache_dir={data_cache}", *overrides])
        run_dir = pretrain.run(cfg, tmp_path / name, resume=resume, baseline=baseline).run_dir
        return (run_dir, *read_metrics(run_dir))

    return _run


def read_metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    events = [r for r in rows if "event" in r]
    evals = [r for r in rows if "val_loss_bf16" in r]
    return steps, events, evals


def losses(step_rows):
    return {r["step"]: r["loss"] for r in step_rows}


def model_tensors(run_dir, step):
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")


def test_run_directory_and_learning(train):
    run_dir, steps, events, evals = train("basic", "precision.switch_to_bf16=never")
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tokenizer.json").is_file()
    assert load_config(run_dir / "config.yaml").train.steps == 20  # the resolved config reruns
    assert [r["step"] for r in steps] == list(range(1, 21))
    for r in steps:
        assert {"step", "tokens", "loss", "lr", "grad_norm", "precision", "tokens_per_s", "phase"} <= set(r)
        assert r["precision"] == "nvfp4" and r["tokens"] == r["step"] * 4 * 32
    assert steps[0]["loss"] > steps[-1]["loss"] + 0.3  # it learns
    assert steps[0]["loss"] == pytest.approx(math.log(512), abs=0.5)  # starts near uniform
    assert [e["step"] for e in evals] == [10, 20]
    assert all(e["val_precision"] == "nvfp4" and math.isfinite(e["val_loss"]) for e in evals)
    assert all(abs(e["val_loss"] - e["val_loss_bf16"]) < 0.2 for e in evals)
    assert [r["phase"] for r in steps][:4] == ["warmup"] * 3 + ["stable"] and steps[-1]["phase"] == "decay"
    assert steps[-1]["lr"] == pytest.approx(3e-3 * 0.01)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_20"]


@pytest.mark.parametrize("scope", ["all", "forward"])
def test_precision_switch_on_its_step(train, scope):
    _, steps, events, evals = train(
        f"switch_{scope}", "precision.switch_to_bf16=decay", f"precision.switch_scope={scope}"
    )
    after = "bf16" if scope == "all" else "bf16-fwd/nvfp4-bwd"
    # decay_fraction 0.2 of 20 steps: the decay, and the switch, start at step 17
    assert [r["precision"] for r in steps] == ["nvfp4"] * 16 + [after] * 4
    switch = [e for e in events if e["event"] == "precision_switch"]
    assert len(switch) == 1 and switch[0]["step"] == 17
    assert steps[16]["phase"] == "decay" and steps[15]["phase"] == "stable"
    assert evals[-1]["val_precision"] == ("bf16" if scope == "all" else after)


def test_forward_only_switch_keeps_backward_quantized():
    """What the loop's forward-scope switch does to a model: BF16 forward, quantized backward."""
    from inkling_fp4.model.hybrid import HybridLM
    from inkling_fp4.precision.policy import PrecisionPolicy
    from inkling_fp4.precision.quant_linear import QuantLinear

    cfg = load_config("tiny", ["precision.stochastic_rounding=false"])
    torch.manual_seed(0)
    model = HybridLM(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (2, 32))

    def fwd_bwd(how):
        policy = PrecisionPolicy(cfg.precision, cfg.model.n_layers)
        policy.apply(model)
        if how != "nvfp4":
            policy.switch_to_bf16(model, how)
        model.zero_grad()
        logits = model(x)
        logits.float().logsumexp(-1).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return logits.detach(), grads, [m.recipe for m in model.modules() if isinstance(m, QuantLinear)]

    y_q, g_q, _ = fwd_bwd("nvfp4")
    y_all, g_all, recipes_all = fwd_bwd("all")
    y_fwd, g_fwd, recipes_fwd = fwd_bwd("forward")
    assert all(r is None for r in recipes_all)
    quantized = [r for r in recipes_fwd if r is not None]
    assert quantized
    assert all(r.fprop is None and r.dgrad is not None and r.wgrad is not None for r in quantized)
    # the forward pass is BF16 (up to BF16 rounding of the layer outputs), far from the NVFP4 one ...
    assert (y_fwd - y_all).abs().max() < (y_q - y_all).abs().max() / 50
    # ... while a quantized layer's gradient is not BF16's
    name = next(n for n in g_fwd if n.startswith("layers.2.") and n.endswith("weight") and g_fwd[n].ndim == 2)
    assert not torch.equal(g_fwd[name], g_all[name])


def test_monitor_catches_injected_nan_and_spike(train, monkeypatch):
    from inkling_fp4.model.hybrid import HybridLM

    real = HybridLM.loss  # the training loss (evaluation goes through the logits instead)
    calls = {"train": 0}

    def faulty(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["train"] += 1
        if calls["train"] == 8:
            return out * float("nan")
        if calls["train"] == 14:
            return out * 50.0
        return out

    monkeypatch.setattr(HybridLM, "loss", faulty)
    _, steps, events, _ = train("monitor", "precision.switch_to_bf16=never", "monitor.max_triggers=2")
    kinds = {e["event"]: e["step"] for e in events}
    assert kinds["nonfinite"] == 8 and kinds["loss_spike"] == 14
    assert kinds["monitor_fallback"] == 14  # 2 triggers within the window: BF16 from now on
    by_step = {r["step"]: r for r in steps}
    # metrics.jsonl stays valid JSON: the NaN loss is null, named in "nonfinite"
    assert by_step[8]["skipped"] and by_step[8]["loss"] is None and "loss" in by_step[8]["nonfinite"]
    assert by_step[14]["skipped"] and by_step[14]["loss"] > 50
    assert not by_step[9]["skipped"] and all(math.isfinite(by_step[k]["loss"]) for k in range(9, 21))
    assert by_step[20]["loss"] < by_step[1]["loss"]  # the NaN never reached the weights
    assert by_step[13]["precision"] == "nvfp4" and by_step[15]["precision"] == "bf16-fallback"


def test_resume_is_bit_exact(train):
    common = ("precision.switch_to_bf16=decay", "train.checkpoint_every=5")
    straight, steps_a, _, evals_a = train("straight", *common)
    parted, _, events, _ = train("parted", *common, "train.stop_after=10")
    assert any(e["event"] == "stop" and e["step"] == 10 for e in events)
    assert sorted(p.name for p in (parted / "checkpoints").iterdir()) == ["step_10", "step_5"]
    _, steps_b, events, evals_b = train("parted", *common, "train.stop_after=10", resume=True)
    assert any(e["event"] == "resume" and e["step"] == 10 for e in events)
    assert losses(steps_a) == losses(steps_b)  # loss for loss, bit for bit (floats compared exactly)
    assert [r["grad_norm"] for r in steps_a] == [r["grad_norm"] for r in steps_b]
    assert evals_a == evals_b
    a, b = model_tensors(straight, 20), model_tensors(parted, 20)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_delayed_fp8_scaling_resumes_bit_exact(train, capsys):
    """fp8-tensorwise with delayed scaling: the amax history is checkpointed, so 10 steps + resume +
    10 steps equal 20 straight, and the run logs which scaling it used."""
    common = (
        "precision.recipe=fp8-tensorwise", "precision.fp8_scaling=delayed", "precision.amax_history=4",
        "precision.switch_to_bf16=never", "train.checkpoint_every=5", "eval.every=0",
    )  # fmt: skip
    straight, steps_a, _, _ = train("straight", *common)
    assert "fp8-tensorwise (delayed scaling, 4-step amax history)" in capsys.readouterr().out
    train("parted", *common, "train.stop_after=10")
    parted, steps_b, _, _ = train("parted", *common, "train.stop_after=10", resume=True)
    assert losses(steps_a) == losses(steps_b) and steps_a[-1]["loss"] < steps_a[0]["loss"]
    state = json.loads((parted / "checkpoints" / "step_20" / "state.json").read_text())
    assert state["precision"][0]["amax_history"]["ready"]
    a, b = model_tensors(straight, 20), model_tensors(parted, 20)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_delayed_fp8_nonfinite_amax_skips_the_step(train, monkeypatch):
    """On CUDA a NaN in a delayed-scaled x or dy saturates its bytes (the scale is finite) and shows
    only as an Inf recorded amax: the step must be skipped and the Inf kept out of the history."""
    from inkling_fp4.precision.quant_linear import QuantLinear

    real = QuantLinear.delayed_words
    calls = {"n": 0}

    def poisoned(self):
        words = real(self)
        calls["n"] += 1
        if words is not None and calls["n"] == 20:  # a layer's x amax in step 7 or so
            words[1].fill_(float("inf"))
        return words

    monkeypatch.setattr(QuantLinear, "delayed_words", poisoned)
    common = (
        "precision.recipe=fp8-tensorwise", "precision.fp8_scaling=delayed", "precision.switch_to_bf16=never",
        "eval.every=0", "train.checkpoint_every=20",
    )  # fmt: skip
    run_dir, steps, events, _ = train("poisoned", *common)
    skipped = [r["step"] for r in steps if r.get("skipped")]
    assert len(skipped) == 1 and any(e["event"] == "nonfinite" for e in events)
    message = next(e["message"] for e in events if e["event"] == "nonfinite")
    assert "layers." in message and " x (delayed FP8 scaling, amax history) contains non-finite" in message
    state = json.loads((run_dir / "checkpoints" / "step_20" / "state.json").read_text())
    from inkling_fp4.precision.amax_history import AmaxHistory

    history = AmaxHistory(*state["precision"][0]["amax_history"]["shape"][:1], 16, torch.device("cpu"))
    history.load_state_dict(state["precision"][0]["amax_history"])
    assert torch.isfinite(history.state).all() and steps[-1]["loss"] < steps[0]["loss"]


def test_corrupt_checkpoint_falls_back_to_previous(train, capsys):
    common = ("train.checkpoint_every=4",)
    _, steps_a, _, _ = train("straight", *common, "train.steps=14")
    parted, _, _, _ = train("parted", *common, "train.steps=14", "train.stop_after=12")
    f = parted / "checkpoints" / "step_12" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])  # truncated
    _, steps_b, events, _ = train("parted", *common, "train.steps=14", resume=True)
    resume = [e["message"] for e in events if e["event"] == "resume"]
    assert any("step_12" in m and "sha256" in m for m in resume)  # reported
    assert any("resumed from" in m and "step_8" in m for m in resume)  # the previous good one used
    assert [r["step"] for r in steps_b] == list(range(1, 15))  # rows after step 8 were rewritten
    assert losses(steps_a) == losses(steps_b)


def test_sigint_checkpoints_and_resumes(train, monkeypatch):
    from inkling_fp4.model.hybrid import HybridLM

    real = HybridLM.loss  # called once per training micro batch
    calls = {"n": 0}

    def interrupting(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C during step 6
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HybridLM, "loss", interrupting)
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN under a background shell
    run_dir, steps, events, _ = train("interrupted", "train.steps=10")
    assert steps[-1]["step"] == 6 and any(e["event"] == "interrupt" for e in events)
    assert (run_dir / "checkpoints" / "step_6" / "state.json").is_file()
    assert signal.getsignal(signal.SIGINT) == before  # the handler it replaced is back
    monkeypatch.setattr(HybridLM, "loss", real)
    _, steps, _, _ = train("interrupted", "train.steps=10", resume=True)
    assert [r["step"] for r in steps] == list(range(1, 11))


def test_baseline_gap_is_logged(train):
    base, _, _, _ = train("fp8", "precision.recipe=fp8", "train.steps=8")
    _, steps, _, _ = train("nvfp4", "train.steps=8", baseline=base)
    assert all("gap" in r and "baseline_loss" in r for r in steps)
    assert any(r["gap"] is not None and abs(r["gap"]) < 0.2 for r in steps)


def test_resume_without_checkpoint_starts_afresh(train):
    """No dead ends: --resume in a directory with nothing to resume starts the run and says so."""
    run_dir, steps, events, _ = train("empty", "train.steps=2", "eval.every=0", resume=True)
    assert [r["step"] for r in steps] == [1, 2]
    assert any("starting a new run" in e["message"] for e in events if e["event"] == "resume")


def test_cli_pretrain_prints_the_run_directory(tmp_path, data_cache, monkeypatch, capsys):
    from inkling_fp4.cli import main

    run_dir = tmp_path / "cli"
    args = ["fp4train", "pretrain", "--run-dir", str(run_dir), *SMALL, f"data.cache_dir={data_cache}"]
    monkeypatch.setattr(sys, "argv", [*args, "train.steps=3"])
    try:
        main()
    except SystemExit as e:  # click ends a successful command with exit code 0
        assert e.code in (0, None)
    out = capsys.readouterr().out
    assert f"run directory: {run_dir}" in out and "step 3/3" in out and "precision: nvfp4" in out


def test_cuda_graph_off_on_cpu_says_why(train):
    _, steps, events, _ = train("graph_cpu", "train.cuda_graph=true", "train.steps=4", "eval.every=0")
    graph = [e for e in events if e["event"] == "cuda_graph"]
    assert (
        len(graph) == 1
        and graph[0]["step"] == 0
        and "off: CUDA graphs need a CUDA device" in graph[0]["message"]
    )
    assert len(steps) == 4 and all(math.isfinite(r["loss"]) for r in steps)


def test_cuda_graph_auto_is_the_default_and_quiet_without_a_gpu(train):
    assert load_config("tiny").train.cuda_graph == "auto"
    _, steps, events, _ = train("graph_auto", "train.steps=2", "eval.every=0")
    assert len(steps) == 2 and not [e for e in events if e["event"] == "cuda_graph"]
    with pytest.raises(ConfigError, match="train.cuda_graph must be auto, true or false, not 'sometimes'"):
        load_config("tiny", ["train.cuda_graph=sometimes"])


def test_graphed_micro_step_nan_report_skips_the_step(train, monkeypatch):
    """A graphed micro-step's deferred NaN/Inf check (finite_guard, every 512 records) raises from the
    replay call: the step is skipped as the eager path skips it, and the run goes on. On CPU, with an
    eager stand-in for the graph behind the trainer's interface."""
    from inkling_fp4.errors import NumericsError

    class EagerStandIn:
        calls = 0

        def __init__(self, model, loss_fn, accumulate=True):
            self.params, self.loss_fn = list(model.parameters()), loss_fn

        def __call__(self, ids, doc_ids, targets, loss_mask, grad_scale):
            type(self).calls += 1
            if type(self).calls == 8:
                raise NumericsError("mamba.in_proj x contains non-finite values (NaN/Inf): injected")
            loss = self.loss_fn(ids, doc_ids, targets, loss_mask)
            (loss * grad_scale).backward()
            return loss.detach()

        def zero_grad(self):
            for p in self.params:
                p.grad = None

        def reset(self):
            pass

    monkeypatch.setattr(trainer, "GraphedMicroStep", EagerStandIn)
    monkeypatch.setattr(trainer, "graph_blocker", lambda model, world_size, device: None)
    _, steps, events, _ = train(
        "graph_nan",
        "train.cuda_graph=true",
        "precision.switch_to_bf16=never",
        "train.steps=12",
        "eval.every=0",
    )
    kinds = {e["event"]: e for e in events}
    assert "on:" in kinds["cuda_graph"]["message"]
    assert kinds["nonfinite"]["step"] == 8 and "injected" in kinds["nonfinite"]["message"]
    by_step = {r["step"]: r for r in steps}
    assert by_step[8]["skipped"] and sorted(by_step) == list(range(1, 13))
    assert not any(by_step[k]["skipped"] for k in range(9, 13))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_cuda_graph_trains_as_eager(train):
    """nvfp4 with stochastic rounding, then the switch to BF16 (a new capture): the graphed run's
    losses are the eager run's. Not bit for bit: on packed rows of one document the eager forward
    takes the unmasked attention path, the graph always the masked one (bit-exact replays of the
    same kernels: test_graphed_step.py)."""
    common = ("train.device=cuda", "precision.switch_to_bf16=decay", "eval.every=0")
    _, eager, _, _ = train("eager", *common)
    _, graphed, events, _ = train("graphed", *common, "train.cuda_graph=true")
    graph = [(e["step"], e["message"]) for e in events if e["event"] == "cuda_graph"]
    assert len(graph) == 1 and graph[0][0] == 0 and "on:" in graph[0][1]
    assert [r["precision"] for r in graphed][-1] == "bf16"
    for a, b in zip(eager, graphed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3), a["step"]
    assert graphed[-1]["loss"] < graphed[0]["loss"] - 0.3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_cuda_graph_delayed_fp8_trains_as_eager(train):
    """Delayed FP8 scaling under CUDA graphs: the first graph (captured while the history was empty,
    so scaling currently) is dropped once the history has a step; the replays then record into and
    scale from the same device words as eager steps, and the losses follow the eager run's."""
    common = (
        "train.device=cuda", "precision.recipe=fp8-tensorwise", "precision.fp8_scaling=delayed",
        "precision.switch_to_bf16=never", "eval.every=0",
    )  # fmt: skip
    _, eager, _, _ = train("eager", *common)
    _, graphed, events, _ = train("graphed", *common, "train.cuda_graph=true")
    assert [e["step"] for e in events if e["event"] == "cuda_graph"] == [0]
    for a, b in zip(eager, graphed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3), a["step"]
    assert graphed[-1]["loss"] < graphed[0]["loss"] - 0.3


def test_pretrain_runs_without_triton(tmp_path, data_cache):
    """The README's first command installs no triton (only the ``gpu`` extra does): the CPU pretrain
    path must never import it."""
    argv = ["fp4train", "pretrain", "--run-dir", str(tmp_path / "run"), *SMALL]
    argv += [f"data.cache_dir={data_cache}", "train.steps=2", "eval.every=0"]
    code = "import sys\nsys.modules['triton'] = None  # as if not installed\n"
    code += f"sys.argv = {argv!r}\nfrom inkling_fp4.cli import main\nmain()\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()

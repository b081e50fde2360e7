"""scripts/bench_user_speed.py on CPU: it runs generate and eval as a user does and reports the speed
lines they print."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_run_dir import pretrained

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_user_speed.py"


def test_parse_speed_reads_the_last_line_with_and_without_the_set_up():
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_user_speed as b

    out = ("12 new tokens in 0.50 s: 24.0 new tokens/s\n"
           "3,000 ignored\n1204 new tokens in 2.00 s: 1,003.3 new tokens/s "
           "(not counting 0.80 s of one-off graph capture and compilation)\n")  # fmt: skip
    assert b.parse_speed(out) == {"new_tokens": 1204, "seconds": 2.0, "tokens_per_s": 1003.3, "setup_s": 0.8}
    assert b.parse_speed("12 new tokens in 0.50 s: 24.0 new tokens/s")["setup_s"] == 0.0
    assert b.parse_speed("no speed here") is None


def test_bench_user_speed_on_a_tiny_run(tmp_path_factory, tmp_path):
    run = pretrained(tmp_path_factory, 2)
    out = tmp_path / "speed"
    cmd = [sys.executable, str(SCRIPT), "--from", str(run), "--out", str(out), "--prompts", "6",
           "--problems", "3", "--samples", "2", "--max-new-tokens", "4", "--device", "cpu",
           "--set", "sampler.max_context=96"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((out / "summary.json").read_text())
    assert [r["name"].split(",")[-1].strip() for r in rows] == ["bf16", "nvfp4-row", "3 problems"]
    for r in rows:  # each figure is the one its command printed
        log = Path(r["log"]).read_text()
        assert r["rc"] == 0 and f"{r['speed']['new_tokens']} new tokens in" in log
    assert len((out / "generate-bf16.jsonl").read_text().splitlines()) == 6
    assert len((out / "prompts.txt").read_text().splitlines()) == 6
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr

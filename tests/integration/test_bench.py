"""One real bench (`prime-hpc submit ... --bench`) of the reverse_text recipe on this
machine: inference and trainer, no environment."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from prime_hpc.trainer import bench
from tests.conftest import cli

RL = ["+experiment=reverse_text"]


# ----------------------------------------------------------------------------- a real bench
def test_bench_reverse_text_locally_without_an_env(tmp_path):
    """`--bench` (both parts) of the reverse_text recipe on cluster=local, with a train env
    id that does not exist: the table and bench.json agree, and their figures with each
    other; the trainer ran warm-up + measured steps of the configured shape."""
    out = tmp_path / "run"
    r = cli(
        "submit",
        *RL,
        "cluster=local",
        f"output_dir={out}",
        "--bench",
        "bench.steps=2",
        "orchestrator.env.0.id=no_such_env_pkg",
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    run = out.parent / "run-bench"
    assert not out.exists()  # the run's own directory stays free
    res = json.loads((run / "bench.json").read_text())
    assert res["mode"] == "all" and res["steps"] == 2 and res["warmup_steps"] == 1
    tr, inf = res["trainer"], res["inference"]
    # the configured shape: 64 samples of seq_len 80 whose completions are drawn from 1 .. 32
    # tokens (trainer; the seeds of the measured steps 2 and 3), 8 prompts x 8 completions of 32 tokens
    drawn = [sum(bench.completion_lengths(64, 32, 42 + step)) for step in (2, 3)]
    assert tr["samples_per_step"] == 64 and tr["tokens_per_step"] == 64 * (80 - 32) + sum(drawn) / 2
    assert tr["shape"]["completion_lengths"] == "uniform" and tr["shape"]["micro_batch_tokens"] == 32 * 80
    assert inf["samples_per_step"] == 64 and inf["tokens_per_step"] == 64 * 32
    for part in (tr, inf):
        assert len(part["step_times_s"]) == 2 and all(t > 0 for t in part["step_times_s"])
        assert part["step_time_s"] == pytest.approx(statistics.median(part["step_times_s"]), rel=1e-4)
        assert part["tokens_per_s"] == pytest.approx(part["tokens_per_step"] / part["step_time_s"])
        assert part["samples_per_s"] == pytest.approx(part["samples_per_step"] / part["step_time_s"])
        assert part["params"] > 0 and part["mfu"] is None and part["peak_flops_per_device"] is None  # CPU
    # the printed table shows the same figures
    rows = {
        m.group(1): m.groups()[1:]
        for m in re.finditer(
            r"^\s+(trainer|inference)\s+([\d.]+) s\s+([\d,]+)\s+([\d,.]+)\s+peak unknown", r.stdout, re.M
        )
    }
    assert set(rows) == {"trainer", "inference"}, r.stdout
    for name, part in (("trainer", tr), ("inference", inf)):
        step, tok_s, _ = rows[name]
        assert float(step) == pytest.approx(part["step_time_s"], abs=1e-3)
        assert float(tok_s.replace(",", "")) == pytest.approx(part["tokens_per_s"], abs=1)
    # the trainer ran 1 warm-up + 2 measured steps, each a full step of the real engine
    rows = [json.loads(line) for line in (run / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["bench/measured"] for row in rows] == [0.0, 1.0, 1.0]
    assert all(row["perf/throughput"] > 0 and row["optim/grad_norm"] > 0 for row in rows)
    # nothing of a training run: no rollouts, no weights, no checkpoints; the job completed
    assert not any((run / d).exists() and any((run / d).iterdir()) for d in ("rollouts", "weights", "checkpoints"))
    assert json.loads((run / "job.json").read_text())["state"] == "COMPLETED"

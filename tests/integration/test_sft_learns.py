"""The shipped SFT recipe teaches the offline tiny model to reverse strings: the whole
`prime-hpc submit +experiment=reverse_text_sft` run (local mode, the trainer alone), then
`prime-hpc eval` of its final weights, greedy, on held-out strings."""
from __future__ import annotations

import json
import time

import pytest

from prime_hpc.rundir import jobs
from prime_hpc.rundir import RunDir
from tests.conftest import cli

pytestmark = pytest.mark.vllm


def test_reverse_text_sft_reaches_80_of_100_exact_reversals(tmp_path):
    out = tmp_path / "sft"
    r = cli("submit", "+experiment=reverse_text_sft", f"output_dir={out}")
    assert r.returncode == 0, r.stderr
    run = RunDir(out)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and jobs.read_job(run).get("state") not in jobs.FINAL_STATES:
        time.sleep(2)
    job = jobs.read_job(run)
    assert job["state"] == "COMPLETED", job
    assert job["groups"] == ["trainer"] and not (out / "configs" / "inference.yaml").exists()
    final = run.weight_steps()[-1]
    assert final == 1000
    # greedy: pass@1 is the share of exact reversals, avg@1 the mean LCS ratio
    e = cli("eval", str(out), f"steps={final}", "orchestrator.sampling.temperature=0",
            "orchestrator.eval.rollouts_per_example=1", timeout=900)
    assert e.returncode == 0, e.stdout + e.stderr
    result = json.loads(run.eval_result(final).read_text())
    assert result["eval/reverse_text/pass@1"] >= 0.80, result
    assert result["eval/reverse_text/avg@1"] >= 0.90, result

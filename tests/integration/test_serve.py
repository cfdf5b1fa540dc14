"""`prime-hpc serve` on the dev cluster: the tiny model on two servers behind the router as
a job of its own, with the user's key. Its URL is in `serve.json` and in `status`; `eval
serve=<job>` scores through it (with an argument of the env's own; its router proven
against the job's router.json with the key the job kept for its owner, nothing exported,
and sent signed requests, never the key); a run's teacher named by
it (`orchestrator.teacher.serve`) is refused without its key and answers the teacher's
prompt logprobs with it; a server killed is restarted in its slot and rejoins the router; `cancel` ends the job, leaves no process and removes `serve.json`. Without a key
it is refused in one line, before anything is submitted."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from prime_hpc.rundir import RunDir, jobs
from tests.conftest import cli
from tests.runs import run_processes, wait_fleet

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

KEY = "serve-test-key-5d0c9a7e41b3f8266c1d"  # a key the user chose: 32 bytes at least


def _teacher_from_the_serve_job(job_id: str, tmp_path) -> None:
    import asyncio

    from prime_hpc.config.compose import compose
    from prime_hpc.config.validate import validate
    from prime_hpc.core.errors import ConfigError
    from prime_hpc.orchestrator.rollouts import Rollout
    from prime_hpc.orchestrator.teacher import Teacher, locate

    overrides = [
        "+experiment=reverse_text",
        "warmup.experiment=null",
        "orchestrator.training_mode=opd",
        f"orchestrator.teacher.serve={job_id}",
        f"output_dir={tmp_path / 'opd'}",
    ]
    os.environ.pop("TEACHER_API_KEY", None)
    with pytest.raises(ConfigError, match=r"answers only with its key: set \$TEACHER_API_KEY"):
        validate(compose(overrides))
    os.environ["TEACHER_API_KEY"] = KEY
    try:
        cfg = validate(compose(overrides))
        at = locate(cfg.orchestrator.teacher, RunDir(cfg.output_dir), 1, 10.0)
        teacher = Teacher(at, lambda: "not-asked")
        ids = list(range(40, 60))
        r = Rollout("reverse-text", 0, 0.0, ids, [False] * 10 + [True] * 10, [-1.0] * 20, [0], 1, False)

        async def ask() -> None:
            try:
                await teacher.add_logprobs([r])
            finally:
                await teacher.aclose()

        asyncio.run(ask())
    finally:
        os.environ.pop("TEACHER_API_KEY", None)
    assert (
        at.model == "tiny"
        and at.url == json.loads(RunDir(jobs.resolve(job_id).output_dir).serve_json.read_text())["url"]
    )
    assert r.teacher_logprobs[0] == 0.0 and len(r.teacher_logprobs) == 20
    assert all(lp < 0 for lp in r.teacher_logprobs[1:]), r.teacher_logprobs
    assert r.token_advantages[:10] == [0.0] * 10 and r.token_advantages[10:] == [
        lp + 1.0 for lp in r.teacher_logprobs[10:]
    ]


def test_serve_is_a_job_that_eval_names_heals_its_fleet_and_ends_at_cancel(tmp_path):
    out = tmp_path / "serve"
    refused = cli("serve", "model=tiny", "cluster=dev", f"output_dir={out}", env={"INFERENCE_SERVER_API_KEY": ""})
    assert refused.returncode == 2 and "INFERENCE_SERVER_API_KEY" in refused.stderr, refused.stderr
    assert refused.stderr.strip().count("\n") == 0 and not out.exists()

    env = {"INFERENCE_SERVER_API_KEY": KEY}
    r = cli(
        "serve", "model=tiny", "cluster=dev", "cluster.inference.nodes=2", f"output_dir={out}", env=env, timeout=900
    )
    run = RunDir(out)
    job_id = str(jobs.read_job(run).get("job_ids", ["?"])[-1])
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        served = json.loads(run.serve_json.read_text())
        assert f"serving tiny at {served['url']} (key: $INFERENCE_SERVER_API_KEY)" in r.stdout
        assert served["url"].startswith("http://127.0.0.1:") and served["servers"] == 2
        assert KEY not in run.serve_json.read_text()
        assert httpx.get(served["url"] + "/models", timeout=30).status_code == 401  # the key, or nothing
        models = httpx.get(served["url"] + "/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"

        status = cli("status", job_id, env=env)
        assert "serve" in status.stdout and served["url"] in status.stdout, status.stdout

        e = cli(
            "eval",
            f"serve={job_id}",
            "env=reverse-text",
            "args.reverse-text.max_len=4",  # the env's own argument: eval strings of at most 4 letters
            "examples=3",
            "orchestrator.sampling.max_tokens=8",
            f"out={tmp_path / 'ev'}",
            env={"INFERENCE_SERVER_API_KEY": "", "ENDPOINT_API_KEY": ""},  # its own serve job: the key it kept
            timeout=600,
        )
        assert e.returncode == 0, e.stdout + e.stderr
        result = json.loads((tmp_path / "ev" / "eval.json").read_text())
        assert result["endpoint"] == served["url"] and result["model"] == "tiny"
        samples = [json.loads(line) for line in (tmp_path / "ev" / "samples.jsonl").read_text().splitlines()]
        assert len(samples) == 3 and all(3 <= len(s["prompt"]) <= 4 for s in samples), samples

        # a run's teacher can be the serve job (orchestrator.teacher.serve): found from its
        # serve.json, asked with the key given to the run's teacher variable
        _teacher_from_the_serve_job(job_id, tmp_path)

        # a server killed is restarted in its slot and serves again behind the router
        server1 = json.loads(run.inference_endpoint(1).read_text())
        os.kill(int(server1["pid"]), signal.SIGKILL)
        wait_fleet(run, "inference_1", lambda row: row["restarts"] == 1 and row["state"] == "serving", "a rejoin", 600)
        again = json.loads(run.inference_endpoint(1).read_text())
        assert again["url"] != server1["url"]
        assert json.loads(run.fleet_membership.read_text())["servers"]["inference_1"]["url"] == again["url"]
    finally:
        c = cli("cancel", job_id, env=env)
    assert c.returncode == 0, c.stderr
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (
        jobs.read_job(run).get("state") not in jobs.FINAL_STATES or run_processes(run.latest_logs.resolve())
    ):
        time.sleep(1)
    assert jobs.read_job(run)["state"] == "CANCELLED" and jobs.read_job(run)["kind"] == "serve"
    assert not run.serve_json.exists() and not run_processes(run.latest_logs.resolve())

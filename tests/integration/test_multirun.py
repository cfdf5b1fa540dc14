"""Two runs in one job, every part real: one vLLM server holding both runs' adapters, one
multi-run trainer (`trainer.max_concurrent_runs=2`), and each run's own orchestrator with
its own learning rate, started as processes the way a job starts them; each run lives in
the job's `runs/<name>/`."""

from __future__ import annotations

import json
import os
import sys
import time

import httpx
import pytest

from prime_hpc.config.component import write_component_config
from prime_hpc.config.compose import compose
from prime_hpc.rundir import STABLE, RunDir
from tests.inference_util import start_inference
from tests.trainer_support import EXAMPLES, REPO, trainer_cmd

LORA = [
    "trainer.model.lora.enabled=true",
    "trainer.model.lora.rank=8",
    "trainer.model.lora.alpha=16",
    "trainer.max_concurrent_runs=2",
]
RUN = [
    "+experiment=reverse_text",
    "warmup.experiment=null",
    "max_steps=6",
    "async_level=1",
    "orchestrator.batch_size=16",
    "orchestrator.group_size=4",
    "orchestrator.eval.interval=0",
    "orchestrator.eval.at_start=false",
    "orchestrator.sampling.max_tokens=12",
    "trainer.micro_batch_size=8",
    "trainer.optim.schedule=constant",
    "ckpt.interval=3",
    "cluster.trainer.nproc_per_node=1",
    "inference.dtype=float32",
    *LORA,
]
LRS = {"a": 2e-3, "b": 2e-2}


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.vllm
def test_two_runs_train_side_by_side_on_one_server_and_one_trainer(tmp_path):
    """Each run's orchestrator generates with its own adapter (by the run's name) and its
    samples carry its own policy steps; the one trainer trains both, each with its own
    learning rate; each run ends with its own rollouts, weights, metrics and checkpoint,
    and the trainer ends when both have."""
    job = RunDir(tmp_path / "job")
    inf = start_inference(job.root, nodes=1, overrides=LORA)
    try:
        write_component_config(compose([*RUN, f"output_dir={job.root}"]), "trainer")
        for name, lr in LRS.items():
            cfg = compose(
                [*RUN, f"output_dir={job.sub_run(name).root}", f"job_dir={job.root}", f"trainer.optim.lr={lr}"]
            )
            write_component_config(cfg, "trainer")
            write_component_config(cfg, "orchestrator")
        env = {"INFERENCE_SERVER_API_KEY": inf.key, "PYTHONPATH": os.pathsep.join([str(REPO), str(EXAMPLES)])}
        trainer = inf.start(
            "trainer", trainer_cmd("prime_hpc.trainer.multirun", job.component_config("trainer"), 1), **env
        )
        orchs = {
            name: inf.start(
                f"orchestrator_{name}",
                [
                    sys.executable,
                    "-m",
                    "prime_hpc.orchestrator",
                    "--config",
                    str(job.sub_run(name).component_config("orchestrator")),
                ],
                **env,
            )
            for name in LRS
        }
        deadline = time.monotonic() + 600
        for name, p in [*orchs.items(), ("trainer", trainer)]:
            while p.poll() is None:
                assert time.monotonic() < deadline, (
                    f"{name} did not end: see {inf.log(name if name == 'trainer' else f'orchestrator_{name}')}"
                )
                time.sleep(0.5)
            log = inf.log(name if name == "trainer" else f"orchestrator_{name}")
            assert p.returncode == 0, f"{name} exited {p.returncode}:\n{log.read_text()[-4000:]}"

        adapters = {}
        for name, lr in LRS.items():
            run = job.sub_run(name)
            orch, trained = _rows(run.metrics("orchestrator")), _rows(run.metrics("trainer"))
            assert [r["step"] for r in orch] == [r["step"] for r in trained] == list(range(1, 7)), name
            assert json.loads(run.rollouts_done.read_text())["last_step"] == 6
            assert json.loads(run.run_json.read_text())["state"] == "ENDED"
            assert all(abs(r["optim/lr"] - lr) < 1e-12 for r in trained)  # its own optimizer
            # its samples came from its own policies: never older than async_level allows
            assert all(r["off_policy_steps/mean"] <= 1.0 for r in trained), trained
            meta = json.loads((run.weights_step(6) / STABLE).read_text())
            assert meta["serve"] == "adapter" and meta["merged"] is True
            assert run.complete_checkpoint_steps() == [3, 6]  # its trainer's part and its orchestrator's
            adapters[name] = (run.weights_adapter(6) / "adapter_model.safetensors").read_bytes()
        assert adapters["a"] != adapters["b"]
        # the server holds both runs' policies, each at its own step; its own is the base model's
        policy = httpx.get(inf.endpoints.servers[0] + "/policy", headers={"Authorization": f"Bearer {inf.key}"}).json()
        assert set(policy["adapters"]) == {"a", "b"} and min(policy["adapters"].values()) >= 5, policy
        assert policy["policy_step"] == 0
        log = inf.log("trainer").read_text()
        assert "run a: adapter slot 0" in log and "run b: adapter slot 1" in log
    finally:
        inf.stop_all()

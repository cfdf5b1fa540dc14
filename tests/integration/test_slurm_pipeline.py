"""The flagship run on the dev cluster, in a shorter version: `prime-hpc submit
+experiment=reverse_text` submits an SFT warm-up (a plain job of the trainer alone) and the
RL run, which SLURM starts only once the warm-up completed (afterok). The warm-up stops
early on its validation loss; RL starts from its final weights and raises the reward,
off-policy by at most the recipe's async_level steps, on both kinds of environment at once:
the classic env in the orchestrator and the v1 task set in its env server, half the groups
each, and each kind's reward rises by the bar the run's does. Every address the run publishes,
and every socket of its servers, is on loopback. Then the RL-trained model teaches a fresh
one: `prime-hpc synthesize` keeps its best reversals (of the classic env and of the v1 task
set, whose env server the job runs), a fresh tiny model is trained on them (SFT), and
`prime-hpc eval` scores it above the untrained model, answering the task set's held-out
strings exactly as the classic env's. Last, the warm-up's weights
start a sweep of two LoRA runs in one job (`--together`), and each run's reward rises."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import yaml

from prime_hpc.rundir import RunDir, jobs
from tests.conftest import cli
from tests.netcheck import run_sockets
from tests.rewards import rows as _rows
from tests.rewards import trend as _trend
from tests.wandb_records import history_keys

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

# the shipped run is longer (350 steps); here its cosine decay over 180. A constant lr was
# tried: one run rose 0.45 -> 0.60 by step 100, then a step of gradient norm ~200 at step
# 121 threw it back to 0.37 (the fall-back docs/trainer.md tells of); and at 120 steps the
# rise of another was 0.022, under the bound below
RL_STEPS = 180
# two LoRA runs together from the warm-up's weights: with LoRA (alpha/rank 2) 2e-3 and 3e-3
# each rose (+0.06 and +0.08 in 100 steps), 5e-3 and 1e-2 fell back within 20 steps. Over
# 120 steps (cosine) a run once rose only +0.012, another +0.022 (t 1.6): a LoRA run climbs
# mostly once its lr has decayed (docs/trainer.md), which 160 steps give it longer: there each
# of eight runs at these rates rose +0.059 to +0.13 (t 5.7 to 9.7 where recorded)
LORA_LRS = (2e-3, 3e-3)
LORA_STEPS = 160


def test_sft_warmup_then_rl_raises_the_reward(tmp_path):
    out = tmp_path / "run"
    r = cli(
        "submit",
        "+experiment=reverse_text",
        "cluster=dev",
        f"output_dir={out}",
        f"max_steps={RL_STEPS}",
        "orchestrator.env=[{id: reverse_text}, {id: reverse_text_v1}]",
        f"orchestrator.eval.interval={RL_STEPS // 2}",
        "wandb.enabled=true",
        "wandb.offline=true",
        "wandb.log_extras.interval=20",
    )
    assert r.returncode == 0, r.stderr
    rl, warm = RunDir(out), RunDir(out / "warmup")
    rl_id, warm_id = jobs.read_job(rl)["job_ids"][-1], jobs.read_job(warm)["job_ids"][-1]
    sockets: dict = {}
    try:
        # the RL job waits in the queue for its warm-up
        reason = subprocess.run(["squeue", "-h", "-j", rl_id, "-o", "%r"], capture_output=True, text=True).stdout
        assert "Dependency" in reason, reason
        st = cli("status", rl_id)
        assert st.returncode == 0 and f"pipeline: reverse_text_warmup (warm-up, job {warm_id})" in st.stdout
        ls = cli("list")
        assert f" └ {warm_id}" in ls.stdout and ls.stdout.index(rl_id) < ls.stdout.index(warm_id)
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline and jobs.read_job(rl).get("state") not in jobs.FINAL_STATES:
            if not sockets and len(_rows(rl, "orchestrator")) >= 3:
                sockets = run_sockets(rl.root)  # while every component runs
            time.sleep(2)
        job = jobs.read_job(rl)
        assert job.get("state") == "COMPLETED", (job, jobs.read_job(warm))
    finally:
        subprocess.run(["scancel", rl_id, warm_id], capture_output=True, timeout=60)

    # the warm-up: a plain job of the trainer alone, stopped early on its validation loss
    sacct = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", warm_id], capture_output=True, text=True
    ).stdout.split()
    assert sacct == [f"{warm_id}|COMPLETED"], sacct
    wrows = _rows(warm, "trainer")
    stop_below = yaml.safe_load((warm.root / "config.yaml").read_text())["trainer"]["val"]["stop_below"]
    assert wrows[-1]["val/loss"] < stop_below and wrows[-1]["step"] < 1000
    assert all(r["val/loss"] >= stop_below for r in wrows[:-1] if "val/loss" in r)
    assert warm.weight_steps()[-1] == wrows[-1]["step"]
    assert yaml.safe_load(rl.component_config("trainer").read_text())["model"]["name"] == str(warm.root)
    # RL from those weights: the reward rises
    orch = [r for r in _rows(rl, "orchestrator") if "reward/all/mean" in r]
    trainer = _rows(rl, "trainer")
    assert [r["step"] for r in orch] == list(range(1, RL_STEPS + 1)) == [r["step"] for r in trainer]
    # a step's mean reward (64 samples at temperature 1) scatters by ~0.04: judge the trend
    # of the whole run, a least-squares line, by its rise and how far it stands above noise
    rise, t = _trend([r["reward/all/mean"] for r in orch])
    assert rise >= 0.03 and t >= 2.5, (rise, t)
    # and each kind's: a step holds the groups that finished first, so an env's mean is in
    # most steps, not all (docs/benchmarks.md: each rose ~0.21 in such a run)
    for env in ("reverse_text", "reverse_text_v1"):
        steps = [(r["step"], r[f"reward/{env}/mean"]) for r in orch if f"reward/{env}/mean" in r]
        assert len(steps) >= RL_STEPS // 2, (env, len(steps))
        rise, t = _trend([y for _, y in steps], [x for x, _ in steps])
        assert rise >= 0.03 and t >= 2.5, (env, rise, t)
    # off-policy by at most async_level steps (the recipe's 3); where a batch came from the
    # trainer's own policy (step 1 always), vLLM's and the trainer's logprobs agree up to
    # numerical noise
    assert max(r["off_policy/lag/max"] for r in orch) <= 3
    assert max(r["off_policy_steps/mean"] for r in trainer) <= 3
    on_policy = [r["mismatch_kl/mean"] for r in trainer if r["off_policy_steps/mean"] == 0]
    assert trainer[0]["off_policy_steps/mean"] == 0 and max(on_policy) < 1e-6, on_policy
    # updates in flight (inference.weight_update's default): generation goes on through every
    # update, so some samples were generated across one; their mismatch KL is reported apart
    spanning = [r for r in trainer if r["off_policy/spanning_samples"] > 0]
    assert spanning and all("mismatch_kl/spanning/mean" in r for r in spanning), trainer[-1]
    evals = {
        r["step"]: r["eval/reverse_text/avg@4"] for r in _rows(rl, "orchestrator") if "eval/reverse_text/avg@4" in r
    }
    assert set(evals) == {0, RL_STEPS // 2, RL_STEPS} and evals[RL_STEPS] > evals[0], evals
    # the server stopped at the job's end: its log ends with its own shutdown, not with the
    # interpreter's teardown reports of extension modules
    server_log = (rl.latest_logs / "inference" / "node_0.log").read_text()
    assert "Application shutdown complete" in server_log and "nanobind" not in server_log, server_log[-3000:]
    # W&B (offline): one run holding both components' metrics, sampled rollouts and distributions
    (offline,) = rl.wandb_dir.rglob("offline-run-*")
    rows = history_keys(next(offline.glob("run-*.wandb")))
    keys = set().union(*rows)
    assert {"reward/all/mean", "orchestrator/step", "loss/mean", "mismatch_kl/mean", "trainer/step"} <= keys
    assert sum("loss/mean" in r for r in rows) == RL_STEPS  # every trainer step, forwarded
    assert {"distributions/reward/_type", "distributions/advantage/_type"} <= keys
    # and the trainer's, forwarded from metrics/trainer_distributions.jsonl (every 20 steps)
    assert {"distributions/trainer/entropy/_type", "distributions/trainer/advantage/_type"} <= keys
    assert sum("distributions/trainer/entropy/_type" in r for r in rows) == RL_STEPS // 20
    tables = sorted((offline / "files" / "media" / "table").glob("samples_*.table.json"))
    assert len(tables) == RL_STEPS // 20
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "env", "example_id", "prompt", "completion", "reward", "advantage"]
    assert table["data"] and all(row[3] and isinstance(row[5], float) for row in table["data"])
    # one host: published addresses and the servers' sockets are loopback only
    for name in ("inference_0.json", "router.json"):
        assert not (rl.endpoints_dir / name).exists()  # unpublished when the servers stopped
    assert sockets["endpoints"] and all(h == "127.0.0.1" for h in sockets["endpoints"]), sockets
    # nothing listens beyond loopback (torch's TCP stores, which would bind every interface,
    # are replaced by files on one host)
    assert sockets["listening"] and not sockets["exposed"], sockets
    assert not sockets["remote_peers"], sockets

    # the RL-trained model teaches a fresh one: `prime-hpc synthesize` (a job of the dev
    # cluster) keeps its rollouts of reward >= 0.7 (this short RL run's model reverses ~5% of
    # strings exactly, most nearly: mean reward ~0.6), in the messages layout the SFT trainer
    # reads as it is; a fresh tiny model trained on them alone, evaluated (a job too, the base
    # model first, greedy), reverses strings far better than the untrained one. Half the
    # strings come from the classic env, half from the v1 task set (other strings: its seed 1),
    # which the job plays in an env server of its own
    synth = tmp_path / "synth"
    s = cli(
        "synthesize",
        f"model={rl.weights_step(RL_STEPS)}",
        "env=reverse-text,reverse_text_v1",
        "args.reverse_text_v1.seed=1",
        "rollouts=2",
        "examples=500",
        "min_reward=0.7",
        "cluster=dev",
        "orchestrator.sampling.max_tokens=32",
        "seq_len=80",
        f"out={synth}",
        timeout=900,
    )
    assert s.returncode == 0, s.stdout + s.stderr
    assert "submitted synthesize job" in s.stdout and "of 2000 rollouts kept" in s.stdout, s.stdout[-3000:]
    summary = json.loads((synth / "summary.json").read_text())
    data = [json.loads(line) for line in (synth / "data.jsonl").read_text().splitlines()]
    assert (summary["examples"], summary["rollouts"]) == (1000, 2000) and summary["kept"] == len(data) >= 300, summary
    for row in data:
        system, user, assistant = row["messages"]
        assert (system["role"], user["role"], assistant["role"]) == ("system", "user", "assistant")
        assert row["reward"] >= 0.7 and row["metrics"]["lcs_reward"] == pytest.approx(row["reward"]), row
    kept_v1 = sum(row["env"] == "reverse_text_v1" for row in data)
    assert 100 <= kept_v1 <= len(data) - 100, (kept_v1, len(data))  # both kinds taught
    assert jobs.read_job(RunDir(synth / "job"))["kind"] == "synthesize"
    assert (synth / "job" / "private" / "envservers").is_dir()  # the task set's server: the job's own files
    student = tmp_path / "student"
    r = cli(
        "submit",
        "+experiment=reverse_text_sft",
        "cluster=dev",
        f"output_dir={student}",
        f"trainer.data.name={synth / 'data.jsonl'}",
        "trainer.data.args={}",
        "max_steps=400",
        "ckpt.interval=400",
        "-f",
        timeout=900,
    )
    assert r.returncode == 0 and jobs.read_job(RunDir(student))["state"] == "COMPLETED", r.stdout[-3000:] + r.stderr
    # evaluated on the classic env and on the v1 task set's same held-out strings (an env
    # server of the eval job's): greedy, the same model answers both the same, string for string
    e = cli(
        "eval",
        str(student),
        "orchestrator.sampling.temperature=0",
        "orchestrator.eval.rollouts_per_example=1",
        "orchestrator.eval.env=[{id: reverse_text}, {id: reverse_text_v1, args: {split: eval}}]",
        timeout=900,
    )
    assert e.returncode == 0, e.stdout + e.stderr
    untrained = json.loads(RunDir(student).eval_result(0).read_text())
    taught = json.loads(RunDir(student).eval_result(400).read_text())
    print(f"untrained {untrained}\ntaught by the RL model's samples {taught}")
    assert untrained["eval/reverse_text/pass@1"] <= 0.05, untrained
    assert taught["eval/reverse_text/avg@1"] >= untrained["eval/reverse_text/avg@1"] + 0.2, (untrained, taught)
    answers: dict = {}
    for line in (RunDir(student).eval_dir / "step_400.samples.jsonl").read_text().splitlines():
        sample = json.loads(line)
        answers.setdefault(sample["env"], {})[json.dumps(sample["prompt"])] = sample["completion"]
    classic, v1 = answers["reverse_text"], answers["reverse_text_v1"]
    assert len(v1) == len(classic) >= 50 and v1 == classic, (len(v1), len(classic))
    assert taught["eval/reverse_text_v1/avg@1"] == pytest.approx(taught["eval/reverse_text/avg@1"]), taught

    # a sweep of two LoRA runs from the warm-up's weights in one job (`--together`: one
    # trainer holding both adapters, one server serving both), each with its own optimizer
    # and adapter: each run's reward rises. (LoRA's window is narrow here: over 120 steps the
    # rise at 2e-3 scattered from +0.01 to +0.07 between jobs, at 3e-3 from +0.02 to +0.09,
    # at 3.5e-3 and up a run could fall back: docs/trainer.md. Each run's rise is printed.)
    together = RunDir(tmp_path / "together")
    t = cli(
        "submit",
        "-m",
        "+experiment=reverse_text",
        "cluster=dev",
        "warmup.experiment=null",
        f"model.name={warm.root}",
        f"output_dir={together.root}",
        f"max_steps={LORA_STEPS}",
        "orchestrator.eval.interval=0",
        "orchestrator.eval.at_start=false",
        "trainer.model.lora.enabled=true",
        f"trainer.optim.lr={','.join(map(str, LORA_LRS))}",
        "--together",
        "-f",
        timeout=1200,
    )
    assert t.returncode == 0 and jobs.read_job(together)["state"] == "COMPLETED", t.stdout[-3000:] + t.stderr
    adapters, rises = set(), []
    for i, lr in enumerate(LORA_LRS):
        run = together.sub_run(f"reverse_text_{i}")
        orch = [r for r in _rows(run, "orchestrator") if "reward/all/mean" in r]
        assert [r["step"] for r in orch] == list(range(1, LORA_STEPS + 1)), run.root
        assert _rows(run, "trainer")[0]["optim/lr"] == pytest.approx(lr, rel=1e-3)  # its own optimizer
        rise, t_stat = _trend([r["reward/all/mean"] for r in orch])
        print(f"LoRA run at lr {lr}: reward rise {rise:.3f} (t = {t_stat:.1f})")
        rises.append((rise, t_stat, lr))
        adapters.add((run.weights_adapter(LORA_STEPS) / "adapter_model.safetensors").read_bytes())
    assert len(adapters) == 2
    # each run's rise is clear of the noise: a one-sided test of its least-squares slope at
    # p < 0.01 (t >= 2.5; a step's residuals are nearly independent, lag-1 correlation
    # -0.1 to 0.15 measured), and the better run's rise is worth having
    assert all(t_stat >= 2.5 for _, t_stat, _ in rises), rises
    assert max(rises)[0] >= 0.03, rises

"""The head of a job that trains several runs (`prime-hpc submit -m ... --together`): one
orchestrator process per run of the job's `runs/`, side by side on the head node.

Each is `python -m prime_hpc.orchestrator --config runs/<name>/configs/orchestrator.yaml`,
its log `logs/<attempt>/runs/<name>/orchestrator.log` (its environments' logs beside it). A
run already over under its config (`prime_hpc.rundir.runs`: ended, refused, failed) is not
started again. A run cancelled alone (`prime-hpc cancel <job> --run <name>`) has its
orchestrator stopped (SIGTERM; SIGKILL when it has not ended `STOP_WAIT_S` later), as has a
run the trainer failed (its loss diverged) or the watchdog did (its orchestrator stalled):
`run.json` FAILED. An orchestrator that fails ends its run only: the head records it
(`runs/<name>/run.json` FAILED, with the last line of its log), the trainer frees the
run's adapter slot, and the others go on. The head ends when every orchestrator has; it
fails (naming each run and its log) only when every run failed. A stop (SIGTERM) is passed
to every orchestrator, which stops at its next safe point.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from prime_hpc.core import jobenv
from prime_hpc.rundir import RunDir, last_line, logtree, runs

POLL_S = 0.5
STOP_WAIT_S = 60.0  # after a stop, how long an orchestrator has to end before it is killed


def run_logs(job: RunDir, name: str) -> Path:
    """Where run `name`'s orchestrator logs in this attempt."""
    logs = jobenv.logs_dir()
    return logtree.sub_run_logs(logs if logs else job.root / "logs", name)


def start(job: RunDir, name: str) -> subprocess.Popen:
    run = job.sub_run(name)
    logs = run_logs(job, name)
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, jobenv.LOGS_VAR: str(logs)}
    with open(logtree.component_log(logs, "orchestrator"), "ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-u",
                "-m",
                "prime_hpc.orchestrator",
                "--config",
                str(run.component_config("orchestrator")),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


class FleetKeeper:
    """The job's inference servers, shared by every run, kept by the head (one keeper, not
    one per run): a server restarted in its slot (a new URL) first gets every run's newest
    adapter, then joins the router; one that is gone leaves it (`orchestrator.fleet.
    keep_fixed`: `fleet/membership.json`, which `status` shows and each run's relay follows
    for its updates). Runs in a thread of its own, beside the orchestrators' loop."""

    def __init__(self, job: RunDir) -> None:
        self.job = job
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.task: Optional[asyncio.Task] = None
        self.thread = threading.Thread(target=self._run, name="fleet", daemon=True)

    def start(self) -> "FleetKeeper":
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except asyncio.CancelledError:
            pass
        except Exception as e:  # the runs go on with the servers they have
            print(f"prime-hpc head: the job's fleet is no longer kept ({type(e).__name__}: {e})", flush=True)

    async def _main(self) -> None:
        from prime_hpc.inference.client import api_key, discover
        from prime_hpc.orchestrator.client import SERVERS_WAIT_S
        from prime_hpc.orchestrator.fleet import keep_fixed

        self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        nodes, own = _fleet_shape(self.job)
        ep = await asyncio.to_thread(discover, self.job, nodes, SERVERS_WAIT_S, jobenv.logs_dir(), own_job=own)
        await keep_fixed(self.job, ep, api_key(), prepare=self.load_adapters)

    async def load_adapters(self, admin: Any, url: str) -> None:
        """Every run still going: its newest adapter into the joining server `url`."""
        for name in self.job.sub_runs():
            run = self.job.sub_run(name)
            steps = [] if runs.is_over(run) else [s for s in run.weight_steps() if run.weights_adapter(s).is_dir()]
            if steps:
                await admin.load_lora(name, run.weights_adapter(steps[-1]), steps[-1], to=[url])

    def stop(self) -> None:
        if self.loop is not None and self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(timeout=10)


def _fleet_shape(job: RunDir) -> tuple[int, bool]:
    """The job's inference nodes, and whether they are a job of their own, as the runs'
    orchestrators are told (the first run's config)."""
    import yaml

    for name in job.sub_runs():
        try:
            cfg = yaml.safe_load(job.sub_run(name).component_config("orchestrator").read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        return int(cfg.get("inference_nodes") or 1), cfg.get("inference_job") == "own"
    return 1, False


def run_all(job: RunDir) -> dict:
    """Every run's orchestrator, until all have ended; {"runs": {name: exit code}}. Runs
    that appear meanwhile (`submit --into`), or that a resume makes to run again (a new
    trainer config), are started too. The job's servers are kept meanwhile (`FleetKeeper`)."""
    keeper = FleetKeeper(job).start()
    procs: dict[str, subprocess.Popen] = {}
    started: dict[str, Optional[int]] = {}  # run -> the trainer config it was started (or found over) under
    codes: dict[str, int] = {}
    cancelled: dict[str, float] = {}  # run -> when its orchestrator was asked to stop
    try:
        while True:
            for name in job.sub_runs():
                run = job.sub_run(name)
                running = name in procs and procs[name].poll() is None
                if running or (name in started and started[name] == runs.config_mtime(run)):
                    continue
                started[name] = runs.config_mtime(run)
                if runs.is_over(run):
                    rec = runs.state(run) or {}
                    how = " ".join(str(rec[k]) for k in ("state", "step") if rec.get(k) is not None)
                    print(f"prime-hpc head: run {name} is over ({how}); not started", flush=True)
                    continue
                procs[name] = start(job, name)
                codes.pop(name, None)
                cancelled.pop(name, None)  # a run resumed after a cancel or a failure: not stopped again
                log = orchestrator_log(job, name)
                print(f"prime-hpc head: run {name}: orchestrator pid {procs[name].pid}, log {log}", flush=True)
            for name, p in procs.items():
                if p.poll() is None and name not in cancelled and runs.is_stopped(job.sub_run(name)):
                    # `prime-hpc cancel <job> --run <name>`, the trainer failed the run (its loss
                    # diverged), or the watchdog did (its orchestrator stalled)
                    cancelled[name] = time.monotonic()
                    rec = runs.state(job.sub_run(name)) or {}
                    how = "cancelled" if rec.get("state") == runs.CANCELLED else f"failed ({rec.get('reason')})"
                    print(f"prime-hpc head: run {name} {how}; stopping its orchestrator", flush=True)
                    p.send_signal(signal.SIGTERM)
                elif p.poll() is None and name in cancelled and time.monotonic() - cancelled[name] > STOP_WAIT_S:
                    print(
                        f"prime-hpc head: run {name}: its orchestrator outlived {STOP_WAIT_S:g}s after SIGTERM; killed",
                        flush=True,
                    )
                    p.kill()
                    cancelled[name] = float("inf")  # killed once
                if name in codes or p.poll() is None:
                    continue
                codes[name] = p.returncode
                log = orchestrator_log(job, name)
                if p.returncode == 0 or runs.is_stopped(job.sub_run(name)):  # a cancel is no failure
                    print(
                        f"prime-hpc head: run {name}: orchestrator {'stopped' if name in cancelled else 'done'}",
                        flush=True,
                    )
                else:
                    why = f"its orchestrator exited {p.returncode}: {last_line(log, cut=None) or '(no output)'}"
                    runs.record(job.sub_run(name), runs.FAILED, reason=why)
                    print(f"prime-hpc head: run {name} failed ({why}); see {log}; the other runs go on", flush=True)
            if len(codes) == len(procs):  # every orchestrator started has ended
                break
            time.sleep(POLL_S)
    finally:
        stop(procs)
        keeper.stop()
    failed = [n for n, c in codes.items() if _failed(job, n, c)]
    if procs and len(failed) == len(procs):
        raise SystemExit(
            "every run failed: " + "; ".join(f"{n} (see {orchestrator_log(job, n)})" for n in sorted(failed))
        )
    return {"runs": codes}


def _failed(job: RunDir, name: str, code: int) -> bool:
    """The run failed: its orchestrator (exit code), or its trainer (`run.json`); a cancel
    is no failure."""
    state = (runs.state(job.sub_run(name)) or {}).get("state")
    return state != runs.CANCELLED and (code != 0 or state == runs.FAILED)


def orchestrator_log(job: RunDir, name: str) -> Path:
    return logtree.component_log(run_logs(job, name), "orchestrator")


def stop(procs: dict[str, subprocess.Popen], wait_s: Optional[float] = STOP_WAIT_S) -> None:
    """SIGTERM to every orchestrator still running, then SIGKILL to those that outlive `wait_s`."""
    alive = [p for p in procs.values() if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + (wait_s or 0)
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

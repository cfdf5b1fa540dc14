"""Where an RL step's time goes, from a sampling profile of a real run.

One local RL run of the reverse_text recipe (no warm-up); once it is past its start-up,
py-spy samples the trainer's rank and the orchestrator (with its environment workers and
every other child) for `--seconds`, wall clock, idle time included. Each sample's stack is
put in the first category whose pattern it holds (below); each process's samples are
shown as shares of its main thread's wall time (other threads while they run Python, on
top), next to the run's own timers for the same steps. Sampling at 200 Hz takes some of
the 2 cores: steps run slower while profiled.

    .venv/bin/python benchmarks/profile_step.py [--seconds 20] [--workdir DIR] [OVERRIDE ...]

Needs py-spy (`.venv/bin/pip install py-spy`; it reads other processes' memory: root, or
ptrace allowed). The run is cancelled when the profile is taken.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import machine, prime_hpc, project_versions, read_jsonl  # noqa: E402

# (category, regex over the whole collapsed stack): the first that matches wins
TRAINER = [
    ("waiting for the batch", r"_wait_for_batch|wait_for_rollouts"),
    ("batch read", r"_read_batch|read_rank"),
    ("weight publish", r"save_weights|write_weights"),
    ("checkpoint", r"_checkpoint_and_prune|save_checkpoint"),
    ("optimizer", r"torch/optim/|clip_grad"),
    ("FSDP (shard, gather, reduce)", r"torch/distributed/"),
    ("backward", r"backward \(|torch/autograd/"),
    ("forward (and loss)", r"_train_on"),
    ("logging, metrics", r"_log_step|runner\.py"),
]
ORCHESTRATOR = [
    ("batch writing", r"write_step"),
    ("weight update (relay, HTTP)", r"update_weights|relay|weight"),
    ("scoring (rewards)", r"rubric|score|reward"),
    ("HTTP client, JSON", r"httpx|httpcore|h11|openai/|json"),
    ("rollout bookkeeping (tokens, advantages)", r"prime_hpc/orchestrator/"),
    ("environment (verifiers)", r"verifiers/"),
]
IDLE = r"select \(|epoll|poll \(|sleep|wait \(|_wait_for_tstate_lock|acquire \("


def pyspy_path() -> str:
    return shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))


def steps(run: Path) -> list[dict]:
    path = run / "metrics" / "trainer.jsonl"
    return read_jsonl(path) if path.exists() else []


def run_processes(run: Path) -> dict[str, int]:
    """The pids of the run's trainer rank 0 and its orchestrator (its job head)."""
    logs = str((run / "logs" / "latest").resolve())
    found: dict[str, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(e.split("=", 1) for e in (d / "environ").read_text().split("\0") if "=" in e)
            cmd = (d / "cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        if env.get("PRIME_HPC_LOGS") != logs:
            continue
        if env.get("RANK") == "0" and "prime_hpc.trainer" in cmd:
            found["trainer"] = int(d.name)
        elif "prime_hpc.job.head" in cmd:
            found["orchestrator"] = int(d.name)
    return found


def record(pyspy: str, pid: int, seconds: int, out: Path, subprocesses: bool) -> None:
    argv = [
        pyspy,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(seconds),
        "--rate",
        "200",
        "--idle",
        "--format",
        "raw",
        "--output",
        str(out),
        "--nonblocking",
    ]
    if subprocesses:
        argv.append("--subprocesses")
    subprocess.run(argv, check=True, capture_output=True, text=True)


def shares(raw: Path, categories: list[tuple[str, str]]) -> tuple[Counter, int]:
    """Samples per category, and the main thread's samples (its wall time). The main
    thread's idle samples count as "idle"; other threads count only while they run
    Python (a pool thread waiting for work is not part of a step), as "in threads: ..."."""
    counts: Counter = Counter()
    main_total = 0
    for line in raw.read_text(errors="replace").splitlines():  # frames may hold any bytes
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        idle = re.search(IDLE, leaf) or leaf.startswith("_worker (concurrent/futures/thread.py")
        main = "_run_module_as_main" in stack
        if main:
            main_total += int(n)
        elif idle:
            continue
        name = (
            "idle (waiting: event loop, locks, sleeps)"
            if idle
            else next((c for c, pat in categories if re.search(pat, stack)), "other")
        )
        counts[name if main else f"in threads: {name}"] += int(n)
    return counts, main_total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--workdir", type=Path, default=Path("outputs/bench-profile"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if not Path(pyspy_path()).exists():
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    work = a.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    run = work / "rl"
    overrides = [
        "+experiment=reverse_text",
        "cluster=local",
        "warmup.experiment=null",
        "model.name=tiny",
        "name=bench_profile",
        "max_steps=1000",
        "orchestrator.eval.interval=0",
        *a.overrides,
    ]
    print(f"[profile] {' '.join(overrides)}", flush=True)
    r = prime_hpc("submit", *overrides, f"output_dir={run}")
    if r.returncode:
        raise SystemExit(f"[profile] submit failed:\n{r.stderr}")
    try:
        deadline = time.monotonic() + 900
        while len(steps(run)) < 10:  # start-up and compilation behind
            if time.monotonic() > deadline:
                raise SystemExit(f"[profile] no step 10 within 900 s; see `prime-hpc tail {run}`")
            time.sleep(2)
        pids = run_processes(run)
        if set(pids) != {"trainer", "orchestrator"}:
            raise SystemExit(f"[profile] found {pids}, not the trainer and the orchestrator")
        first = len(steps(run))
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--_record", name, str(pid), str(a.seconds), str(work / f"{name}.txt")]
            )
            for name, pid in pids.items()
        ]
        for p in procs:
            p.wait()
        last = len(steps(run))
    finally:
        prime_hpc("cancel", str(run))
    rows = [row for row in steps(run) if first < row["step"] <= last]
    print()
    print(f"machine:   {machine()}")
    print(f"prime-hpc: {project_versions()}")
    print(f"profile:   py-spy, {a.seconds} s of wall time at 200 Hz, idle included; steps {first + 1}-{last}")
    if rows:
        med = {
            k: statistics.median(float(row[k]) for row in rows)
            for k in ("time/step", "time/forward_backward", "time/wait_for_batch", "time/save_weights")
        }
        print("run's own timers (median): " + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()))
    for name, cats in (("trainer", TRAINER), ("orchestrator", ORCHESTRATOR)):
        counts, total = shares(work / f"{name}.txt", cats)
        print(
            f"\n{name}"
            + (" (rank 0)" if name == "trainer" else " (with its environment workers)")
            + f": {total} samples of its main thread = 100%"
        )
        for cat, n in counts.most_common():
            print(f"  {cat:48} {n / max(total, 1):6.1%}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_record":  # one py-spy per process, side by side
        _, _, name, pid, seconds, out = sys.argv
        record(pyspy_path(), int(pid), int(seconds), Path(out), subprocesses=name == "orchestrator")
        sys.exit(0)
    sys.exit(main())

"""The head task: what het group 0 runs. On SLURM it is the callable submitit pickles and
runs (`python -m submitit.core._submit`), so submitit tracks it and keeps its result;
locally it runs as `python -m prime_hpc.job.head`. Checkpoint and requeue at a time
limit are the job script's (sbatch_templates/_functions.sh.j2): submitit's own protocol
handles one process that checkpoints itself, not a job of several groups, nor an SFT job
without a head."""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass, field

from prime_hpc.rundir import RunDir


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@dataclass
class HeadTask:
    mode: str  # run | doctor
    output_dir: str
    expected: dict[str, int] = field(default_factory=dict)  # doctor: reports to wait for, per group

    def __call__(self) -> dict:
        # SIGTERM means "stop now, cleanly" (cancel, time limit, a failed peer): exit via
        # SystemExit so `finally` blocks run. (submitit's own handler would ignore it.)
        signal.signal(signal.SIGTERM, _exit_on_term)
        run = RunDir(self.output_dir)
        if self.mode == "doctor":
            from prime_hpc.job.preflight import run_head

            summary = run_head(run, self.expected)
            if not summary["ok"]:
                raise SystemExit(f"preflight failed; see {run.preflight_summary}")
            return summary
        if run.sub_runs():  # a job of several runs: one orchestrator each
            from prime_hpc.job.runs import run_all

            return run_all(run)
        from prime_hpc.orchestrator import main as orchestrator_main  # the RL head component

        return orchestrator_main(["--config", str(run.component_config("orchestrator"))])

    def argv(self, python: str) -> list[str]:
        """The local equivalent of submitit's command for this task."""
        args = [python, "-u", "-m", "prime_hpc.job.head", self.mode, self.output_dir]
        for group, n in self.expected.items():
            args += ["--expect", f"{group}={n}"]
        return args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prime_hpc.job.head")
    p.add_argument("mode", choices=("run", "doctor"))
    p.add_argument("output_dir")
    p.add_argument("--expect", action="append", default=[], help="group=N reports to wait for (doctor)")
    a = p.parse_args(argv)
    expected = {k: int(v) for k, v in (e.split("=", 1) for e in a.expect)}
    HeadTask(a.mode, a.output_dir, expected)()
    return 0


if __name__ == "__main__":
    sys.exit(main())

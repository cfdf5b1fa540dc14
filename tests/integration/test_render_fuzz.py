"""Fuzzing the job scripts: 300 generated hostile values (`FUZZ_N=` for more: quotes, `$()`,
backticks, `;`, `&&`, pipes, newlines and other control characters, globs, unicode) as the run
name, the output directory, the interpreter's path and the SLURM options. A value holding a
control character is refused by every renderer in one line (a newline would end the comment
or the `#SBATCH` line it is on); every other script (the run's on SLURM and locally, and an
extra inference job's) is rendered, passes `bash -n`, and is then run for real in a sandbox: a PATH that finds nothing, so that every command it calls lands in bash's
`command_not_found_handle`, which only records it, and the interpreter a stub that records
its arguments. Nothing but the script's own commands may run, and every value must reach
them exactly as given."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

from omegaconf import OmegaConf

from prime_hpc.config.compose import compose
from prime_hpc.core.errors import UserError
from prime_hpc.core.text import control_char
from prime_hpc.launcher.plan import InferenceJobPlan, make_plan, slurm_job_name
from prime_hpc.launcher.render import render_inference, render_local, render_sbatch

N_VALUES = int(__import__("os").environ.get("FUZZ_N", 300))
PIECES = [
    "'",
    '"',
    "$(touch PWNED)",
    "`touch PWNED`",
    ";touch PWNED;",
    "\ntouch PWNED\n",
    "&& touch PWNED",
    "| touch PWNED",
    "$((1+1))",
    "$IFS",
    "\\",
    "\\'",
    "$HOME",
    "$0",
    "*",
    "?",
    "[a]",
    "#",
    "~",
    " ",
    "\t",
    "é",
    "☃",
    "日本",
    "--x",
    "-n",
    "%n",
    "%j",
    "{a,b}",
    ">out",
    "<in",
    "!",
    "!!",
    "=",
    ":",
    ",",
    "\r",
    "\x1b[2J",
    "\x85",
    "\u2028",
    "\x7f",
]
ALLOWED = {"srun", "setsid", "scancel", "seq", "sleep", "taskset", "env"}  # what the scripts call besides python

# every command the script calls goes here (PATH is empty): recorded, never run
SANDBOX = r"""
command_not_found_handle() {
  printf '%s\0' "CMD" "$@" >> "$FUZZ_RECORD"
  [ "$1" = seq ] && { local i; for ((i = $2; i <= $3; i++)); do echo $i; done; }
  return 0
}
"""
STUB = """#!/bin/bash
printf '%s\\0' "PY" "$@" >> "$FUZZ_RECORD"
case "$3" in start) echo "$FUZZ_LOGS" ;; rendezvous) echo 127.0.0.1:1 ;; esac
exit 0
"""


def hostile_values(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    values = []
    for i in range(n):
        parts = [rng.choice(PIECES) for _ in range(rng.randint(1, 5))]
        parts.insert(rng.randint(0, len(parts)), f"v{i}")  # unique, and never empty
        values.append("".join(parts))
    return values


def run_sandboxed(script: str, cwd: Path, record: Path, logs: Path) -> subprocess.CompletedProcess:
    record.write_bytes(b"")
    env = {
        "PATH": "/nonexistent",
        "FUZZ_RECORD": str(record),
        "FUZZ_LOGS": str(logs),
        "SLURM_JOB_ID": "1",
        "HOME": str(cwd),
        "INFERENCE_SERVER_API_KEY": "fuzz-key",
    }  # the key reaches the job: its absence is tested on its own
    body = script.split("\n", 1)[1]  # the sandbox goes first, after the shebang
    return subprocess.run(
        ["/bin/bash", "-c", SANDBOX + body], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def recorded(record: Path) -> list[list[str]]:
    calls: list[list[str]] = []
    for field in record.read_bytes().decode().split("\0")[:-1]:
        if field in ("CMD", "PY"):
            calls.append([field])
        else:
            calls[-1].append(field)
    return calls


def test_hundreds_of_hostile_values_render_inert_scripts(tmp_path):
    base = compose(["+experiment=reverse_text", "cluster=dev", "output_dir=/x", "cluster.cache_dir=/cache"])
    logs = tmp_path / "logs"
    for sub in ("inference", "trainer"):
        (logs / sub).mkdir(parents=True)
    work = tmp_path / "cwd"
    work.mkdir()
    record = tmp_path / "record"
    refused = ran = 0
    for i, value in enumerate(hostile_values(N_VALUES)):
        home = tmp_path / "py" / str(i) / value.replace("/", "_").replace("\0", "")
        home.mkdir(parents=True)
        python = home / "python"
        python.write_text(STUB)
        python.chmod(0o755)
        out = str(tmp_path / "runs" / value.replace("/", "_"))
        cfg = OmegaConf.to_container(base)
        cfg.update(name=value, output_dir=out)
        cfg["cluster"].update(python=str(python), partition=value, account=value, qos=value)
        plan = make_plan(OmegaConf.create(cfg), cores=[0, 1])
        plan.head_argv = [plan.python, "-u", "-m", "submitit.core._submit", str(plan.run.submitit_dir)]
        assert slurm_job_name(value) == plan.job_name and control_char(plan.job_name) is None
        extra = InferenceJobPlan(plan, plan.groups[1], slurm_job_name(f"{value}-inference"))
        renders = [  # each script, and the helper it starts with (`prime_hpc.job.<helper> start`)
            ("attempt", render_sbatch, (plan,)),
            ("attempt", render_local, (plan, f"local-{i}")),
            ("extra", render_inference, (extra,)),
        ]
        scripts = []
        for helper, render, args in renders:
            try:
                scripts.append((helper, render(*args)))
            except UserError as e:  # a control character: refused in one line, by every renderer
                assert control_char(value) and "\n" not in str(e), (value, e)
                refused += 1
        assert not scripts or not control_char(value), value
        for helper, text in scripts:
            assert subprocess.run(["/bin/bash", "-n"], input=text, text=True, capture_output=True).returncode == 0
            done = run_sandboxed(text, work, record, logs)
            assert "syntax error" not in done.stderr and "command not found" not in done.stderr, done.stderr
            calls = recorded(record)
            strangers = [c for c in calls if c[0] == "CMD" and c[1] not in ALLOWED]
            assert not strangers, (value, strangers)
            py = [c[1:] for c in calls if c[0] == "PY"]
            starts = [a for a in py if a[:4] == ["-m", f"prime_hpc.job.{helper}", "start", out]]
            assert starts, (value, py)  # the output dir reached the interpreter as one exact argument
            # ...and so did the interpreter's own path (locally: started through prime_hpc.job.child)
            launched = [
                c for c in calls if str(python) in c[1:] and (c[0] == "CMD" or c[1:3] == ["-m", "prime_hpc.job.child"])
            ]
            assert launched, (value, calls)
            if text.startswith("#!/bin/bash\n# prime-hpc rl run: one heterogeneous"):
                for opt in ("partition", "account", "qos"):  # what sbatch would read
                    assert f"#SBATCH --{opt}=" in text
            ran += 1
        assert not list(work.iterdir()), (value, list(work.iterdir()))  # nothing created (no PWNED, no >out)
    assert ran >= N_VALUES and 0 < refused < 3 * N_VALUES

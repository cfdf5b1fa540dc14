"""Render the job scripts from `sbatch_templates/`: a pure function of a `Plan`.

Every interpolated value goes through a quoting filter: `q` (POSIX shell), `qjoin`
(an argv) or `sbatch_q` (a value on an `#SBATCH` line, which sbatch parses itself). No
value holding a control character (`core.text.control_char`: a newline, a carriage
return, ESC ...) is rendered at all, wherever it would go (a comment, an `#SBATCH` line, a
command): validation refuses those at submit naming the key, and a plan built otherwise (a
recorded config of an older run, a caller that skipped validation) is refused here in one
line. `cluster.env_setup` alone is rendered as it is: it is shell the user writes.
"""

from __future__ import annotations

import dataclasses
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any

from prime_hpc.core.errors import UserError
from prime_hpc.core.jobenv import STALLED
from prime_hpc.core.text import control_char
from prime_hpc.launcher.plan import InferenceJobPlan, Plan
from prime_hpc.rundir import RunDir, logtree

TEMPLATES = Path(__file__).resolve().parents[2] / "sbatch_templates"
# How long components get to exit (e.g. finish a checkpoint) before SIGKILL, and how long a
# requeue or preemption waits for their checkpoint; below SLURM's default KillWait (30 s) so
# the script still records the outcome before SLURM kills it.
STOP_GRACE_S = 20


VERBATIM = ("env_setup",)  # the Plan's fields rendered as the user wrote them (shell lines)


def plain(value: object, where: str = "a value") -> str:
    """`value` as text, refused in one line (`UserError`) when it holds a control character."""
    text = str(value)
    bad = control_char(text)
    if bad:
        raise UserError(
            f"{where} {text!r} holds the control character {bad}, which a job script cannot carry; remove it"
        )
    return text


def check_plain(value: object, where: str) -> None:
    """Every string in `value` (a Plan, its groups, lists and mappings, keys included)
    `plain`; `where` names it in the error (`name`, `groups.1.argv.3`)."""
    if isinstance(value, str):
        plain(value, where)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if f.name not in VERBATIM:
                check_plain(getattr(value, f.name), f.name if where == "plan" else f"{where}.{f.name}")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_plain(k, f"{where} (a key)")
            check_plain(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}.{i}")


def sbatch_quote(value: object) -> str:
    """Quote a value for an `#SBATCH` line, which sbatch parses itself: double quotes
    group, a backslash escapes the next character. A newline (any control character)
    cannot be carried."""
    text = plain(value, "a SLURM option")
    if text and not any(c.isspace() or c in "'\"\\$`;&|<>()#*?[]{}~" for c in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@lru_cache(maxsize=1)
def _env():
    import jinja2

    from prime_hpc.core import usercache

    class CompiledTemplates(jinja2.BytecodeCache):
        """Each template compiled once and kept in the user's own cache, not at every
        submit (Jinja checks the source's checksum). Compiled code is loaded only from a
        file and directory of the user's alone (`usercache.read`); a cache that cannot be
        written (a read-only home) is no error."""

        def __init__(self, directory: Path) -> None:
            self.directory = directory

        def load_bytecode(self, bucket: Any) -> None:
            data = usercache.read(self.directory, f"{bucket.key}.cache")
            if data is not None:
                bucket.bytecode_from_string(data)

        def dump_bytecode(self, bucket: Any) -> None:
            try:
                usercache.write(self.directory, f"{bucket.key}.cache", bucket.bytecode_to_string())
            except (OSError, usercache.Untrusted):
                pass

    compiled = usercache.directory("templates")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        bytecode_cache=CompiledTemplates(compiled) if compiled else None,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(plain(v))
    env.filters["qjoin"] = lambda argv: " ".join(shlex.quote(plain(a)) for a in argv)
    env.filters["sbatch_q"] = sbatch_quote
    return env


def checkpoint_budget_s(signal_delay_s: int) -> int:
    """Of the warning SLURM gives before the time limit, how long the components get to
    checkpoint and exit; the rest is left for stopping the services and requeueing."""
    return max(10, int(signal_delay_s) - STOP_GRACE_S - 10)


def _render(template: str, plan: Plan, **extra: object) -> str:
    check_plain(plan, "plan")
    for key, value in extra.items():
        check_plain(value, key)
    budget_s = checkpoint_budget_s(plan.signal_delay_s)
    return (
        _env()
        .get_template(template)
        .render(
            plan=plan,
            grace_s=STOP_GRACE_S,
            layout=RunDir,
            logtree=logtree,
            LOGS="$LOGS",
            stalled_rc=STALLED,
            checkpoint_budget_s=budget_s,
            **extra,
        )
    )


def render_sbatch(plan: Plan) -> str:
    """The batch script for `plan` (cluster=slurm): a het job, or a plain job for one group."""
    slurm_output = f"{plan.run.submitit_dir}/%j_batch.out"  # output_dir never holds '%' (validated)
    return _render("run.sbatch.j2", plan, slurm_output=slurm_output)


def render_local(plan: Plan, job_id: str) -> str:
    """The same components as local processes (cluster=local)."""
    return _render("run.local.sh.j2", plan, job_id=job_id)


def render_inference(job: InferenceJobPlan) -> str:
    """The batch script of an extra inference job (`prime-hpc scale`, SLURM only)."""
    return _render(
        "inference.sbatch.j2",
        job.plan,
        inf=job.group,
        job_name=job.job_name,
        slurm_output=str(job.plan.run.extra_batch_log("%j")),  # output_dir never holds '%' (validated)
        run_check_s=job.run_check_s,
        leave_timeout_s=job.leave_timeout_s,
        exclusive=job.exclusive,
    )

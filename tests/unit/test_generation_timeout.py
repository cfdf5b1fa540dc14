"""`orchestrator.generation_timeout_s` is the timeout of every policy client a job makes
with the orchestrator's config at hand: the run's orchestrator, eval (its job and from
the command line: both through `orchestrator.evaluate.run_evaluator`), synthesize (its job
and here) and bench."""

from __future__ import annotations

import ast
from pathlib import Path

import prime_hpc

PACKAGE = Path(prime_hpc.__file__).parent


def _client_calls() -> list[tuple[str, int, set[str]]]:
    """Every call of `make_client` in the package: (file, line, its keyword arguments)."""
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name == "make_client":
                    calls.append((str(path.relative_to(PACKAGE.parent)), node.lineno, {k.arg for k in node.keywords}))
    return calls


def test_every_policy_client_of_the_package_is_given_the_configured_timeout():
    calls = _client_calls()
    where = {file for file, _, _ in calls}
    for file in (
        "prime_hpc/orchestrator/loop.py",
        "prime_hpc/orchestrator/evaluate.py",
        "prime_hpc/orchestrator/synthesize.py",
        "prime_hpc/orchestrator/bench.py",
    ):
        assert file in where, file
    untimed = [f"{file}:{line}" for file, line, keywords in calls if "timeout_s" not in keywords]
    assert not untimed, f"make_client without timeout_s (orchestrator.generation_timeout_s): {untimed}"


def test_an_eval_of_a_run_asks_with_the_run_s_generation_timeout(tmp_path, monkeypatch):
    """`prime-hpc eval <run>` here: its client's timeout is the run's `orchestrator.generation_timeout_s`."""
    from prime_hpc.config.compose import compose
    from prime_hpc.orchestrator import client, evaluate
    from prime_hpc.rundir import RunDir

    made: list[float] = []
    real = client.make_client

    def recording(*args, **kwargs):
        made.append(kwargs.get("timeout_s", client.GENERATION_TIMEOUT_S))
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "make_client", recording)
    cfg = compose(
        ["+experiment=reverse_text", f"output_dir={tmp_path / 'run'}", "orchestrator.generation_timeout_s=12.5"]
    )
    evaluate.score_steps(RunDir(tmp_path / "run"), cfg, [], "http://127.0.0.1:9", "k", tmp_path / "eval")
    assert made == [12.5]

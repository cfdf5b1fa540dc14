"""reverse_text (examples/reverse_text) whose reward burns `cpu_ms` milliseconds of CPU per
rollout before it scores: a stand-in for a CPU-heavy verifier (a test suite, a parser, a
symbolic check), for benchmarks/env_workers.py. The same data, reward and metric otherwise."""

from __future__ import annotations

import time
from typing import Any

from reverse_text import exact_match, lcs_reward
from reverse_text import load_environment as load_reverse_text


def burn(cpu_ms: float) -> None:
    """Spin until this thread has used `cpu_ms` milliseconds of CPU (not wall time: a busy
    machine makes it longer, never shorter)."""
    end = time.thread_time() + cpu_ms / 1000.0
    while time.thread_time() < end:
        pass


def load_environment(cpu_ms: float = 50.0, **kwargs: Any) -> Any:
    import verifiers as vf

    env = load_reverse_text(**kwargs)

    def slow_lcs_reward(completion: Any, answer: str, parser: Any = None, **kw: Any) -> float:
        burn(cpu_ms)
        return lcs_reward(completion, answer, parser=parser, **kw)

    env.rubric = vf.Rubric(funcs=[slow_lcs_reward, exact_match], weights=[1.0, 0.0], parser=env.parser)
    return env

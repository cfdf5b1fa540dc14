"""The process limits every component raises when it starts (`raise_open_files`).

A component holds many descriptors at once: the orchestrator a connection per request in
flight (`orchestrator.max_concurrent`) and the environments' own, the router one per
request it forwards and one per server, a server its clients', a trainer rank its
checkpoint files and process-group sockets. The soft limit a node gives (1024 on many)
is often far below the hard one, and requests then fail with "Too many open files". Each
component's `main` raises the soft limit to the hard one first thing, and says so in one
line on stdout (with its log lines: stderr keeps its one-line errors); a limit that cannot
be raised is a warning line, never a failure.
"""

from __future__ import annotations

from typing import Optional


def raise_open_files(component: str) -> Optional[tuple[int, int]]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; one line on stdout,
    `<component>: open files limit <before> -> <after>`, or a warning line when it
    cannot be raised. Returns (before, after), None when the limit cannot be read."""
    try:
        import resource

        before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError) as e:
        _say(f"{component}: warning: the open files limit cannot be read ({type(e).__name__}: {e})")
        return None
    after = before
    if before != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            after = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except (OSError, ValueError) as e:
            _say(
                f"{component}: warning: the open files limit stays {_n(before)}: it cannot be raised to the "
                f"hard limit {_n(hard)} ({type(e).__name__}: {e}); many connections may fail (`ulimit -n`)"
            )
            return before, before
    _say(f"{component}: open files limit {_n(before)} -> {_n(after)} (the hard limit)")
    return before, after


def _n(limit: int) -> str:
    import resource

    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


def _say(line: str) -> None:
    print(line, flush=True)

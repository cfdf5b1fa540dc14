"""The few exceptions a user can cause. Each carries a one-line message that names
what is wrong and how to fix it; the CLI prints it and exits with `exit_code`."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


class UserError(Exception):
    """A mistake in what the user asked for. Printed as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class ConfigError(UserError):
    """An invalid config value or combination, naming the key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class JobNotFound(UserError):
    """A job reference (SLURM id, run name, output dir) matched nothing."""


def required(value: T | None, key: str) -> T:
    """`value`, which the config `key` must have set by now (validation, or the launcher's
    projection, fills it); a config written by hand without it is refused in one line."""
    if value is None:
        raise ConfigError(key, "is not set")
    return value


class LaunchError(Exception):
    """Submission or a job itself failed; the message names the log to read. Exit code 1."""

    exit_code = 1

"""`prime-hpc config export JOB [--out FILE]`: a run's recorded config (`<run>/config.yaml`)
as a TOML recipe in the reference's layout, which `prime-hpc submit @ FILE` composes back
to the same config (docs/configuration.md, recipes)."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any, cast


def add_parser(sub: Any) -> argparse.ArgumentParser:
    c = sub.add_parser("config", help="a run's recorded config as a recipe in the reference's TOML layout")
    actions = c.add_subparsers(dest="action", metavar="ACTION", required=True)
    e = actions.add_parser(
        "export",
        help="write the run's config.yaml as TOML in the reference's layout (submit @ FILE composes it back)",
    )
    e.add_argument("job", help="job id, run name or output dir (a run directory with config.yaml)")
    e.add_argument("-o", "--out", metavar="FILE", default=None, help="write it to FILE (default: standard output)")
    return c


def run_dir(target: str) -> Any:
    """The run `target` names: a directory with config.yaml (submitted or --dry-run), or
    what `status` takes (`jobs.resolve`)."""
    from prime_hpc.rundir import RunDir, jobs

    path = Path(target).expanduser()
    if path.is_dir() and RunDir(path).config_yaml.exists():
        return RunDir(path)
    return jobs.resolve(target).run


def read_own_config(run: Any) -> str:
    """The text of the run's config.yaml, read only when the run's directory and the file
    are the user's alone (checked on the opened descriptors); else `NotYours`, one line."""
    from prime_hpc.core import usercache
    from prime_hpc.core.errors import UserError
    from prime_hpc.rundir.jobs import NotYours, read_owned

    try:
        data = read_owned(run, run.config_yaml, missing_ok=True)
    except FileNotFoundError:
        raise UserError(f"{run.config_yaml}: no such file (the run's recorded config)") from None
    except usercache.Untrusted as e:
        raise NotYours(f"cannot export the config of {run.root}: {e}; export reads only runs of your own") from None
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise UserError(f"{run.config_yaml}: not UTF-8 text; not a config prime-hpc wrote") from None


def export_text(target: str) -> str:
    from omegaconf import OmegaConf

    from prime_hpc.config import toml_recipes
    from prime_hpc.config.compose import compose, recorded_config

    run = run_dir(target)
    stream = io.StringIO(read_own_config(run))
    stream.name = str(run.config_yaml)  # named in recorded_config's errors
    cfg = recorded_config(stream)  # an interpolation is refused in one line, naming the file and key
    data = cast(dict, OmegaConf.to_container(cfg, resolve=True))
    derived = warmup_model(run, data)
    sft = data["trainer"]["type"] == "sft"
    defaults = cast(dict, OmegaConf.to_container(compose(["trainer=sft"] if sft else []), resolve=True))
    header = (
        f"# the recorded config of {run.root} in the reference's TOML layout (prime-hpc config export);\n"
        f"# prime-hpc submit @ FILE composes it again. Left out: {', '.join(toml_recipes.NOT_EXPORTED)}\n"
        f"# (a new run: give name=... output_dir=... to choose)\n"
    )
    return header + toml_recipes.export(data, defaults, derived)


def warmup_model(run: Any, data: dict) -> frozenset[str]:
    """A run after a warm-up starts from the warm-up's weights (`<output_dir>/warmup`), which
    submit sets itself (`config.pipeline`): `model.name` becomes the warm-up's model (what the
    warm-up trains; its config.yaml), and the keys that hold the weights' path (`${model.name}`
    by default) are left out. Returns those keys."""
    from omegaconf import OmegaConf

    from prime_hpc.config import toml_recipes
    from prime_hpc.config.compose import recorded_config
    from prime_hpc.config.pipeline import WARMUP_DIR
    from prime_hpc.core.errors import UserError
    from prime_hpc.rundir import RunDir

    weights = str(Path(str(data.get("output_dir"))) / WARMUP_DIR)
    if not (data.get("warmup") or {}).get("experiment") or (data.get("model") or {}).get("name") != weights:
        return frozenset()
    warm = RunDir(Path(run.root) / WARMUP_DIR)
    stream = io.StringIO(read_own_config(warm))
    stream.name = str(warm.config_yaml)
    model = OmegaConf.select(recorded_config(stream), "model.name")
    if not isinstance(model, str):
        raise UserError(f"{warm.config_yaml}: model.name is not set; cannot say which model the warm-up trains")
    data["model"]["name"] = model
    return frozenset(k for k, v in toml_recipes.flat_leaves(data).items() if v == weights)


def run(a: argparse.Namespace) -> int:
    from prime_hpc.core.errors import UserError

    text = export_text(a.job)
    if a.out is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(a.out).write_text(text)
    except OSError as e:
        raise UserError(f"--out {a.out}: cannot write it ({e.strerror})") from None
    print(f"wrote {a.out}", file=sys.stderr)
    return 0

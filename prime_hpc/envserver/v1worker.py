"""One worker of a v1 env server: runs a verifiers v1 taskset's episodes for its server.

Runs under the env's own interpreter (verifiers >= 0.4; `config.env_kinds` picks it), with only
prime-hpc's own modules on its path: imports nothing of prime-hpc's stack, only the
standard library and verifiers. The same protocol as the classic `worker.py`: on stdin
one JSON request a line (`{"id", "index", "n", "model", "sampling", ...}`), on the stdout
it was started with one JSON answer a line: first `{"ready": true, "pid", "rows"}` (the
taskset's tasks: `example_id`, `index`, `prompt` as chat messages), then per request
`{"id", "episodes"}` (each `Episode.model_dump(mode="json")`) or `{"id", "error"}` (one
line: the env failed before any episode).

Each episode runs as verifiers runs it for training: the taskset's env (its own `Env`
class or verifiers' single-agent one), the plain chat harness (`chat.py`: verifiers'
`null` loop, tool calls included, in this process) in the local `subprocess` runtime,
the task set's tool servers started there once (`Taskset.toolsets`), model calls
through verifiers' train client (client-side rendering with the run's tokenizer and the
entry's `renderer`, whose tool parser reads a turn's tool calls; `POST
<base>/inference/v1/generate`, token ids and logprobs back) whose base is the server's
relay (`relay.py`; its token in `PRIME_HPC_RELAY_API_KEY`, the job's key never here). Nothing is fetched from an index: the chat program's packages
come from the wheelhouse beside the interpreter's venv (`<venv>/wheelhouse`, or
`$PRIME_HPC_WHEELHOUSE`), uv and Python are the venv's own, no Python download, no proxy
for loopback (`offline_environ`); a missing package fails the episode with uv's line
naming it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

from prime_hpc.envserver.channel import Channel, open_worker, serve_requests

TOKEN_VAR = "PRIME_HPC_RELAY_API_KEY"  # relay.TOKEN_VAR; verifiers keeps *API_KEY* names from programs
WHEELHOUSE_VAR = "PRIME_HPC_WHEELHOUSE"
RUNTIME = {"type": "subprocess"}  # on this node, no sandbox service


def wheelhouse() -> Path:
    return Path(os.environ.get(WHEELHOUSE_VAR) or Path(sys.prefix) / "wheelhouse")


def offline_environ(environ: dict) -> list[str]:
    """Set what the harness's program and uv inherit so that nothing is fetched at run
    time; the problems found (an empty list when none)."""
    problems = []
    house = wheelhouse()
    if not house.is_dir() or not any(house.glob("*.whl")):
        problems.append(
            f"no wheelhouse at {house} (the chat harness's packages; tools/setup builds it, "
            f"or set ${WHEELHOUSE_VAR}): nothing is fetched from an index at run time"
        )
    bindir = Path(sys.executable).parent
    if not (bindir / "uv").exists():
        problems.append(f"no uv in {bindir}: install it into the env's venv (pip install uv)")
    loopback = "127.0.0.1,localhost"
    environ.update(
        {
            "UV_DEFAULT_INDEX": house.as_uri(),  # uv's `sync --script` has no --no-index by variable
            "UV_INDEX_URL": house.as_uri(),
            "UV_FIND_LINKS": str(house),
            "UV_PYTHON": sys.executable,
            "UV_PYTHON_DOWNLOADS": "never",
            "UV_NO_PROGRESS": "1",
            "PATH": f"{bindir}{os.pathsep}{environ.get('PATH', '')}",  # the venv's uv, never a download of it
            "NO_PROXY": ",".join(x for x in (environ.get("NO_PROXY"), loopback) if x),
            "no_proxy": ",".join(x for x in (environ.get("no_proxy"), loopback) if x),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    return problems


def env_config(spec: dict) -> Any:
    """verifiers' env config of the entry: the taskset with the entry's args, each seat of
    its env (the taskset's own `Env`, else verifiers' single-agent one with its one
    `agent`) on the plain chat harness (`chat.py`: its loop in this process) in the
    subprocess runtime, the rest of a seat's defaults kept; one interception
    server on loopback. The id is resolved as the probe resolved it (`config.env_ids`: a
    path is imported from there), then handed to verifiers by module name; one only
    verifiers knows (a task set it ships) as it is."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type, resolve_env_config

    from prime_hpc.config.env_ids import UnknownEnv, import_env_module
    from prime_hpc.envserver import chat, transport

    # verifiers resolves a harness id as one of its own or a top-level module: the chat
    # harness is named to it by that name, in this process only
    sys.modules.setdefault(chat.HARNESS_ID, chat)
    transport.train_client_on_aiohttp()
    entry = spec["entry"]
    try:
        taskset_id = import_env_module(entry["id"]).__name__
    except UnknownEnv:
        taskset_id = entry["id"]
    seats = {}
    for name, f in env_config_type(taskset_id).model_fields.items():
        if isinstance(f.default, AgentConfig):
            kept = f.default.model_dump(exclude_unset=True, exclude={"harness", "runtime"})
            seats[name] = {**kept, "harness": {"id": chat.HARNESS_ID}, "runtime": dict(RUNTIME)}
    return resolve_env_config(
        {
            "taskset": {**dict(entry.get("args") or {}), "id": taskset_id},
            **seats,
            "interception": {"type": "server"},
        }
    )


def task_rows(tasks: list, limit: Optional[int]) -> list[dict]:
    """The tasks as the orchestrator samples them: `example_id`, `index`, `prompt`."""
    rows = []
    for i, task in enumerate(tasks[:limit] if limit else tasks):
        data = task.data
        prompt: Any = data.prompt
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        else:
            prompt = [m.model_dump(mode="json", exclude_none=True) if hasattr(m, "model_dump") else m for m in prompt]
        if getattr(data, "system_prompt", None):
            prompt = [{"role": "system", "content": str(data.system_prompt)}, *prompt]
        idx = getattr(data, "idx", None)  # its place in the taskset, as its episodes name it
        rows.append({"example_id": idx if idx is not None else data.id, "index": i, "prompt": prompt})
    return rows


def sampling(args: dict) -> dict:
    """The orchestrator's sampling arguments as v1's `SamplingConfig` takes them (what the
    train client asks for itself left out)."""
    out = {k: v for k, v in args.items() if k not in ("logprobs", "extra_body")}
    extra = {k: v for k, v in (args.get("extra_body") or {}).items() if k != "return_token_ids"}
    return {**extra, **out}


def renderer_config(entry: dict) -> Optional[dict]:
    """The entry's `renderer` as verifiers' train client takes it (None: resolved from the
    model). A `tool_parser` of the form `module:Class` is a parser class of the user's
    (renderers' protocol: `Class(tokenizer).extract(token_ids) -> (content_ids,
    tool_calls)`), imported here and registered with renderers under that name."""
    renderer = entry.get("renderer")
    if not renderer:
        return None
    parser = renderer.get("tool_parser")
    if isinstance(parser, str) and ":" in parser:
        import importlib

        from renderers import parsers

        module, _, attr = parser.partition(":")
        parsers.TOOL_PARSERS[parser] = getattr(importlib.import_module(module), attr)
    return dict(renderer)


def warm_renderer(path: str, config: Any) -> None:
    """Load the tokenizer and make the entry's renderer once: the train client's first call
    would (transformers and the tokenizer: seconds), and a renderer or parser that cannot
    be made fails the worker here, in one line, not every group."""
    from renderers import create_renderer
    from renderers.base import load_tokenizer

    tokenizer = load_tokenizer(path)
    if config.renderer is not None:
        create_renderer(tokenizer, config.renderer)


async def serve(spec: dict, channel: Channel) -> None:
    from verifiers.v1 import ModelContext, SamplingConfig, TrainClientConfig
    from verifiers.v1.utils.loaders import load_environment

    env = load_environment(env_config(spec))
    tasks = list(env.taskset)
    limit = spec.get("num_examples") if spec["kind"] == "eval" else None
    client = TrainClientConfig(
        base_url=f"{spec['relay_url']}/v1",
        api_key_var=TOKEN_VAR,
        renderer_model_name=spec["tokenizer"],
        renderer=renderer_config(spec["entry"]),
    )

    async def one(req: dict) -> None:
        try:
            task = tasks[int(req["index"])]
            ctx = ModelContext(model=req["model"], client=client, sampling=SamplingConfig(**sampling(req["sampling"])))
            slots = env.slots(task, int(req["n"]))
            episodes = await asyncio.gather(*(env.run_slot(s, ctx) for s in slots))
        except Exception as e:
            logging.getLogger("prime_hpc.v1worker").exception("the group failed")
            first = str(e).splitlines()[0] if str(e) else ""
            channel.answer({"id": req["id"], "error": f"{type(e).__name__}: {first}"})
            return
        channel.answer({"id": req["id"], "episodes": [ep.model_dump(mode="json") for ep in episodes]})

    # before the worker says it is ready, not in the first group's time
    await asyncio.to_thread(warm_renderer, spec["tokenizer"], client)
    async with env.serving():
        await serve_requests(channel, {"rows": task_rows(tasks, limit)}, one)


def main() -> None:
    spec, channel = open_worker("python -m prime_hpc.envserver.v1worker")
    problems = offline_environ(os.environ)  # type: ignore[arg-type]
    if problems:
        for line in problems:
            logging.error(line)
        sys.exit(2)
    asyncio.run(serve(spec, channel))


if __name__ == "__main__":
    main()

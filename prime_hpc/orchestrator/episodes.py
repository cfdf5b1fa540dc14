"""From verifiers v1 episodes to training samples: the `Rollout`s of `rollouts.py`, from an
`Episode` dumped as plain data (`episode.model_dump()`, the msgpack wire, or the JSON record
verifiers writes). Pure functions over dicts: verifiers 0.4 is never imported here (it runs
in the env server's own environment).

What a dumped episode holds (verifiers 0.4, `verifiers/v1/episode.py`, `trace.py`, `graph.py`):
- episode: `id`, `task` {type, data, key}, `run` {work: {step, policy: {start, end}}} (the
  policy versions the episode was generated under, stamped by the consumer), `ok`,
  `errors` [{type, message, status_code, traceback}] (the env's own hooks failed), `traces`;
- trace (one per agent): `agent` {name, trainable}, `nodes` (the message graph), `calls`
  [{node, finish_reason, error, usage}], `rewards` {name: {score, weight} | None},
  `metrics` {name: float | None}, `ok`, `stop_condition`, `errors`;
- node: `parent` (index of the previous message; absent or None at a root), `message`
  (role, content, tool_calls...), `sampled` (a model call produced it), `token_ids` (the
  tokens it adds to its path: scaffold, then for an assistant its sampled completion),
  `mask` (per token: sampled by the model), `logprobs` (one per sampled token),
  `semantic_parents` [{node, type}].

A trace's branches are not in the dump: each leaf node (no node's parent) ends one, the
path from its root; a branch is one training sample, its tokens the concatenation of its
nodes' `token_ids`. A branch ending in a compaction attempt the harness did not resume from
is not trained (as verifiers' `Trace.branches`). Branches share prefix nodes (the system
prompt, earlier turns) and a trace with one context has one branch.

Policy steps: the episode records only the span of policies it was generated under
(`run.work.policy`), not one per turn: a rollout's `policy_steps` are [start], or
[start, end] when an update landed mid-episode; none when the episode has no span (then it
counts as generated under policy 0, as a classic rollout whose server named no policy).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from prime_hpc.config.schema import TRAJECTORY_STRATEGIES
from prime_hpc.core.errors import UserError
from prime_hpc.orchestrator.rollouts import Branch, Rollout, chat_messages

# stop conditions that mean the episode was cut short (`Trace.is_truncated`)
TRUNCATING_STOPS = ("max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens", "compaction_failed")
NOT_EXTENDING = (
    "the trace's turns do not extend one another (its message graph has several branches); "
    "orchestrator.trajectory_strategy=branching trains such episodes"
)
NO_TOKENS = "no token ids in the episode (the env must use verifiers' train client, which returns token ids)"


def episode_rollouts(episode: dict, env: str, seq_len: int, strategy: str) -> list[Rollout]:
    """One dumped v1 episode → one Rollout per trainable trace (one per agent whose
    tokens train the policy; one in all for a single-agent env), or a single errored
    Rollout when the env itself failed before any trace.

    Per trace: the first trainable branch is the Rollout's own sequence, the others its
    `branches` (`branching`; under `interleaved` a trace of several branches is an error).
    `loss_mask` is the nodes' `mask`; `logprobs` the sampled tokens' logprobs, 0 elsewhere;
    a sequence longer than `seq_len` is cut and the rollout marked truncated, as is one the
    env stopped at a limit or whose last answer ended at its length limit. `reward` is the
    weighted sum of the trace's rewards, `metrics` each reward's score and each metric.
    An episode or trace error becomes the rollout's one-line `error`.
    Raises UserError (one line, naming the field) for a malformed episode."""
    if strategy not in TRAJECTORY_STRATEGIES:
        raise ValueError(f"unknown trajectory strategy {strategy!r}; choose from {', '.join(TRAJECTORY_STRATEGIES)}")
    if not isinstance(episode, dict):
        raise UserError(f"a v1 episode must be an object, got {type(episode).__name__}")
    where = f"v1 episode {episode.get('id') or '(no id)'}"
    traces = _field(episode, "traces", list, where)
    env_error = _error_line(_field(episode, "errors", list, where, []))
    steps = _policy_steps(episode, where)
    example_id = _example_id(episode)
    out = []
    for i, trace in enumerate(traces):
        if not isinstance(trace, dict):
            raise UserError(f"{where}: traces[{i}] must be an object, got {type(trace).__name__}")
        agent = trace.get("agent") or {}
        if isinstance(agent, dict) and agent.get("trainable") is False:
            continue
        r = _trace_rollout(trace, f"{where} traces[{i}]", env, seq_len, strategy)
        r.example_id, r.policy_steps = example_id, list(steps)
        r.error = env_error or r.error
        out.append(r)
    if not out:  # the env failed before any agent ran, or ran none that trains
        error = env_error or "the episode has no trainable trace"
        out.append(
            Rollout(
                env=env,
                example_id=example_id,
                reward=0.0,
                input_ids=[],
                loss_mask=[],
                logprobs=[],
                policy_steps=list(steps),
                num_turns=0,
                is_truncated=False,
                error=error,
                empty=True,
            )
        )
    return out


def _trace_rollout(trace: dict, where: str, env: str, seq_len: int, strategy: str) -> Rollout:
    """One trace → a Rollout (example_id and policy steps set by the caller)."""
    nodes = _nodes(trace, where)
    paths = [p for p, trainable in _branches(nodes) if trainable]
    seqs = [_sequence(nodes, p) for p in paths]
    error = _error_line(_field(trace, "errors", list, where, []))
    if error is None and trace.get("ok") is False:
        error = f"the trace failed (stop condition {trace.get('stop_condition')!r})"
    turns = sum(1 for n in nodes if n.get("sampled"))
    if turns and not any(n["token_ids"] for n in nodes if n.get("sampled")) and error is None:
        error = NO_TOKENS
    if len(seqs) > 1 and strategy == "interleaved":
        error, seqs = error or NOT_EXTENDING, seqs[:1]
    truncated = _is_truncated(trace)
    for b in seqs:
        if len(b.input_ids) > seq_len:
            b.input_ids, b.loss_mask, b.logprobs = b.input_ids[:seq_len], b.loss_mask[:seq_len], b.logprobs[:seq_len]
            truncated = True
    rewards = _field(trace, "rewards", dict, where, {})
    reward, metrics = 0.0, {}
    for name, value in rewards.items():
        if value is None:  # scoring did not run
            continue
        if not isinstance(value, dict) or "score" not in value:
            raise UserError(f"{where}: rewards[{name!r}] must be {{score, weight}}, got {value!r}")
        score = float(value["score"])
        reward += score * float(value.get("weight", 1.0))
        metrics[str(name)] = score
    for name, value in _field(trace, "metrics", dict, where, {}).items():
        if isinstance(value, (int, float)):
            metrics[str(name)] = float(value)
    if not math.isfinite(reward) and error is None:  # never into an advantage: the loss would be NaN
        error, reward = f"the environment's reward is {reward} (its rewards must be finite numbers)", 0.0
    first = seqs[0] if seqs else Branch()
    messages = [nodes[i]["message"] for i in paths[-1]] if paths else []
    r = Rollout(
        env=env,
        example_id=None,
        reward=reward,
        input_ids=first.input_ids,
        loss_mask=first.loss_mask,
        logprobs=first.logprobs,
        policy_steps=[],
        num_turns=turns,
        is_truncated=truncated,
        error=error,
        branches=seqs[1:],
        prompt_text=_prompt_text(nodes, paths[0] if paths else []),
        completion_text="\n".join(_content(n["message"]) for n in nodes if n.get("sampled")),
        metrics=metrics,
        messages=chat_messages([_chat_message(m) for m in messages]),
    )
    r.empty = r.completion_tokens == 0
    return r


def _field(obj: dict, key: str, kind: type, where: str, default: Any = ...) -> Any:
    """obj[key], which must be a `kind` (absent or None: `default`, or refused without one)."""
    value = obj.get(key)
    if value is None:
        if default is ...:
            raise UserError(f"{where} has no {key!r} (a dumped verifiers v1 Episode has it)")
        return default
    if not isinstance(value, kind):
        raise UserError(f"{where}: {key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _nodes(trace: dict, where: str) -> list[dict]:
    """The trace's message nodes, checked: token-aligned masks, one logprob per sampled
    token, and each parent an earlier node (so every path ends at a root)."""
    nodes = _field(trace, "nodes", list, where)
    for i, n in enumerate(nodes):
        at = f"{where} nodes[{i}]"
        if not isinstance(n, dict):
            raise UserError(f"{at} must be an object, got {type(n).__name__}")
        ids, mask = _field(n, "token_ids", list, at), _field(n, "mask", list, at)
        if len(mask) != len(ids):
            raise UserError(f"{at}: 'mask' has {len(mask)} entries for {len(ids)} token_ids")
        sampled = sum(bool(m) for m in mask)
        logprobs = _field(n, "logprobs", list, at, [])
        if len(logprobs) != sampled:
            raise UserError(f"{at}: 'logprobs' has {len(logprobs)} entries for {sampled} sampled tokens")
        parent = n.get("parent")
        if parent is not None and not (isinstance(parent, int) and 0 <= parent < i):
            raise UserError(f"{at}: 'parent' must be the index of an earlier node, got {parent!r}")
        _field(n, "message", dict, at)
    return nodes


def _branches(nodes: list[dict]) -> list[tuple[list[int], bool]]:
    """Each leaf's root-to-leaf node path, in leaf order, with whether it trains (not a
    compaction attempt, unless a later node says the harness resumed from it)."""
    parents = {n.get("parent") for n in nodes if n.get("parent") is not None}
    resumed = {
        link.get("node")
        for n in nodes
        for link in n.get("semantic_parents") or []
        if isinstance(link, dict) and link.get("type") == "compaction"
    }
    out = []
    for leaf in (i for i in range(len(nodes)) if i not in parents):
        path: list[int] = []
        at: Optional[int] = leaf
        while at is not None:
            path.append(at)
            at = nodes[at].get("parent")
        attempt = any(
            isinstance(link, dict) and link.get("type") == "compaction_attempt"
            for link in nodes[leaf].get("semantic_parents") or []
        )
        out.append((path[::-1], not attempt or leaf in resumed))
    return out


def _sequence(nodes: list[dict], path: list[int]) -> Branch:
    """A branch's tokens, loss mask, and logprobs on its sampled tokens (0 elsewhere)."""
    b = Branch()
    for i in path:
        n = nodes[i]
        lps = iter(n.get("logprobs") or [])
        b.input_ids += [int(t) for t in n["token_ids"]]
        b.loss_mask += [bool(m) for m in n["mask"]]
        b.logprobs += [float(next(lps)) if m else 0.0 for m in n["mask"]]
    return b


def _is_truncated(trace: dict) -> bool:
    """The env stopped the trace at a limit, or its last answered call ended at its length."""
    if trace.get("stop_condition") in TRUNCATING_STOPS:
        return True
    answered = [c for c in trace.get("calls") or [] if isinstance(c, dict) and not c.get("error")]
    return bool(answered) and answered[-1].get("finish_reason") == "length"


def _error_line(errors: list) -> Optional[str]:
    """The last recorded error as one line: `Type: message` (its first line)."""
    if not errors:
        return None
    e = errors[-1]
    if not isinstance(e, dict):
        return str(e).splitlines()[0] if str(e) else "error"
    message = str(e.get("message") or "").strip().splitlines()
    kind = str(e.get("type") or "Error")
    return f"{kind}: {message[0]}" if message else kind


def episode_sessions(episode: dict) -> list[str]:
    """The session ids of an episode's model calls: its traces' ids (verifiers' train
    client sends each call with `X-Session-ID: <trace id>`)."""
    return [str(t["id"]) for t in episode.get("traces") or [] if isinstance(t, dict) and t.get("id")]


def stamp_policy(episode: dict, start: int, end: int) -> None:
    """Record in `episode` (`run.work.policy`) the span of policies it was generated under,
    as a training consumer stamps it."""
    run: dict = episode["run"] if isinstance(episode.get("run"), dict) else {}
    work: dict = run["work"] if isinstance(run.get("work"), dict) else {}
    work["policy"] = {"start": int(start), "end": int(end)}
    run["work"] = work
    episode["run"] = run


def _policy_steps(episode: dict, where: str) -> list[int]:
    run = episode.get("run") or {}
    policy = ((run.get("work") or {}).get("policy") if isinstance(run, dict) else None) or {}
    if not policy:
        return []
    try:
        start, end = int(policy["start"]), int(policy["end"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{where}: run.work.policy must be {{start, end}}, got {policy!r}") from None
    return [start] if end == start else [start, end]


def _example_id(episode: dict) -> Any:
    """The task's index in its taskset, else its key."""
    task = episode.get("task") or {}
    data = task.get("data") or {}
    idx = data.get("idx") if isinstance(data, dict) else None
    return idx if idx is not None else task.get("key")


def _content(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _prompt_text(nodes: list[dict], path: list[int]) -> str:
    """The last message before the first model answer on the path."""
    first = next((k for k, i in enumerate(path) if nodes[i].get("sampled")), len(path))
    before = path[:first]
    return _content(nodes[before[-1]]["message"]) if before else ""


def _chat_message(message: dict) -> dict:
    """A v1 message as a chat-template message: its tool calls ({id, type, name, arguments})
    in the OpenAI form ({id, type, function: {name, arguments}})."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    wire = [
        {"id": c.get("id"), "type": "function", "function": {"name": c.get("name"), "arguments": c.get("arguments")}}
        for c in calls
        if isinstance(c, dict)
    ]
    return {**message, "tool_calls": wire}

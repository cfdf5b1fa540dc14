"""Inference without vLLM: the config → vLLM arguments and engine environment, and the
policy gate and API key, driven through the ASGI layer directly."""

from __future__ import annotations

import asyncio
import base64
import json
import os

import pytest

from prime_hpc.inference import server as srv
from prime_hpc.inference.gate import GateMiddleware, PolicyGate, UpdateTimeout

# --------------------------------------------------------------------------- unit: config → vLLM


def _typed(d: dict):
    from prime_hpc.config.component import InferenceRunConfig, typed

    return typed(InferenceRunConfig, d, "test")


def _cfg(**inf):
    base = {
        "model": {"name": "tiny"},
        "dtype": "auto",
        "max_model_len": 128,
        "gpu_memory_utilization": 0.2,
        "tensor_parallel_size": 1,
        "data_parallel_size": None,
        "cpu_kvcache_space_gb": 3,
        "cpu_threads": None,
        "extra_args": [],
        "startup_timeout_s": 60,
    }
    base.update(inf)
    return {
        "name": "r",
        "output_dir": "/tmp/x",
        "seed": 7,
        "seq_len": 128,
        "address": None,
        "model": {"name": "tiny", "seed": 0},
        "device": "cpu",
        "nodes": 1,
        "inference_job": "het",
        "gpus_per_node": 0,
        "lora": {"enabled": False, "rank": 8},
        "inference": base,
    }


def _opt(argv, flag):
    return argv[argv.index(flag) + 1]


def test_vllm_args_pass_the_reference_knobs_through():
    cfg = _cfg(
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.5,
        tensor_parallel_size=2,
        data_parallel_size=4,
        extra_args=["--enforce-eager", "--max-num-seqs", "64"],
        model={
            "name": "tiny",
            "enable_auto_tool_choice": True,
            "tool_call_parser": "hermes",
            "reasoning_parser": "qwen3",
        },
    )
    argv = srv.vllm_args(_typed(cfg), "/models/tiny", "10.0.0.5")
    assert _opt(argv, "--model") == "/models/tiny"
    assert _opt(argv, "--served-model-name") == "tiny"
    assert _opt(argv, "--host") == "10.0.0.5" and _opt(argv, "--port") == "0"
    assert _opt(argv, "--dtype") == "bfloat16"
    assert _opt(argv, "--max-model-len") == "4096"
    assert _opt(argv, "--gpu-memory-utilization") == "0.5"
    assert _opt(argv, "--tensor-parallel-size") == "2"
    assert _opt(argv, "--data-parallel-size") == "4"
    assert "--enable-auto-tool-choice" in argv
    assert _opt(argv, "--tool-call-parser") == "hermes"
    assert _opt(argv, "--reasoning-parser") == "qwen3"
    assert _opt(argv, "--seed") == "7"
    assert _opt(argv, "--logprobs-mode") == "processed_logprobs"
    assert argv[-3:] == ["--enforce-eager", "--max-num-seqs", "64"]
    assert "--enable-lora" not in argv


def test_data_parallel_defaults_to_the_node_gpus_and_lora_enables_adapters():
    cfg = _cfg(tensor_parallel_size=2)
    cfg.update(device="cuda", gpus_per_node=8, lora={"enabled": True, "rank": 32})
    argv = srv.vllm_args(_typed(cfg), "m", "h")
    assert _opt(argv, "--data-parallel-size") == "4"
    assert _opt(argv, "--max-lora-rank") == "32" and "--enable-lora" in argv
    cpu = srv.vllm_args(_typed(_cfg()), "m", "h")
    assert "--data-parallel-size" not in cpu and "--tool-call-parser" not in cpu


def test_the_device_picks_the_weight_transfer_backend():
    from prime_hpc.core import device

    assert device.weight_transfer_backend("cpu") == "gloo" == device.dist_backend("cpu")
    assert device.weight_transfer_backend("cuda") == "nccl" == device.dist_backend("cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        device.weight_transfer_backend("tpu")


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "nccl")])
def test_a_broadcast_server_starts_vllm_with_its_devices_weight_transfer_backend(device, backend):
    cfg = _cfg()
    cfg.update(device=device, weights={"transport": "broadcast"})
    argv = srv.vllm_args(_typed(cfg), "m", "h")
    assert json.loads(_opt(argv, "--weight-transfer-config")) == {"backend": backend}
    assert "--weight-transfer-config" not in srv.vllm_args(_typed(_cfg()), "m", "h")  # filesystem, the default


def test_the_inference_config_carries_the_weights_transport():
    from prime_hpc.config.component import component_config
    from prime_hpc.config.compose import compose

    for transport in ("filesystem", "broadcast"):
        cfg = compose(["+experiment=reverse_text", "output_dir=/tmp/x", f"weights.transport={transport}"])
        assert component_config(cfg, "inference")["weights"] == {"transport": transport}
    assert compose(["+experiment=reverse_text", "output_dir=/tmp/x"]).weights.transport == "filesystem"


JOIN = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2, "rank_offset": 1}


@pytest.mark.parametrize(
    "body, problem",
    [
        ({**JOIN, "master_address": ""}, "master_address"),
        ({**JOIN, "master_port": 0}, "master_port"),
        ({**JOIN, "master_port": "29500"}, "master_port"),
        ({**JOIN, "world_size": 1}, "world_size"),
        ({**JOIN, "rank_offset": 0}, "rank_offset"),
        ({**JOIN, "timeout_s": -1}, "timeout_s"),
    ],
)
def test_a_bad_join_names_the_field(body, problem):
    info, why = srv.join_info(body, 1, "gloo")
    assert why is not None and problem in why and "\n" not in why


def test_a_join_gives_the_workers_their_place_and_gloo_its_timeout():
    info, why = srv.join_info({**JOIN, "timeout_s": 30}, 1, "gloo")
    assert why is None and info == {**JOIN, "timeout_s": 30.0}
    assert srv.join_info({**JOIN, "world_size": 4}, 4, "gloo")[1] is not None  # 1 + 4 ranks do not fit in 4


UID = base64.b64encode(bytes(range(128))).decode()


def test_a_gpu_server_joins_only_by_the_senders_nccl_unique_id():
    """vLLM's NCCL engine on GPU servers: the join carries the unique id the sender minted
    (128 bytes, base64) and the workers' place, and nothing of a TCP store, which anyone
    who reaches its port could join."""
    body = {"nccl_unique_id_b64": UID, "world_size": 5, "rank_offset": 1, "timeout_s": 30}
    info, why = srv.join_info(body, 4, "nccl")  # vLLM's NCCL engine takes no timeout
    assert why is None and info == {"nccl_unique_id_b64": UID, "world_size": 5, "rank_offset": 1}
    for bad, problem in [
        ({**body, "master_address": "127.0.0.1", "master_port": 29500}, "not a TCP store"),
        ({k: v for k, v in body.items() if k != "nccl_unique_id_b64"}, "nccl_unique_id_b64"),
        ({**body, "nccl_unique_id_b64": base64.b64encode(bytes(64)).decode()}, "128 bytes"),
        ({**body, "nccl_unique_id_b64": "not base64!"}, "128 bytes"),
        ({**body, "world_size": 4}, "world_size"),
    ]:
        info, why = srv.join_info(bad, 4, "nccl")
        assert why is not None and problem in why and "\n" not in why, (bad, why)


RECEIVE = {
    "step": 3,
    "names": ["a.weight", "b"],
    "dtype_names": ["float32", "bfloat16"],
    "shapes": [[2, 3], []],
    "digests": ["0" * 64, "f" * 64],
}


@pytest.mark.parametrize(
    "body, problem",
    [
        ({**RECEIVE, "step": -1}, "step"),
        ({**RECEIVE, "step": True}, "step"),
        ({k: v for k, v in RECEIVE.items() if k != "shapes"}, "shapes"),
        ({**RECEIVE, "names": ["a.weight"]}, "length"),
        ({**RECEIVE, "dtype_names": ["float32", "float33"]}, "float33"),
        ({**RECEIVE, "dtype_names": ["float32", "Tensor"]}, "Tensor"),
        ({**RECEIVE, "shapes": [[2, -3], []]}, "shapes"),
        ({k: v for k, v in RECEIVE.items() if k != "digests"}, "digests"),  # gloo: never without them
        ({**RECEIVE, "digests": ["0" * 64]}, "digests"),
        ({**RECEIVE, "digests": ["0" * 64, "sha256:x"]}, "digests"),
    ],
)
def test_a_bad_receive_names_the_field(body, problem):
    step, info, why = srv.receive_info(body)
    assert why is not None and problem in why and "\n" not in why


def test_a_receive_announces_the_tensors_in_order():
    step, info, why = srv.receive_info(RECEIVE)
    assert why is None and step == 3 and info == {k: v for k, v in RECEIVE.items() if k != "step"}


def test_the_plugin_and_the_sender_import_no_vllm():
    """The trainer imports the sender; vLLM imports the plugin in each of its processes."""
    import subprocess
    import sys

    code = (
        "import sys, prime_hpc.inference.vllm_plugin, prime_hpc.inference.broadcast; "
        "print(sorted(m for m in ('vllm', 'torch', 'httpx') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_server_started_without_broadcast_refuses_the_weight_group_in_one_line(tmp_path):
    cfg = _cfg()
    cfg["output_dir"] = str(tmp_path)
    server = srv.Server(_typed(cfg), "m", "127.0.0.1")
    for answer in (
        asyncio.run(server.join_weights(JOIN)),
        asyncio.run(server.receive_weights(RECEIVE)),
        asyncio.run(server.leave_weights()),
    ):
        error = json.loads(answer.body)["error"]
        assert answer.status_code == 409 and "weights.transport=broadcast" in error and "\n" not in error
    cfg["weights"] = {"transport": "broadcast"}
    server = srv.Server(_typed(cfg), "m", "127.0.0.1")
    answer = asyncio.run(server.receive_weights(RECEIVE))  # before any join
    assert answer.status_code == 409 and "POST /weights/join first" in json.loads(answer.body)["error"]
    server.tied_on_cpu = True
    answer = asyncio.run(server.join_weights(JOIN))
    assert answer.status_code == 409 and json.loads(answer.body)["error"] == srv.TIED_ON_CPU


def test_engine_env_on_cpu_comes_from_the_config_or_slurm(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    env = srv.engine_env(_typed(_cfg(cpu_kvcache_space_gb=3, cpu_threads=6)))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["OMP_NUM_THREADS"] == "6"
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert "OMP_NUM_THREADS" not in srv.engine_env(_typed(_cfg()))
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    assert srv.engine_env(_typed(_cfg()))["OMP_NUM_THREADS"] == "4"
    gpu = _cfg()
    gpu["device"] = "cuda"
    assert "VLLM_CPU_KVCACHE_SPACE" not in srv.engine_env(_typed(gpu))
    # pinned by the launcher: the engine's threads bind to exactly those cores
    monkeypatch.setenv("PRIME_HPC_CPUS", "1,3")
    env = srv.engine_env(_typed(_cfg()))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1,3" and env["OMP_NUM_THREADS"] == "2"
    # the compile cache lives in the user's private directory of the run's shared cache,
    # where a second start finds it
    shared = tmp_path / "shared"
    private = shared / f"compile-{os.getuid()}"
    monkeypatch.setenv("PRIME_HPC_CACHE", str(shared))
    assert srv.engine_env(_typed(_cfg()))["VLLM_CACHE_ROOT"] == str(private / "vllm")
    assert srv.engine_env(_typed(gpu))["VLLM_CACHE_ROOT"] == str(private / "vllm")
    # and so do inductor's compiled graphs (not a node-local /tmp/torchinductor_<user>)
    assert srv.engine_env(_typed(_cfg()))["TORCHINDUCTOR_CACHE_DIR"] == str(private / "inductor")
    assert srv.engine_env(_typed(gpu))["TORCHINDUCTOR_CACHE_DIR"] == str(private / "inductor")
    assert private.stat().st_uid == os.getuid() and private.stat().st_mode & 0o777 == 0o700


def test_a_server_has_a_temporary_directory_of_its_own_and_clears_those_a_kill_left(tmp_path, monkeypatch):
    """vLLM leaves sockets and files in the node's temporary directory: a server gives its
    processes a 0700 one of its own inside it (`$TMPDIR`), and a start removes this user's
    directories whose server is gone, and nothing else. Inductor's cache stays the node's,
    linked from it, and outlives it."""
    import subprocess
    import sys

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(srv.tempfile, "tempdir", None)  # tempfile caches the directory it chose
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{srv.TMP_DIR_PREFIX}{gone.stdout.strip()}.abc"
    live = tmp_path / f"{srv.TMP_DIR_PREFIX}{os.getppid()}.def"  # its server runs
    theirs = tmp_path / f"{srv.TMP_DIR_PREFIX}{gone.stdout.strip()}.ghi"  # another user's
    stray = tmp_path / "0b7c9e2a-uuid"  # not ours to judge
    for d in (dead, live, theirs, stray):
        d.mkdir()
        (d / "left").write_text("")
    os.chown(theirs, 65534, 65534)
    inductor = tmp_path / "torchinductor_me"
    mine = srv.private_tmp_dir(shared=[inductor])
    assert mine.parent == tmp_path and mine.name.startswith(f"{srv.TMP_DIR_PREFIX}{os.getpid()}.")
    assert mine.stat().st_mode & 0o777 == 0o700
    assert not dead.exists() and live.exists() and theirs.exists() and stray.exists()
    (mine / inductor.name / "precompiled_headers").mkdir()  # as torch would, under the private directory
    srv.shutil.rmtree(mine)  # as the server does at its end
    assert (inductor / "precompiled_headers").is_dir()


def test_step_is_read_from_the_weights_dir():
    assert srv.step_of("/run/weights/step_12") == 12
    assert srv.step_of("/run/weights/step_3/") == 3
    assert srv.step_of("/models/qwen") is None


# --------------------------------------------------------------------------- unit: the gate


class FakeModel:
    """An ASGI app standing in for vLLM: a generation takes until its event is set."""

    def __init__(self):
        self.release: dict[str, asyncio.Event] = {}
        self.bodies: dict[str, dict] = {}  # each request's body as the model got it, by name

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        got = json.loads(body or b"{}")
        name = got.get("name", "")
        self.bodies[name] = {**got, "content-length": dict(scope["headers"]).get(b"content-length")}
        if scope["path"].startswith("/v1/"):
            ev = self.release.setdefault(name, asyncio.Event())
            await ev.wait()
        if scope["path"] == "/v1/stream":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        out = json.dumps({"name": name}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": out})


KEY = "unit-key"
AUTH = ((b"authorization", b"Bearer " + KEY.encode()),)


def _gated(step=0, api_key=KEY):
    """A fake model behind the gate: (model, gate, app)."""
    model = FakeModel()
    gate = PolicyGate(step=step)
    return model, gate, GateMiddleware(model, gate, api_key=api_key)


async def _call(app, path, body=None, headers=AUTH, method="POST", query=b""):
    raw = json.dumps(body or {}).encode()
    sent = []
    done = False

    async def receive():
        nonlocal done
        if done:
            await asyncio.sleep(3600)
        done = True
        return {"type": "http.request", "body": raw}

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": method, "path": path, "query_string": query, "headers": list(headers)}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    hdrs = {k.decode(): v.decode() for k, v in start["headers"]}
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    if "content-length" in hdrs:
        assert int(hdrs["content-length"]) == len(content)
    return start["status"], hdrs, content


def test_api_key_guards_every_route_but_health():
    async def main():
        model, _, app = _gated(api_key="s3cret")
        for e in ("a", "b"):
            model.release.setdefault(e, asyncio.Event()).set()
        assert (await _call(app, "/v1/chat/completions", {"name": "a"}, headers=()))[0] == 401
        assert (await _call(app, "/update_weights", headers=()))[0] == 401
        assert (await _call(app, "/pause", headers=()))[0] == 401
        wrong = [(b"authorization", b"Bearer nope")]
        assert (await _call(app, "/v1/chat/completions", {"name": "a"}, wrong))[0] == 401
        ok = [(b"authorization", b"Bearer s3cret")]
        assert (await _call(app, "/v1/chat/completions", {"name": "b"}, ok))[0] == 200
        assert (await _call(app, "/health", method="GET", headers=()))[0] == 200
        # OPTIONS is a request like any other, unless it is a browser's CORS preflight
        assert (await _call(app, "/update_weights", method="OPTIONS", headers=()))[0] == 401
        preflight = [(b"origin", b"http://x"), (b"access-control-request-method", b"POST")]
        assert (await _call(app, "/pause", method="OPTIONS", headers=preflight))[0] == 200

    asyncio.run(main())


def test_a_server_proves_the_key_without_it_being_sent_and_takes_only_requests_signed_for_itself():
    """The identity challenge (`GET /identity?nonce=`, open) is answered with an HMAC bound
    to the nonce, the server's URL, instance and pid: only a holder of the key gives it, and
    the key is not in it. A request signed for this instance (method, path, query, body) is
    served, with the server's proof on its answer; one signed for another instance, or with
    any part changed, is refused like a wrong key."""
    from prime_hpc.inference.gate import PROOF_HEADER, Proofs, signature_header

    me = {"url": "http://127.0.0.1:5", "instance": "i-one", "pid": 7, "slot": "inference_0"}
    known: dict = {}
    model, gate = FakeModel(), PolicyGate()
    app = GateMiddleware(model, gate, api_key=KEY, identity=lambda: known or None)
    proofs, other = Proofs(KEY), Proofs(KEY + "-not")
    nonce = "ab" * 16

    def signed(instance, path="/update_weights", body=b'{"name": "u"}', query="", method="POST"):
        token = proofs.signature(instance, method, path, query, body)
        return token, [(b"authorization", signature_header(token).encode())]

    async def main():
        q = f"nonce={nonce}".encode()
        assert (await _call(app, "/identity", method="GET", headers=(), query=q))[0] == 503  # no port yet
        known.update(me)
        status, _, content = await _call(app, "/identity", method="GET", headers=(), query=q)
        answer = json.loads(content)
        assert status == 200 and answer["instance"] == "i-one" and answer["url"] == me["url"]
        assert (
            answer["proof"]
            == proofs.identity(nonce, me["url"], "i-one", 7)
            != other.identity(nonce, me["url"], "i-one", 7)
        )
        assert answer["proof"] != proofs.identity(nonce, "http://127.0.0.1:6", "i-one", 7)  # bound to its URL
        assert KEY.encode() not in content
        for bad in (b"", b"nonce=xyz", b"nonce=" + b"a" * 31):
            assert (await _call(app, "/identity", method="GET", headers=(), query=bad))[0] == 400
        # signed for this instance: served, and answered with its proof
        token, auth = signed("i-one")
        status, hdrs, _ = await _call(app, "/update_weights", {"name": "u"}, auth)
        assert status == 200 and hdrs[PROOF_HEADER] == proofs.answer(token)
        model.release.setdefault("g", asyncio.Event()).set()
        token, auth = signed("i-one", "/v1/chat/completions", json.dumps({"name": "g"}).encode())
        status, hdrs, _ = await _call(app, "/v1/chat/completions", {"name": "g"}, auth)
        assert status == 200 and hdrs[PROOF_HEADER] == proofs.answer(token) and gate.served == 1
        # signed for another instance (a server that died at this address), or altered: refused
        for auth in (
            signed("i-two")[1],
            signed("i-one", "/reload_weights")[1],
            signed("i-one", body=b'{"name": "v"}')[1],
            signed("i-one", query="x=1")[1],
            signed("i-one", method="PUT")[1],
            [
                (
                    b"authorization",
                    signature_header(other.signature("i-one", "POST", "/update_weights", "", b"")).encode(),
                )
            ],
        ):
            status, hdrs, _ = await _call(app, "/update_weights", {"name": "u"}, auth)
            assert status == 401 and PROOF_HEADER not in hdrs
        assert set(model.bodies) == {"u", "g"}

    asyncio.run(main())


@pytest.mark.parametrize("key", [None, ""])
def test_there_is_no_open_mode_a_gate_without_a_key_refuses_to_exist(key):
    from prime_hpc.inference.gate import MissingKey

    with pytest.raises(MissingKey):
        GateMiddleware(FakeModel(), PolicyGate(), api_key=key)


def test_the_gate_counts_progress_only_while_generations_finish():
    """The server's heartbeat `progress_at`: an idle server, or one finishing generations,
    is progressing; one whose requests sit in the engine is not (a hung engine)."""

    async def main():
        model, gate, app = _gated()
        model.release["slow"] = asyncio.Event()
        idle_since = gate.progress_at
        await asyncio.sleep(0.05)
        slow = asyncio.create_task(_call(app, "/v1/chat/completions", {"name": "slow"}))
        await asyncio.sleep(0.05)
        started = gate.progress_at
        assert gate.active == 1 and started > idle_since  # the idle time before it is no stall
        await asyncio.sleep(0.05)
        assert gate.progress_at == started  # nothing finished while it hangs
        model.release["slow"].set()
        await slow
        assert gate.active == 0 and gate.progress_at > started and not gate.busy
        # an update under way is work too: a reload that hangs makes no progress either
        async with gate.exclusive(5):
            assert gate.busy and gate.update_under_way  # the heartbeat's `updating`
            updating = gate.progress_at
            await asyncio.sleep(0.05)
            assert gate.progress_at == updating
        assert gate.progress_at > updating and not gate.busy and not gate.update_under_way

    asyncio.run(main())


def test_completions_carry_the_policy_step_that_produced_them():
    async def main():
        model, gate, app = _gated(step=4)
        model.release.setdefault("x", asyncio.Event()).set()
        status, hdrs, body = await _call(app, "/v1/completions", {"name": "x"})
        assert status == 200 and hdrs["x-policy-step"] == "4"
        assert json.loads(body) == {"name": "x", "policy_step": 4, "policy_step_end": 4}
        model.release.setdefault("s", asyncio.Event()).set()
        status, hdrs, body = await _call(app, "/v1/stream", {"name": "s"})  # not a generation path: untouched
        assert "x-policy-step" not in hdrs

    asyncio.run(main())


def test_an_update_waits_for_in_flight_generations_and_holds_back_new_ones():
    async def main():
        model, gate, app = _gated(step=0)
        for n in ("old1", "old2", "new"):
            model.release[n] = asyncio.Event()
        old1 = asyncio.create_task(_call(app, "/v1/chat/completions", {"name": "old1"}))
        old2 = asyncio.create_task(_call(app, "/v1/chat/completions", {"name": "old2"}))
        await asyncio.sleep(0.05)
        assert gate.active == 2
        updated = asyncio.Event()

        async def update():
            async with gate.exclusive(timeout_s=30):
                gate.step = 1
            updated.set()

        upd = asyncio.create_task(update())
        await asyncio.sleep(0.05)
        new = asyncio.create_task(_call(app, "/v1/chat/completions", {"name": "new"}))
        model.release["new"].set()  # would finish at once if it were admitted
        await asyncio.sleep(0.05)
        assert not updated.is_set() and not new.done()  # update waits for old1/old2; new waits for the update
        model.release["old1"].set()
        await asyncio.sleep(0.05)
        assert not updated.is_set()
        model.release["old2"].set()
        r_old1, r_old2, r_new = await old1, await old2, await new
        assert updated.is_set()
        assert [json.loads(r[2])["policy_step"] for r in (r_old1, r_old2, r_new)] == [0, 0, 1]
        await upd

    asyncio.run(main())


def test_an_update_in_flight_keeps_running_requests_and_stamps_the_policies_they_span():
    """`inference.weight_update=in_flight`: an update neither waits for the requests in
    flight nor holds new ones back; a request that spans it carries both policies, one
    admitted after it only the new one, and updates never overlap each other."""

    async def main():
        model, gate, app = _gated(step=3)
        for n in ("spans", "after"):
            model.release[n] = asyncio.Event()
        spans = asyncio.create_task(_call(app, "/v1/chat/completions", {"name": "spans"}))
        await asyncio.sleep(0.05)
        order = []

        async def update(step):
            async with gate.updating():
                assert gate.busy and gate.update_under_way
                order.append(f"start {step}")
                await asyncio.sleep(0.05)
                gate.step = step
                order.append(f"end {step}")

        await asyncio.gather(update(4), update(5))
        assert order == ["start 4", "end 4", "start 5", "end 5"]  # one at a time
        assert gate.active == 1 and not spans.done()  # not waited for
        after = asyncio.create_task(_call(app, "/v1/chat/completions", {"name": "after"}))
        model.release["after"].set()
        _, hdrs, body = await after  # admitted at once, during nothing
        assert hdrs["x-policy-step"] == "5" and json.loads(body)["policy_step_end"] == 5
        model.release["spans"].set()
        _, hdrs, body = await spans
        assert hdrs["x-policy-step"] == "3"
        assert (json.loads(body)["policy_step"], json.loads(body)["policy_step_end"]) == (3, 5)
        assert not gate.busy

    asyncio.run(main())


def test_each_generation_is_salted_with_its_policy_so_no_cached_prefix_crosses_an_update():
    async def main():
        model, gate, app = _gated(step=7)
        for n in ("a", "b", "c"):
            model.release.setdefault(n, asyncio.Event()).set()
        await _call(app, "/v1/chat/completions", {"name": "a"})
        await _call(app, "/v1/completions", {"name": "b", "cache_salt": "tenant-9"})
        gate.step = 8
        await _call(app, "/v1/chat/completions", {"name": "c"})
        assert model.bodies["a"]["cache_salt"] == "policy-7"
        assert model.bodies["b"]["cache_salt"] == "tenant-9-policy-7"  # the client's own salt kept
        assert model.bodies["c"]["cache_salt"] == "policy-8"
        sent = {k: v for k, v in model.bodies["c"].items() if k != "content-length"}
        assert int(model.bodies["c"]["content-length"]) == len(json.dumps(sent).encode())

    asyncio.run(main())


def test_each_runs_adapter_has_a_policy_step_of_its_own():
    """A server of several runs: a request naming run a's adapter is admitted, salted and
    stamped under a's step, at its start and at its end, whatever b's and the base model's
    steps do meanwhile; a request naming the base model, under the base's."""

    async def main():
        model, gate, app = _gated(step=0)
        gate.adapters.update({"a": 3, "b": 5})
        model.release["slow"] = asyncio.Event()
        slow = asyncio.create_task(_call(app, "/v1/chat/completions", {"name": "slow", "model": "a"}))
        await asyncio.sleep(0.05)
        gate.adapters["b"], gate.step = 6, 1  # others move: a's request does not see it
        gate.adapters["a"] = 4  # a moves while its request is in flight
        model.release["slow"].set()
        _, headers, body = await slow
        assert headers["x-policy-step"] == "3"
        assert (json.loads(body)["policy_step"], json.loads(body)["policy_step_end"]) == (3, 4)
        assert model.bodies["slow"]["cache_salt"] == "policy-3"
        for name, served, step in (("x", "b", 6), ("y", "tiny", 1), ("z", None, 1)):
            model.release.setdefault(name, asyncio.Event()).set()
            body = {"name": name} if served is None else {"name": name, "model": served}
            _, _, out = await _call(app, "/v1/chat/completions", body)
            assert json.loads(out)["policy_step"] == step, (served, out)
            assert model.bodies[name]["cache_salt"] == f"policy-{step}"

    asyncio.run(main())


def test_policy_salts_are_valid_vllm_salts():
    from prime_hpc.inference.gate import SALT_MAX, policy_salt

    for salt in (None, "", "x", "y" * 500):
        out = policy_salt(123456, salt)
        assert 0 < len(out) <= SALT_MAX and out.endswith("policy-123456") and not set(out) & set("@/\\\0")


def test_an_update_that_cannot_drain_gives_up_and_changes_nothing():
    async def main():
        model, gate, app = _gated(step=2)
        model.release["stuck"] = asyncio.Event()
        stuck = asyncio.create_task(_call(app, "/v1/completions", {"name": "stuck"}))
        await asyncio.sleep(0.05)
        with pytest.raises(UpdateTimeout, match="1 generation request"):
            async with gate.exclusive(timeout_s=0.1):
                gate.step = 3
        assert gate.step == 2
        model.release["later"] = asyncio.Event()
        model.release["later"].set()
        assert (await _call(app, "/v1/completions", {"name": "later"}))[0] == 200  # not blocked afterwards
        model.release["stuck"].set()
        await stuck

    asyncio.run(main())


def test_a_policy_that_fails_midway_is_never_served_the_server_exits(tmp_path, monkeypatch, capsys):
    """Its layers are half loaded once the receive began: generation stays paused and the
    process exits with one line (its supervisor restarts it), instead of resuming on them."""

    class Exited(BaseException):  # like os._exit, nothing catches it (a `finally` still runs here)
        pass

    class Engine:
        calls: list = []
        errored = False

        async def is_paused(self):
            return False

        async def pause_generation(self, **kw):
            self.calls.append("pause")

        async def resume_generation(self):
            self.calls.append("resume")

        async def start_weight_update(self):
            self.calls.append("start")

        async def update_weights(self, request):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:41234")

        async def finish_weight_update(self, **kw):
            self.calls.append("finish")

    def exit_(code):
        raise Exited(code, list(Engine.calls))

    cfg = _cfg()
    cfg.update(output_dir=str(tmp_path), weights={"transport": "broadcast"})
    server = srv.Server(_typed(cfg), "m", "127.0.0.1")
    server.engine, server.joined = Engine(), dict(JOIN)
    monkeypatch.setattr(srv.os, "_exit", exit_)
    with pytest.raises(Exited) as exited:
        asyncio.run(server.receive_weights(RECEIVE))
    # it exits before anything resumes generation on the half-loaded layers
    assert exited.value.args == (srv.HALF_LOADED_RC, ["pause", "start"])
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "policy 3 failed midway (RuntimeError: Connection closed by peer" in err, err


def test_a_server_on_its_way_out_takes_no_update_and_the_run_drops_it_instead_of_failing(tmp_path):
    """A lost node: SLURM signals the server and vLLM's engine process at once, and the
    engine refuses every call from then on. An update reaching such a server (or one that
    left the run, its endpoint already gone) is answered 410, and the run's admin client
    drops that server as it drops one that no longer answers; the others take the update."""
    import httpx
    from fastapi import FastAPI

    from prime_hpc.inference.client import LEAVING_STATUS, Admin, InferenceError, signed

    class Engine:
        errored = False  # vLLM's AsyncLLM: True once the engine died

        def __init__(self, refuse: bool) -> None:
            self.refuse, self.loaded = refuse, []

        async def is_paused(self):
            return False

        async def pause_generation(self, **kw):
            self._call()

        async def resume_generation(self):
            self._call()

        async def reset_prefix_cache(self):
            pass

        def _call(self):
            if self.refuse:
                raise Exception(srv.ENGINE_STOPPING)  # as vLLM's engine core answers once signalled

        async def collective_rpc(self, method, kwargs=None):
            self._call()
            self.loaded.append(kwargs["weights_path"])

    weights = tmp_path / "weights" / "step_3"
    weights.mkdir(parents=True)
    (weights / "model.safetensors").write_bytes(b"")
    cfg = _cfg()
    cfg.update(output_dir=str(tmp_path))
    servers, apps = {}, {}
    for n, (name, refuse) in enumerate((("a", False), ("b", True))):
        server = srv.Server(_typed(cfg), "m", "127.0.0.1")
        server.engine, server.slot = Engine(refuse), f"inference_{n}"
        app = FastAPI()
        srv.add_routes(app, server)
        me = {"url": f"http://{name}", "instance": server.instance, "pid": n, "slot": server.slot}
        apps[name] = GateMiddleware(app, server.gate, KEY, identity=lambda me=me: me)  # as the server is served
        servers[f"http://{name}"] = server

    async def main():
        admin = Admin(list(servers), key=KEY)
        admin._client = httpx.AsyncClient(
            auth=signed(admin.proofs, admin.instances),
            mounts={f"http://{n}": httpx.ASGITransport(app=app) for n, app in apps.items()},
        )
        admin._loop = asyncio.get_running_loop()
        answers = await admin.update_weights(weights, 3)
        assert [a["policy_step"] for a in answers] == [3]  # a took it; b's refusal failed nothing
        assert servers["http://a"].engine.loaded == [str(weights)] and servers["http://a"].gate.step == 3
        assert list(admin.lost) == ["http://b"] and servers["http://b"].gate.step == 0
        assert (
            "inference_1 is leaving the run (its engine is shutting down): policy 3 not applied"
            in admin.lost["http://b"]
        )
        servers["http://a"].draining = "SIGTERM"  # left the run: refused before its engine is asked
        assert await admin.update_weights(weights, 4) == [] and set(admin.lost) == set(servers)
        assert servers["http://a"].engine.loaded == [str(weights)]
        # a caller naming the server itself (a joiner being synced) is told, not silently dropped
        with pytest.raises(InferenceError, match="leaving the run"):
            await admin.update_weights(weights, 4, to=["http://a"])
        r = await admin.client().post("http://a/update_weights", json={"weight_dir": str(weights), "step": 5})
        assert r.status_code == LEAVING_STATUS
        await admin.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    "body, expected",
    [
        ('{"error": {"message": "model not found"}}', "model not found"),
        ('{"error": "bad request"}', "bad request"),
        ('["not", "an", "object"]', '["not", "an", "object"]'),
        ('"a string"', '"a string"'),
        ("<html>502 Bad Gateway</html>", "<html>502 Bad Gateway</html>"),
    ],
)
def test_an_error_answer_of_any_shape_is_one_line_of_what_it_said(body, expected):
    """A server's error answer whose JSON is not an object (a list, a string) is quoted as
    its body, not an AttributeError: every caller turns it into one line naming the server."""
    import httpx

    from prime_hpc.inference.client import error_detail

    assert error_detail(httpx.Response(500, text=body)) == expected

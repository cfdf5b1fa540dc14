"""What the OPD teacher (`prime_hpc.orchestrator.teacher.Teacher`) does with each way a real
HTTP server can fail it: a connection broken before the answer came is asked again (after
`RETRY_DELAYS_S`) and the run goes on once it answers; a connection broken every time, an
error answer (4xx, 5xx: the teacher's router already waited for a server), a timeout, or an
answer without the prompt's logprobs ends the run in one line naming the teacher's URL.
The server is a real one on loopback, scripted answer by answer."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from prime_hpc.core.errors import UserError
from prime_hpc.orchestrator import teacher as teacher_mod
from prime_hpc.orchestrator.rollouts import Rollout
from prime_hpc.orchestrator.teacher import Teacher, TeacherAt

LOGPROBS = {"choices": [{"prompt_logprobs": [None, {"2": {"logprob": -0.5}}, {"3": {"logprob": -0.25}}]}]}
HTML_502 = (
    "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    "<center><h1>502 Bad Gateway</h1></center>\r\n</body>\r\n</html>\r\n"
)


class Scripted:
    """A real HTTP/1.1 server on loopback answering the n-th request as `script[n]` says:
    `(status, body, content type)`, "drop" (the request read, the connection closed with no
    answer) or "hang" (no answer until the test ends). Records every request's body."""

    def __init__(self, script: list) -> None:
        self.script = script
        self.bodies: list[dict] = []
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                n = len(outer.bodies)
                outer.bodies.append({"path": self.path, "auth": self.headers.get("authorization"), **body})
                step = outer.script[min(n, len(outer.script) - 1)]
                if step == "drop":
                    self.close_connection = True
                    return
                if step == "hang":
                    outer.release.wait(30)
                    self.close_connection = True
                    return
                status, data, ctype = step
                raw = data.encode() if isinstance(data, str) else json.dumps(data).encode()
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> Scripted:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _rollout() -> Rollout:
    return Rollout("e", 0, 0.0, [1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], [0], 1, False)


def _ask(url: str, r: Rollout, delays: tuple[float, ...] = (0.01, 0.01, 0.01, 0.01)) -> None:
    teacher = Teacher(TeacherAt(url, "the-teachers-key", "tiny"), lambda: "student")
    teacher.retry_delays_s = delays

    async def ask() -> None:
        try:
            await teacher.add_logprobs([r])
        finally:
            await teacher.aclose()

    asyncio.run(ask())


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    from loguru import logger

    seen: list[str] = []
    sink = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    yield seen
    logger.remove(sink)


@pytest.mark.parametrize(
    "status, body, ctype, detail",
    [
        (
            500,
            {"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError", "code": 500}},
            "application/json",
            "EngineCore encountered an issue",
        ),
        (
            503,
            {"error": "no inference server answered: none"},
            "application/json",
            "no inference server answered: none",
        ),
        (502, HTML_502, "text/html", "<html> <head><title>502 Bad Gateway</title></head> <body> <center><h1>502 Bad"),
        (
            404,
            {"error": {"message": "The model `tiny` does not exist.", "type": "NotFoundError", "code": 404}},
            "application/json",
            "The model `tiny` does not exist.",
        ),
        (
            401,
            {"error": "Unauthorized: missing or wrong API key"},
            "application/json",
            "Unauthorized: missing or wrong",
        ),
        (
            422,
            {"detail": [{"loc": ["body", "prompt"], "msg": "Field required"}]},
            "application/json",
            '{"detail": [{"loc": ["body", "prompt"], "msg": "Field required"}]}',
        ),
    ],
    ids=["500-vllm", "503-router", "502-html-proxy", "404-model", "401-key", "422-fastapi"],
)
def test_an_error_answer_ends_the_run_at_once_in_one_line_naming_the_teacher(status, body, ctype, detail, warnings):
    r = _rollout()
    with Scripted([(status, body, ctype), (200, LOGPROBS, "application/json")]) as server:
        with pytest.raises(UserError) as err:
            _ask(server.url, r)
    msg = str(err.value)
    assert msg.startswith(
        f"the teacher at {server.url}/completions answered HTTP {status} for a sequence of 3 tokens: "
    )
    assert detail in msg and "\n" not in msg and "\r" not in msg, msg
    assert len(server.bodies) == 1 and not warnings  # not asked again: an error answer is the teacher's verdict
    assert server.bodies[0]["path"] == "/v1/completions" and server.bodies[0]["auth"] == "Bearer the-teachers-key"
    assert r.teacher_logprobs is None


def test_a_connection_broken_before_the_answer_is_asked_again_and_the_run_goes_on(warnings):
    r = _rollout()
    with Scripted(["drop", "drop", (200, LOGPROBS, "application/json")]) as server:
        _ask(server.url, r)
    assert len(server.bodies) == 3 and server.bodies[0] == server.bodies[1] == server.bodies[2]
    assert server.bodies[0]["prompt"] == [1, 2, 3] and server.bodies[0]["model"] == "tiny"
    assert r.teacher_logprobs == [0.0, -0.5, -0.25] and r.token_advantages is not None
    assert len(warnings) == 2 and all(
        w.startswith(f"the teacher at {server.url}/completions did not answer (") for w in warnings
    )


def test_a_connection_broken_every_time_ends_the_run_after_its_tries_in_one_line(warnings):
    r = _rollout()
    with Scripted(["drop"]) as server:
        with pytest.raises(UserError) as err:
            _ask(server.url, r, delays=(0.01, 0.01))
    msg = str(err.value)
    assert msg.startswith(f"the teacher at {server.url}/completions did not answer: RemoteProtocolError: "), msg
    assert msg.endswith(" (3 tries)") and "\n" not in msg, msg
    assert len(server.bodies) == 3 and len(warnings) == 2 and r.teacher_logprobs is None


def test_a_teacher_that_does_not_answer_in_time_ends_the_run_without_asking_again(monkeypatch, warnings):
    monkeypatch.setattr(teacher_mod, "TIMEOUT_S", 0.5)
    r = _rollout()
    with Scripted(["hang"]) as server:
        with pytest.raises(UserError) as err:
            _ask(server.url, r)
    msg = str(err.value)
    assert msg.startswith(f"the teacher at {server.url}/completions did not answer: ReadTimeout"), msg
    assert "tries" not in msg and len(server.bodies) == 1 and not warnings


@pytest.mark.parametrize(
    "body, ctype",
    [
        ({"choices": [{"text": "x", "index": 0}]}, "application/json"),  # an OpenAI server without prompt_logprobs
        (
            {"choices": [{"prompt_logprobs": [None, {"7": {"logprob": -1.0}}, {"3": {"logprob": -0.1}}]}]},
            "application/json",
        ),
        ({"choices": [{"prompt_logprobs": [None, {"2": {"logprob": -1.0}}]}]}, "application/json"),
        ("<html>teapot</html>", "text/html"),
    ],
    ids=["no-prompt-logprobs", "other-tokens", "too-few", "not-json"],
)
def test_an_answer_without_the_prompts_logprobs_ends_the_run_in_one_line(body, ctype):
    r = _rollout()
    with Scripted([(200, body, ctype)]) as server:
        with pytest.raises(UserError) as err:
            _ask(server.url, r)
    msg = str(err.value)
    assert msg.startswith(
        f"the teacher at {server.url}/completions answered without the logprobs of a sequence of 3 tokens"
    ), msg
    assert "\n" not in msg and len(server.bodies) == 1 and r.teacher_logprobs is None

"""The sender's side of `weights.transport=broadcast`: rank 0 of one inference server's
weight group, which sends it each policy straight from memory (`Broadcaster`: gloo, to
CPU servers; `NcclBroadcaster`: NCCL, to GPU servers; `broadcaster_for` picks by device).

One group per server: the sender (rank 0) and that server's W vLLM workers (ranks
1..W), `world_size = 1 + W`. A server that joins or leaves the fleet then touches no
other server's group, and a slow server delays only its own update. gloo's rendezvous is
a file store of the sender's in the run's private `rendezvous/` (0700) when both are on
one host (the sender's address is a loopback one: nothing listens for it), else the
sender's TCP store, on a port of its own; NCCL's is a unique id the sender mints and hands
over in the join's body (no store listens).

Every send carries each tensor's digest (`tensor_digest`, SHA-256 of its bytes as sent)
in the receive's body, over the keyed route; the server's workers check each tensor as it
arrives. A policy that differs (someone in the group, or on its path, altered it) is
refused: the server never serves it, answers 409 with `"refused": "digest"` and the
directory it loads that step from instead (`weights/step_<n>`, which the sender then
writes: `DigestRefused`).

Each exchange pairs a call to the server's routes (the control plane) with the collective
it triggers there (the data plane), run at the same time; the first failure of either is
raised at once:

  join   POST /weights/join {"world_size", "rank_offset", and the rendezvous: gloo's
         "store_path" (one host) or "master_address", "master_port", with "timeout_s",
         or NCCL's "nccl_unique_id_b64"}; meanwhile open this side's end of the group as
         rank 0
  send   POST /weights/receive {"step", "names", "dtype_names", "shapes", "digests"};
         meanwhile broadcast each tensor, in exactly the announced order; the server
         applies it as it applies a filesystem update (paused, one at a time) and serves
         policy `step`
  leave  POST /weights/leave; then close the group

A failed join or send leaves the group unusable (a collective cannot be cancelled: the
one under way ends at the group's timeout): join again.

The job's key is never sent (as with the orchestrator's weight relay,
`prime_hpc.inference.client.Admin`): the listener at a server's address is sent nothing
until it has proven that it holds the key as the server the run published there (its
endpoint's `instance` and `pid`, `expect`; `client.challenge_sync`), before the first call,
before each join (a join says where the group meets) and after any broken connection. Each
call then goes signed for that instance (`client.signed`) and its answer is taken only with
the server's proof. A listener that does not prove it, or answers without the proof (say,
someone else's on a dead server's freed port), is `Lost`: nothing more is sent to it.

Imports no vLLM at import time (torch and httpx inside the calls; NCCL's communicator
is vLLM's, imported by the NCCL sender when it opens a group): the trainer imports it.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import os
import queue
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

from prime_hpc.core.net import bound_socket, is_loopback, node_address

JOIN_PATH = "/weights/join"
RECEIVE_PATH = "/weights/receive"
LEAVE_PATH = "/weights/leave"
SEND_AHEAD = 8  # gloo: tensors sent before the oldest one's send is waited for
TIMEOUT_S = 600.0  # longest a join or one tensor waits for the other side (a server may first drain)
HTTP_MARGIN_S = 60.0  # a route's answer may come this long after the group's own timeout

A = TypeVar("A")
B = TypeVar("B")


class BroadcastError(RuntimeError):
    """A join or a send failed; the message names the server and what went wrong."""


class Lost(BroadcastError):
    """The listener at the server's address did not prove it is the server the run
    published there (or answered without that server's proof): nothing more is sent to it.
    The server is gone, not failed."""


class Late(BroadcastError):
    """`together`'s deadline passed (the caller adds which server and which exchange)."""


class DigestRefused(BroadcastError):
    """The server refused policy `step`: what arrived differs from the digests sent over
    the keyed route. It serves none of it and loads the step from `weight_dir` (the run's
    `weights/step_<n>`) once that is complete."""

    def __init__(self, message: str, step: int, weight_dir: str) -> None:
        super().__init__(message)
        self.step, self.weight_dir = step, weight_dir


DIGEST = "sha256"  # hashlib's name; what `tensor_digest` computes
DIGEST_MISMATCH = "weights differ from their digest"  # the workers' error, as the server recognises it
DIGEST_THREADS = 8  # tensors hashed at once on the sender (hashlib lets go of the GIL)
DIGEST_THREADED_BYTES = 64 << 20  # below this a policy is hashed on the calling thread


def tensor_digest(tensor: Any) -> str:
    """The hex digest of a CPU tensor's bytes, as they go over the group."""
    t = tensor.detach().contiguous().reshape(-1)
    h = hashlib.new(DIGEST)
    if t.numel():
        import torch

        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def tensor_digests(tensors: Sequence[Any]) -> list[str]:
    """`tensor_digest` of each, in order (on up to `DIGEST_THREADS` threads, when there are
    enough bytes for threads to pay)."""
    if sum(t.numel() * t.element_size() for t in tensors) < DIGEST_THREADED_BYTES:
        return [tensor_digest(t) for t in tensors]
    with ThreadPoolExecutor(min(DIGEST_THREADS, os.cpu_count() or 1, len(tensors))) as pool:
        return list(pool.map(tensor_digest, tensors))


def file_store_prefix(path: str) -> str:
    """The prefix of a file-store group's keys (both sides use it, as `store_prefix`)."""
    return f"file://{path}"


def dtype_name(tensor: Any) -> str:
    """A tensor's dtype as the servers name it ("float32", "bfloat16")."""
    return str(tensor.dtype).removeprefix("torch.")


def announcement(named: Sequence[tuple[str, Any]]) -> dict[str, list]:
    """What a send announces: the names, dtype names and shapes, in the order sent."""
    return {
        "names": [n for n, _ in named],
        "dtype_names": [dtype_name(t) for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
    }


def store_prefix(host: str, port: int) -> str:
    """The prefix of the group's keys in its store: what vLLM's stateless group init uses
    (`tcp://host:port`), so both sides of the group find each other's keys."""
    try:
        v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        v6 = False
    return f"tcp://[{host}]:{port}" if v6 else f"tcp://{host}:{port}"


def together(control: Callable[[], A], data: Callable[[], B], within_s: Optional[float] = None) -> tuple[A, B]:
    """Run `control` (a call to the server) and `data` (the collective it pairs with) at
    once, each in a thread; both results, or the first failure as soon as it happens (the
    other is left to end by its own timeout). Either not done within `within_s` seconds is
    `Late`, naming it: NCCL's communicator waits for its peers without a timeout
    of its own, and a server whose workers never join would otherwise hold the caller for
    ever."""
    done: queue.Queue = queue.Queue()
    deadline = None if within_s is None else time.monotonic() + within_s

    def run(which: str, fn: Callable[[], Any]) -> None:
        try:
            done.put((which, fn(), None))
        except BaseException as e:  # handed to the caller
            done.put((which, None, e))

    for which, fn in (("control", control), ("data", data)):
        threading.Thread(target=run, args=(which, fn), name=f"prime-hpc-weights-{which}", daemon=True).start()
    out: dict[str, Any] = {}
    for _ in range(2):
        try:
            which, value, error = done.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            late = [w for w in ("control", "data") if w not in out]
            what = {"control": "the server's answer", "data": "the weight group's exchange"}
            raise Late(f"{' and '.join(what[w] for w in late)} did not come within {within_s:g} s") from None
        if error is not None:
            raise error
        out[which] = value
    return out["control"], out["data"]


class Broadcaster:
    """Rank 0 of server `url`'s weight group. `workers`: the server's vLLM workers (None:
    asked from its `GET /policy`); `host`: the address this side binds and announces
    (None: this node's, `prime_hpc.core.net.node_address`); `key`: the API key (None:
    `$INFERENCE_SERVER_API_KEY`), never sent, only proven with; `store_dir`: the run's
    private `rendezvous/`, where the group meets when `host` is a loopback address
    (required then: on one host nothing of the run listens for anyone to join); `record`:
    the endpoint the server published (`endpoints/<slot>.json`), whose instance and pid it
    must prove it is (None, or until `expect` says: whatever instance the key proves)."""

    def __init__(
        self,
        url: str,
        workers: Optional[int] = None,
        host: Optional[str] = None,
        key: Optional[str] = None,
        timeout_s: float = TIMEOUT_S,
        store_dir: Optional[os.PathLike | str] = None,
        record: Optional[dict] = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.record = record
        self.instance: Optional[str] = None  # the instance the server proved it is (None: prove it first)
        self._client: Any = None  # httpx.Client: kept while the server answers (its connection reused)
        self._proofs_made: Any = None  # gate.Proofs of the key, made at the first call
        self.workers = workers
        self.host = host or node_address()
        self.key = key
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self.timeout_s = timeout_s
        self.margin_s = HTTP_MARGIN_S  # a route's answer (and an exchange) may take this much longer
        self.group: Any = None
        self.port: Optional[int] = None
        self.store_path: Optional[Path] = None  # one host: the group's file store
        self.verified = True  # each send carries the tensors' digests, which the server checks
        self.dtype: Optional[str] = None  # the server's weights' dtype (its `/policy`), learnt at the join
        self._in_flight: list[Any] = []  # gloo: (work, tensor) of the sends not yet known to have left

    # ------------------------------------------------------------------ control plane
    def expect(self, record: dict) -> None:
        """The server must prove it is the one `record` (its endpoint) names before it is
        sent anything more."""
        if (self.record or {}).get("instance") != record.get("instance"):
            self.instance = None
        self.record = record

    def _proofs(self) -> Any:
        from prime_hpc.inference.client import API_KEY_VAR, api_key
        from prime_hpc.inference.gate import MissingKey, Proofs

        try:
            if self._proofs_made is None:
                self._proofs_made = Proofs(self.key or api_key() or "")
            return self._proofs_made
        except MissingKey:
            raise BroadcastError(
                f"{self.url}: {API_KEY_VAR} is not set: a server is sent nothing before it proves it holds the job's key"
            ) from None

    def _http(self) -> Any:
        import httpx

        from prime_hpc.core.net import IDLE_CONNECTION_S

        if self._client is None:
            self._client = httpx.Client(limits=httpx.Limits(keepalive_expiry=IDLE_CONNECTION_S))
        return self._client

    def _forget(self) -> None:
        """Drop the connection and the proof: the server proves itself again before the next call."""
        client, self._client, self.instance = self._client, None, None
        if client is not None:
            client.close()

    def prove(self) -> str:
        """The instance the server proved it is, challenged now if not yet (or not since a
        broken connection): `Lost` when it does not prove it, `BroadcastError` when it does
        not answer."""
        import httpx

        from prime_hpc.inference.client import NotProven, challenge_sync

        if self.instance is None:
            try:
                self.instance = challenge_sync(self._http(), self.url, self._proofs(), self.record)
            except NotProven as e:
                self._forget()
                raise Lost(str(e)) from None
            except httpx.HTTPError as e:
                self._forget()
                raise BroadcastError(f"{self.url}: its identity challenge: {type(e).__name__}: {e}") from None
        return self.instance

    def _call(self, method: str, path: str, body: Optional[dict], timeout_s: float) -> Any:
        """`method` `path` on the server, signed for the instance it proved it is (`prove`);
        the answer, taken only with that server's proof (`Lost` otherwise)."""
        import httpx

        from prime_hpc.inference.client import NotProven, signed

        instance = self.prove()
        try:
            return self._http().request(
                method,
                self.url + path,
                json=body,
                timeout=timeout_s,
                auth=signed(self._proofs(), {self.url: instance}),
            )
        except NotProven as e:
            self._forget()
            raise Lost(str(e)) from None
        except httpx.HTTPError as e:
            self._forget()  # a broken connection: proven again before anything more is sent
            raise BroadcastError(f"{self.url}{path}: {type(e).__name__}: {e}") from None

    def _post(self, path: str, body: dict) -> dict:
        from prime_hpc.inference.client import error_detail

        r = self._call("POST", path, body, self.timeout_s + self.margin_s)
        if r.status_code == 409 and path == RECEIVE_PATH:
            refused = _json_or_none(r)
            if refused.get("refused") == "digest":
                raise DigestRefused(
                    f"{self.url}: {refused.get('error')}", int(body["step"]), str(refused.get("weight_dir"))
                )
        if r.status_code != 200:
            raise BroadcastError(f"{self.url}{path}: HTTP {r.status_code}: {error_detail(r)}")
        return r.json()

    def _workers(self) -> int:
        """The server's workers (and the dtype it holds its weights in), from its `/policy`."""
        if self.workers is None:
            from prime_hpc.inference.client import error_detail

            r = self._call("GET", "/policy", None, 30)
            if r.status_code != 200:
                raise BroadcastError(f"{self.url}/policy: HTTP {r.status_code}: {error_detail(r)}")
            answer = r.json()
            self.workers = int(answer["workers"])
            self.dtype = self.dtype or answer.get("dtype")
        return self.workers

    def _narrowed(self, name: str) -> str:
        """The dtype a tensor of dtype `name` goes in: the server's when that is a narrower
        float of the kind it holds (float32 to a bfloat16 server: half the bytes, rounded as
        its own load would round it); otherwise as it is (never wider: that would only add
        bytes; integers, fp8 and the like untouched)."""
        width = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
        if self.dtype in width and name in width and width[self.dtype] < width[name]:
            return str(self.dtype)
        return name

    def _served(self, tensor: Any) -> Any:
        """`tensor` as it goes to the server (`_narrowed`)."""
        import torch

        to = self._narrowed(dtype_name(tensor))
        return tensor.to(getattr(torch, to)) if to != dtype_name(tensor) else tensor

    def _announced(self, announced: dict[str, list]) -> dict[str, list]:
        """An announcement of the policy as `_served` will send it."""
        return {**announced, "dtype_names": [self._narrowed(d) for d in announced["dtype_names"]]}

    def served(self, named: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """`named` as it goes to this server (`_served`: narrowed where the server holds a
        narrower dtype), once: `send` and `digests` take it as it is."""
        return [(name, self._served(t)) for name, t in named]

    def digests(self, named: Sequence[tuple[str, Any]]) -> list[str]:
        """Each tensor's digest as it goes to this server (`served`), for `send`."""
        return tensor_digests([self._served(t) for _, t in named])

    # ------------------------------------------------------------------ data plane
    def _rendezvous(self, world_size: int) -> tuple[dict, Callable[[], Any], Callable[[], None]]:
        """What the join's body says of the group, the opening of this side's end (run
        while the server joins), and what undoes a failed join: gloo's rendezvous is a file
        store in the run's private directory on one host (`_file_rendezvous`), else a TCP
        store on a port of this side's, whose address and port the body carries."""
        if is_loopback(self.host):
            return self._file_rendezvous(world_size)
        sock = bound_socket(self.host)
        sock.listen()
        self.port = sock.getsockname()[1]
        body = {"master_address": self.host, "master_port": self.port, "timeout_s": self.timeout_s}
        return body, lambda: self._open(sock, world_size), sock.close

    def _file_rendezvous(self, world_size: int) -> tuple[dict, Callable[[], Any], Callable[[], None]]:
        """One host: the group meets in a fresh file store in `store_dir` (made 0700 and
        checked on its descriptor: `rundir.private`), which only this user can reach; the
        store file goes with the group (or the failed join)."""
        from prime_hpc.rundir import private

        if self.store_dir is None:
            raise BroadcastError(
                f"{self.url}: on one host ({self.host}) a weight group meets in a file store of the run's "
                "private rendezvous directory, and none was given (store_dir)"
            )
        try:
            d = private.ensure(self.store_dir)
        except (private.Untrusted, OSError) as e:
            raise BroadcastError(f"{self.url}: the weight group's store: {e}") from None
        path = d / f"weights_{secrets.token_hex(8)}.store"
        self.port, self.store_path = None, path
        body = {"store_path": str(path), "timeout_s": self.timeout_s}
        return body, lambda: self._open_file(str(path), world_size), self._unlink_store

    def _unlink_store(self) -> None:
        if self.store_path is not None:
            self.store_path.unlink(missing_ok=True)
            self.store_path = None

    def _open_file(self, path: str, world_size: int) -> Any:
        """The group as rank 0 over the file store at `path`, gloo on this side's address."""
        from torch.distributed import FileStore, PrefixStore

        store = FileStore(path, world_size)
        store.set_timeout(timedelta(seconds=self.timeout_s))
        return self._gloo(PrefixStore(file_store_prefix(path), store), world_size)

    def _gloo(self, store: Any, world_size: int) -> Any:
        from torch.distributed import ProcessGroupGloo

        gloo: Any = ProcessGroupGloo  # its `_Options` (the way to give it a device) is not in torch's stubs
        options = gloo._Options()
        options._timeout = timedelta(seconds=self.timeout_s)
        options._devices = [ProcessGroupGloo.create_device(hostname=self.host)]
        return ProcessGroupGloo(store, 0, world_size, options)

    def _open(self, sock: Any, world_size: int) -> Any:
        """The group as rank 0: the store's master on `sock` (bound to this side's
        address), waiting for every worker to join, then gloo on the same address."""
        from torch.distributed import PrefixStore, TCPStore

        timeout = timedelta(seconds=self.timeout_s)
        port = sock.getsockname()[1]
        store = TCPStore(
            self.host,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=True,
            multi_tenant=True,
            master_listen_fd=sock.detach(),
        )
        return self._gloo(PrefixStore(store_prefix(self.host, port), store), world_size)

    def _send_tensor(self, tensor: Any) -> int:
        """Broadcast one tensor from here (rank 0); its bytes. The send goes on in gloo's
        own thread while the caller prepares the next tensor (at most `SEND_AHEAD` in
        flight: their memory is held until they have left)."""
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = 0
        t = tensor.detach().cpu().contiguous()
        self._in_flight.append((self.group.broadcast([t], options), t))
        while len(self._in_flight) > SEND_AHEAD:
            self._in_flight.pop(0)[0].wait()
        return t.numel() * t.element_size()

    def _sent(self) -> None:
        """Every tensor handed to `_send_tensor` has left (gloo: once each `wait` returned)."""
        try:
            while self._in_flight:
                self._in_flight[0][0].wait()
                self._in_flight.pop(0)
        finally:
            self._in_flight.clear()

    def _drop(self, group: Any) -> None:
        group.shutdown()

    def _abandon(self, group: Any) -> None:
        """A group whose exchange failed midway: gloo's collective under way cannot be
        cancelled, it ends at the group's timeout (dropping the reference is all)."""

    def _broadcast(self, named: Iterable[tuple[str, Any]], announced: dict[str, list]) -> int:
        """Send each tensor of `named`, checked against what was announced; bytes sent."""
        sent, n, total = 0, 0, len(announced["names"])
        self._in_flight.clear()  # an earlier exchange that failed midway left these behind
        for n, (name, tensor) in enumerate(named, 1):
            if n > total:
                raise BroadcastError(f"{self.url}: more tensors than announced ({total}), from {name!r} on")
            tensor = self._served(tensor)
            want = (announced["names"][n - 1], announced["dtype_names"][n - 1], list(announced["shapes"][n - 1]))
            have = (name, dtype_name(tensor), list(tensor.shape))
            if have != want:
                raise BroadcastError(f"{self.url}: tensor {n - 1} is {have}, announced {want}")
            sent += self._send_tensor(tensor)
        if n != total:
            raise BroadcastError(f"{self.url}: {n} tensors sent, {total} announced")
        self._sent()
        return sent

    # ------------------------------------------------------------------ lifecycle
    def join(self) -> dict:
        """Open the group with the server's workers (replacing any earlier one), once the
        server has proven itself again (the join says where the group meets)."""
        self.close(leave=False)
        self.prove()
        world_size = 1 + self._workers()
        rendezvous, open_group, undo = self._rendezvous(world_size)
        body = {**rendezvous, "world_size": world_size, "rank_offset": 1}
        try:
            reply, self.group = together(
                lambda: self._post(JOIN_PATH, body), open_group, self.timeout_s + self.margin_s
            )
        except Late as e:
            undo()
            raise BroadcastError(f"{self.url}: joining its weight group: {e}") from None
        except BaseException:
            undo()
            raise
        return reply

    def send(
        self,
        step: int,
        named: Iterable[tuple[str, Any]],
        announced: Optional[dict[str, list]] = None,
        digests: Optional[list[str]] = None,
    ) -> dict:
        """Make the server serve policy `step`: the tensors of `named` (checkpoint names,
        as the model's `named_parameters` or a HF state dict has them). `announced`
        (`announcement(...)`) and `digests` (`self.digests(...)`): what `named` will yield,
        so it can be a generator; without either `named` is read once into a list first.
        The server's answer, plus `bytes`; `DigestRefused` when what arrived differs."""
        if self.group is None:
            raise BroadcastError(f"{self.url}: no weight group (join first)")
        if announced is None or (digests is None and self.verified):
            named = list(named)
            announced = announced or announcement(named)
            digests = digests if digests is not None or not self.verified else self.digests(named)
        announced = self._announced(announced)
        body = {"step": int(step), **announced}
        if self.verified:
            body["digests"] = list(digests or ())
        items = named
        try:
            self.prove()  # again after a broken connection, before any tensor goes
            reply, sent = together(
                lambda: self._post(RECEIVE_PATH, body),
                lambda: self._broadcast(items, announced),
                self.timeout_s + self.margin_s,
            )
        except BaseException as e:
            group, self.group = self.group, None  # a collective may still be under way: unusable
            self._unlink_store()
            self._abandon(group)
            if isinstance(e, Late):
                raise BroadcastError(f"{self.url}: sending policy {step}: {e}") from None
            raise
        return {**reply, "bytes": sent}

    def close(self, leave: bool = True) -> None:
        """Leave the group (`leave`: the server first, so its workers drop their side);
        the server proves itself again before anything more is sent to it."""
        if self.group is None:
            self._unlink_store()
            self._forget()
            return
        group, self.group = self.group, None
        try:
            if leave:
                self._post(LEAVE_PATH, {})
        finally:
            self._unlink_store()
            self._forget()
            self._drop(group)


NCCL_UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)


class NcclBroadcaster(Broadcaster):
    """Rank 0 of a GPU server's weight group: vLLM's own NCCL engine on the servers' side
    (`cluster.device=cuda`), reached by NCCL's unique-id rendezvous. This side mints the
    id and hands it to the server in the join's body, over its keyed route: no TCP store
    listens for anyone to join, and only a holder of the API key learns where to. Each
    tensor goes to `device` (this rank's GPU) on a stream of its own, then out by
    `ncclBroadcast`; the workers receive one tensor at a time (vLLM's unpacked mode).

    `communicator(uid, rank, world_size, device)` and `mint()` are vLLM's
    `PyNcclCommunicator.from_unique_id_bytes` and `ncclGetUniqueId` unless given (the
    communicator runs vLLM's warm-up handshake, the one the workers expect)."""

    def __init__(
        self,
        url: str,
        device: Any = None,
        workers: Optional[int] = None,
        host: Optional[str] = None,
        key: Optional[str] = None,
        timeout_s: float = TIMEOUT_S,
        communicator: Optional[Callable[[bytes, int, int, Any], Any]] = None,
        mint: Optional[Callable[[], bytes]] = None,
    ) -> None:
        super().__init__(url, workers=workers, host=host, key=key, timeout_s=timeout_s)
        import torch

        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.communicator = communicator or _vllm_communicator
        self.mint = mint or _vllm_unique_id
        self.stream: Any = None
        # vLLM's NCCL engine checks no digest; its group is joined only through the unique id
        # sent over the keyed route (NCCL's bootstrap also checks the id's random magic)
        self.verified = False

    def _on_device(self) -> None:
        """Each exchange runs in threads of its own: they compute on this rank's GPU."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            if self.stream is None:
                self.stream = torch.cuda.Stream(self.device)

    def _rendezvous(self, world_size: int) -> tuple[dict, Callable[[], Any], Callable[[], None]]:
        uid = self.mint()
        if len(uid) != NCCL_UNIQUE_ID_BYTES:
            raise BroadcastError(f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, minted {len(uid)}")

        def open_group() -> Any:
            self._on_device()
            return self.communicator(uid, 0, world_size, self.device)

        return {"nccl_unique_id_b64": base64.b64encode(uid).decode("ascii")}, open_group, lambda: None

    def _send_tensor(self, tensor: Any) -> int:
        import torch

        self._on_device()
        with torch.cuda.stream(self.stream):  # no stream (a CPU device): the calling thread's
            t = tensor.detach().to(self.device).contiguous()
            self.group.broadcast(t, src=0, stream=self.stream)
        return t.numel() * t.element_size()

    def _sent(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _drop(self, group: Any) -> None:
        group.destroy()

    def _abandon(self, group: Any) -> None:
        """NCCL's collective under way would spin on this GPU for ever: the communicator
        is aborted (`destroy`: ncclCommAbort), best effort, in a thread of its own."""
        import threading

        def abort() -> None:
            try:
                group.destroy()
            except Exception:
                pass

        threading.Thread(target=abort, name="prime-hpc-weights-abort", daemon=True).start()


def _vllm_communicator(uid: bytes, rank: int, world_size: int, device: Any) -> Any:
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    return PyNcclCommunicator.from_unique_id_bytes(uid, rank=rank, world_size=world_size, device=device)


def _vllm_unique_id() -> bytes:
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    return bytes(NCCLLibrary().ncclGetUniqueId().internal)


def broadcaster_for(
    device: str, rank_device: Any = None, store_dir: Optional[os.PathLike | str] = None
) -> Callable[[str], Broadcaster]:
    """What the trainer's sender opens a server's weight group with on `cluster.device`:
    NCCL from `rank_device` (this rank's GPU) to GPU servers, gloo to CPU ones
    (`core.device.weight_transfer_backend`), meeting in `store_dir` (the run's private
    `rendezvous/`) on one host."""
    from prime_hpc.core.device import weight_transfer_backend

    if weight_transfer_backend(device) == "nccl":
        return lambda url: NcclBroadcaster(url, device=rank_device)
    return lambda url: Broadcaster(url, store_dir=store_dir)


def _json_or_none(r: Any) -> dict:
    try:
        answer = r.json()
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}

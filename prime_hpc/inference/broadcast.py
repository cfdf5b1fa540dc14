"""The sender's side of `weights.transport=broadcast` on CPU: rank 0 of one inference
server's weight group, which sends it each policy straight from memory.

One group per server: the sender (rank 0, and the master of the group's TCP store, on a
port of its own) and that server's W vLLM workers (ranks 1..W), `world_size = 1 + W`. A
server that joins or leaves the fleet then touches no other server's group, and a slow
server delays only its own update.

Each exchange pairs a call to the server's routes (the control plane) with the collective
it triggers there (the data plane), run at the same time; the first failure of either is
raised at once:

  join   POST /weights/join {"master_address", "master_port", "world_size", "rank_offset",
         "timeout_s"}; meanwhile open the store and the group as rank 0
  send   POST /weights/receive {"step", "names", "dtype_names", "shapes"}; meanwhile
         broadcast each tensor, in exactly the announced order; the server applies it as
         it applies a filesystem update (paused, one at a time) and serves policy `step`
  leave  POST /weights/leave; then close the group

A failed join or send leaves the group unusable (a gloo collective cannot be cancelled:
the one under way ends at the group's timeout): join again.

Imports no vLLM (torch and httpx, inside the calls): the trainer imports it.
"""

from __future__ import annotations

import ipaddress
import queue
import threading
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

from prime_hpc.core.net import bound_socket, node_address

JOIN_PATH = "/weights/join"
RECEIVE_PATH = "/weights/receive"
LEAVE_PATH = "/weights/leave"
TIMEOUT_S = 600.0  # longest a join or one tensor waits for the other side (a server may first drain)
HTTP_MARGIN_S = 60.0  # a route's answer may come this long after the group's own timeout

A = TypeVar("A")
B = TypeVar("B")


class BroadcastError(RuntimeError):
    """A join or a send failed; the message names the server and what went wrong."""


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


def together(control: Callable[[], A], data: Callable[[], B]) -> tuple[A, B]:
    """Run `control` (a call to the server) and `data` (the collective it pairs with) at
    once, each in a thread; both results, or the first failure as soon as it happens (the
    other is left to end by its own timeout)."""
    done: queue.Queue = queue.Queue()

    def run(which: str, fn: Callable[[], Any]) -> None:
        try:
            done.put((which, fn(), None))
        except BaseException as e:  # handed to the caller
            done.put((which, None, e))

    for which, fn in (("control", control), ("data", data)):
        threading.Thread(target=run, args=(which, fn), name=f"prime-hpc-weights-{which}", daemon=True).start()
    out: dict[str, Any] = {}
    for _ in range(2):
        which, value, error = done.get()
        if error is not None:
            raise error
        out[which] = value
    return out["control"], out["data"]


class Broadcaster:
    """Rank 0 of server `url`'s weight group. `workers`: the server's vLLM workers (None:
    asked from its `GET /policy`); `host`: the address this side binds and announces
    (None: this node's, `prime_hpc.core.net.node_address`); `key`: the API key (None:
    `$INFERENCE_SERVER_API_KEY`)."""

    def __init__(
        self,
        url: str,
        workers: Optional[int] = None,
        host: Optional[str] = None,
        key: Optional[str] = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.url = url
        self.workers = workers
        self.host = host or node_address()
        self.key = key
        self.timeout_s = timeout_s
        self.group: Any = None
        self.port: Optional[int] = None

    # ------------------------------------------------------------------ control plane
    def _post(self, path: str, body: dict) -> dict:
        import httpx

        from prime_hpc.inference.client import error_detail, headers

        try:
            r = httpx.post(
                self.url + path, json=body, headers=headers(self.key), timeout=self.timeout_s + HTTP_MARGIN_S
            )
        except httpx.HTTPError as e:
            raise BroadcastError(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise BroadcastError(f"{self.url}{path}: HTTP {r.status_code}: {error_detail(r)}")
        return r.json()

    def _workers(self) -> int:
        if self.workers is None:
            import httpx

            from prime_hpc.inference.client import headers

            r = httpx.get(self.url + "/policy", headers=headers(self.key), timeout=30)
            r.raise_for_status()
            self.workers = int(r.json()["workers"])
        return self.workers

    # ------------------------------------------------------------------ data plane
    def _open(self, sock: Any, world_size: int) -> Any:
        """The group as rank 0: the store's master on `sock` (bound to this side's
        address), waiting for every worker to join, then gloo on the same address."""
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

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
        gloo: Any = ProcessGroupGloo  # its `_Options` (the way to give it a device) is not in torch's stubs
        options = gloo._Options()
        options._timeout = timeout
        options._devices = [ProcessGroupGloo.create_device(hostname=self.host)]
        return ProcessGroupGloo(PrefixStore(store_prefix(self.host, port), store), 0, world_size, options)

    def _broadcast(self, named: Iterable[tuple[str, Any]], announced: dict[str, list]) -> int:
        """Send each tensor of `named`, checked against what was announced; bytes sent."""
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = 0
        sent, n, total = 0, 0, len(announced["names"])
        for n, (name, tensor) in enumerate(named, 1):
            if n > total:
                raise BroadcastError(f"{self.url}: more tensors than announced ({total}), from {name!r} on")
            want = (announced["names"][n - 1], announced["dtype_names"][n - 1], list(announced["shapes"][n - 1]))
            have = (name, dtype_name(tensor), list(tensor.shape))
            if have != want:
                raise BroadcastError(f"{self.url}: tensor {n - 1} is {have}, announced {want}")
            t = tensor.detach().cpu().contiguous()
            self.group.broadcast([t], options).wait()
            sent += t.numel() * t.element_size()
        if n != total:
            raise BroadcastError(f"{self.url}: {n} tensors sent, {total} announced")
        return sent

    # ------------------------------------------------------------------ lifecycle
    def join(self) -> dict:
        """Open the group with the server's workers (replacing any earlier one)."""
        self.close(leave=False)
        world_size = 1 + self._workers()
        sock = bound_socket(self.host)
        sock.listen()
        self.port = sock.getsockname()[1]
        body = {
            "master_address": self.host,
            "master_port": self.port,
            "world_size": world_size,
            "rank_offset": 1,
            "timeout_s": self.timeout_s,
        }
        try:
            reply, self.group = together(lambda: self._post(JOIN_PATH, body), lambda: self._open(sock, world_size))
        except BaseException:
            sock.close()
            raise
        return reply

    def send(self, step: int, named: Iterable[tuple[str, Any]], announced: Optional[dict[str, list]] = None) -> dict:
        """Make the server serve policy `step`: the tensors of `named` (checkpoint names,
        as the model's `named_parameters` or a HF state dict has them). `announced`
        (`announcement(...)`): what `named` will yield, so it can be a generator; without
        it `named` is read once into a list first. The server's answer, plus `bytes`."""
        if self.group is None:
            raise BroadcastError(f"{self.url}: no weight group (join first)")
        if announced is None:
            named = list(named)
            announced = announcement(named)
        body = {"step": int(step), **announced}
        items = named
        try:
            reply, sent = together(lambda: self._post(RECEIVE_PATH, body), lambda: self._broadcast(items, announced))
        except BaseException:
            self.group = None  # a collective may still be under way: unusable
            raise
        return {**reply, "bytes": sent}

    def close(self, leave: bool = True) -> None:
        """Leave the group (`leave`: the server first, so its workers drop their side)."""
        if self.group is None:
            return
        group, self.group = self.group, None
        try:
            if leave:
                self._post(LEAVE_PATH, {})
        finally:
            group.shutdown()

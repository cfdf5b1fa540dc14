"""Trainer rank 0's side of `weights.transport=broadcast`: every new policy sent straight to
every inference server of the run, in the background while the next step trains.

Consumes: `endpoints/<slot>.json` (each server's URL, polled every `POLL_S`) and the
policies `publish(step, named)` hands over (HF-named CPU tensors, what `weights/step_<n>`
would hold). Produces: each server serving the newest policy, through one
`prime_hpc.inference.broadcast.Broadcaster` per slot (its own weight group; joined as soon
as the server is published, joined again when the slot's URL or instance changes: a
restarted server or one of an extra job); `stats()`, the newest policy's delivery.

The job's key is never sent: each server is sent nothing until it has proven that it holds
the key as the server its endpoint names (`Broadcaster.expect`, `prove`), and every call
goes signed for that instance. A listener at a server's address that does not prove it
(someone else's on a dead server's freed port, before the supervisor removed its
endpoint) is lost, not failed: named in one line and skipped until a server publishes its
endpoint in that slot again.

Each server has a thread of its own, and `publish` never waits for any of them: a server
still busy with an older policy (slow, or frozen until the watchdog restarts it) gets the
newest one once it is free, skipping those in between, and delays no other server and not
the trainer. Only the newest policy is kept, so a server that joins later gets the current
one before the orchestrator routes to it. A server whose join or send fails is logged in
one line and left out for `RETRY_S` (15 s, then 60 s, then every 5 min), then joined
again and sent the newest policy, or at once when its endpoint changes (its supervisor
restarted it; a server that fails midway exits by itself); the trainer never fails for
one server.

Each policy is narrowed to the dtype the servers hold and digested (`Broadcaster.served`,
`Broadcaster.digests`, one SHA-256 per tensor as it goes) once per such dtype, by the first
thread that needs it, and kept with the policy (a float32 policy for bfloat16 servers: half
its bytes again in memory, each send then casts nothing). A server
that refuses a policy because what arrived differs from them (someone in its group, or on
its path, altered it: `DigestRefused`) is named in one line; the policy is then written to
`weights/step_<n>` (`write`, unless it is there already), which that server loads in its
place, and the server is joined again with a fresh group.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from loguru import logger

from prime_hpc.rundir import RunDir

POLL_S = 1.0  # how often endpoints/ is read
RETRY_S = (15.0, 60.0, 300.0)  # a server left out is joined again after these (then every last one)
KEPT_STEPS = 4  # deliveries remembered for stats(), newest first


@dataclass
class Link:
    """One server's weight group, as this side knows it; only its own thread touches
    `sender`."""

    slot: str
    url: str
    record: dict  # the endpoint the server published: what it must prove it is
    sender: Any  # a Broadcaster
    joined: bool = False
    sent: Optional[int] = None  # the newest policy it got from here
    busy: bool = False  # a join or send under way
    dropped: Optional[str] = None  # why it is left out (until `retry_at`, or its slot's URL changes)
    failures: int = 0  # joins or sends failed in a row
    retry_at: float = 0.0  # when a server left out is joined again (time.monotonic)
    closed: bool = False  # its slot is gone or taken by another server: the thread closes the group and ends
    thread: Optional[threading.Thread] = field(default=None, repr=False)


@dataclass
class Policy:
    step: int
    named: list  # [(name, tensor)]
    announced: dict
    at: float  # when it was published (time.monotonic)
    prepared: dict = field(default_factory=dict)  # a server's dtype -> (the policy as sent to it, its digests)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class WeightSender:
    """The background sender (rank 0 only). `make(url)`: a Broadcaster for a server (then
    told the endpoint it must prove it is: `expect`); `write(step, named)`: writes
    `weights/step_<step>` from a policy's HF-named tensors (for a server that refused what
    arrived by broadcast)."""

    def __init__(
        self,
        run: RunDir,
        make: Optional[Callable[[str], Any]] = None,
        poll_s: float = POLL_S,
        write: Optional[Callable[[int, dict], Any]] = None,
    ) -> None:
        if make is None:
            from prime_hpc.inference.broadcast import Broadcaster

            def make(url: str) -> Any:
                return Broadcaster(url, store_dir=run.rendezvous_dir)

        self.run = run
        self.make = make
        self.write = write
        self._writing = threading.Lock()  # one policy written at a time (two servers may refuse it)
        self.poll_s = poll_s
        self.links: dict[str, Link] = {}
        self.latest: Optional[Policy] = None
        self.delivered: dict[int, list[tuple[float, dict]]] = {}  # step -> [(seconds after publish, answer)]
        self._closed = False
        self._cv = threading.Condition()
        self._refreshing = threading.Lock()
        self._poller = threading.Thread(target=self._poll, name="prime-hpc-weight-endpoints", daemon=True)
        self._poller.start()

    # ------------------------------------------------------------------ the trainer's side
    def publish(self, step: int, named: dict[str, Any]) -> None:
        """Send policy `step` (`named`: HF name -> CPU tensor, owned by this sender from now
        on) to every server, in the background; returns at once."""
        from prime_hpc.inference.broadcast import announcement

        items = list(named.items())
        policy = Policy(int(step), items, announcement(items), time.monotonic())
        with self._cv:
            self.latest = policy
            self._cv.notify_all()

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until every server published now that is not left out has the newest
        policy (at most `timeout_s`); whether they all do."""
        self.refresh()
        with self._cv:
            return self._cv.wait_for(self._all_synced, timeout_s)

    def behind(self) -> list[str]:
        """The slots that still lack the newest policy (and are not left out)."""
        with self._cv:
            return [link.slot for link in self.links.values() if self._behind(link)]

    def stats(self) -> dict:
        """The newest policy delivered to any server: step, seconds from its publish to the
        last server that got it, servers, bytes, and the longest drain and load."""
        with self._cv:
            if not self.delivered:
                return {}
            step = max(self.delivered)
            got = self.delivered[step]
        return {
            "step": step,
            "seconds": max(s for s, _ in got),
            "servers": len(got),
            "bytes": max(int(a.get("bytes", 0)) for _, a in got),
            "drain": max(float(a.get("drain_s", 0.0)) for _, a in got),
            "load": max(float(a.get("load_s", 0.0)) for _, a in got),
        }

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every thread (after the exchange each has under way, at most `timeout_s`
        in all) and drop the groups."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        deadline = time.monotonic() + timeout_s
        self._poller.join(max(0.0, deadline - time.monotonic()))
        for link in list(self.links.values()):
            if link.thread is not None:
                link.thread.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ membership
    def _poll(self) -> None:
        while True:
            try:
                self.refresh()
            except Exception as e:  # endpoints/ unreadable for a moment: the next poll reads it again
                logger.warning(f"weights: reading the servers' endpoints failed: {type(e).__name__}: {e}")
            with self._cv:
                if self._cv.wait_for(lambda: self._closed, self.poll_s):
                    return

    def refresh(self) -> None:
        """Links as `endpoints/` says: a new slot or a new URL in a slot gets a fresh one
        (and its thread); a slot whose endpoint is gone loses its link."""
        with self._refreshing:  # one reading at a time: an older one never undoes a newer one
            self._refresh()

    def _refresh(self) -> None:
        published = self.run.server_endpoints()
        with self._cv:
            if self._closed:
                return
            for slot, link in list(self.links.items()):
                record = published.get(slot, {})
                if record.get("url") != link.url or record.get("instance") != link.record.get("instance"):
                    link.closed = True
                    del self.links[slot]
            for slot, record in published.items():
                url = record.get("url")
                if url and slot not in self.links:
                    link = Link(slot, str(url), dict(record), self._broadcaster(str(url), record))
                    link.thread = threading.Thread(
                        target=self._serve_link, args=(link,), name=f"prime-hpc-weights-{slot}", daemon=True
                    )
                    self.links[slot] = link
                    link.thread.start()
            self._cv.notify_all()

    def _broadcaster(self, url: str, record: dict) -> Any:
        """A Broadcaster for the server at `url`, which must prove it is the one `record` names."""
        sender = self.make(url)
        sender.expect(record)
        return sender

    # ------------------------------------------------------------------ one server's thread
    def _wanted(self, link: Link) -> bool:
        if link.dropped is not None:
            return time.monotonic() >= link.retry_at  # it is joined again (and sent the newest)
        return not link.joined or (self.latest is not None and link.sent != self.latest.step)

    def _left_out(self, link: Link) -> bool:
        return link.dropped is not None and time.monotonic() < link.retry_at

    def _behind(self, link: Link) -> bool:
        """Still busy with or lacking the newest policy, and not left out."""
        return not self._left_out(link) and (self._wanted(link) or link.busy)

    def _all_synced(self) -> bool:
        return not any(self._behind(link) for link in self.links.values())

    def _serve_link(self, link: Link) -> None:
        """Join `link`'s server, then send it each newest policy as long as its slot is
        this server's; a failure leaves it out."""
        while True:
            with self._cv:
                # timed: a server left out becomes wanted again by the clock alone
                while not (self._closed or link.closed or self._wanted(link)):
                    self._cv.wait(self.poll_s)
                if self._closed or link.closed:
                    break
                policy, link.busy = self.latest, True
            try:
                self._exchange(link, policy)
            finally:
                with self._cv:
                    link.busy = False
                    self._cv.notify_all()
        _shut(link)

    def _exchange(self, link: Link, policy: Optional[Policy]) -> None:
        what = "join"
        try:
            if link.dropped is not None:  # a retry: a fresh group (the old one is unusable)
                _shut(link)
                link.sender = self._broadcaster(link.url, link.record)
                link.dropped = None
            if not link.joined:
                t0 = time.monotonic()
                link.sender.join()
                link.joined = True
                logger.info(
                    f"weights: joined the weight group of {link.slot} ({link.url}) in {time.monotonic() - t0:.2f}s"
                )
            if policy is not None and link.sent != policy.step:  # a refused one: the server loads it from disk
                what = f"policy {policy.step}"
                named, digests = _prepared(policy, link.sender)
                answer = link.sender.send(policy.step, named, policy.announced, digests=digests)
                with self._cv:
                    link.sent, link.failures = policy.step, 0
                    self.delivered.setdefault(policy.step, []).append((time.monotonic() - policy.at, dict(answer)))
                    for old in sorted(self.delivered)[:-KEPT_STEPS]:
                        del self.delivered[old]
        except Exception as e:
            if policy is not None and _refused(e):
                self._refused(link, policy, e)
                return
            if _lost(e):
                self._lost(link, e)
                return
            with self._cv:
                wait = RETRY_S[min(link.failures, len(RETRY_S) - 1)]
                link.dropped, link.joined = f"{type(e).__name__}: {e}", False
                link.failures += 1
                link.retry_at = time.monotonic() + wait
            if not link.closed:
                logger.warning(
                    f"weights: {link.slot} ({link.url}) left out: {what} failed "
                    f"({(str(e).splitlines() or [''])[0][:300]}); joined again in {wait:g}s, "
                    "or at once if a new server takes its slot"
                )

    def _lost(self, link: Link, e: Exception) -> None:
        """The listener at `link`'s address is not the server its endpoint names: nothing
        more goes there (no retry: the slot's next endpoint brings a fresh link)."""
        with self._cv:
            link.dropped, link.joined, link.retry_at = f"{type(e).__name__}: {e}", False, float("inf")
        _shut(link)
        if not link.closed:
            logger.warning(
                f"weights: {link.slot} ({link.url}) lost: {(str(e).splitlines() or [''])[0][:300]}; "
                "nothing is sent there until a server publishes its endpoint in that slot again"
            )

    def _refused(self, link: Link, policy: Policy, e: Exception) -> None:
        """`link`'s server refused `policy`: what arrived differs from its digests. It loads
        the step from `weights/step_<n>`, written here unless it is there; the link joins a
        fresh group next (the server dropped its own)."""
        logger.warning(
            f"weights: {link.slot} ({link.url}) refused policy {policy.step}: {(str(e).splitlines() or [''])[0][:300]}; "
            f"it loads the step from {self.run.weights_step(policy.step)}"
        )
        try:
            with self._writing:
                if not self.run.has_weights(policy.step):
                    if self.write is None:
                        raise RuntimeError("this sender writes no weights")
                    self.write(policy.step, dict(policy.named))
        except Exception as w:
            logger.warning(
                f"weights: policy {policy.step} could not be written for {link.slot}: {type(w).__name__}: {w}; "
                "that server exits without serving what it refused and is restarted"
            )
        with self._cv:
            link.sent, link.joined = policy.step, False


def _refused(e: Exception) -> bool:
    from prime_hpc.inference.broadcast import DigestRefused

    return isinstance(e, DigestRefused)


def _lost(e: Exception) -> bool:
    from prime_hpc.inference.broadcast import Lost

    return isinstance(e, Lost)


def _prepared(policy: Policy, sender: Any) -> tuple[list, Optional[list[str]]]:
    """`policy` as `sender` sends it and its digests (None: a sender that sends none), made
    once per dtype the servers hold: narrowed once (not once per server), then hashed."""
    if not getattr(sender, "verified", False):
        return policy.named, None
    key = str(getattr(sender, "dtype", None))
    with policy.lock:
        if key not in policy.prepared:
            served = sender.served(policy.named)
            policy.prepared[key] = (served, sender.digests(served))
        return policy.prepared[key]


def _shut(link: Link) -> None:
    """Drop `link`'s group without asking its server (it is gone or replaced)."""
    try:
        link.sender.close(leave=False)
    except Exception:  # a group whose peer died: nothing to close cleanly
        pass

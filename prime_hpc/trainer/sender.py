"""Trainer rank 0's side of `weights.transport=broadcast`: every new policy sent straight to
every inference server of the run, in the background while the next step trains.

Consumes: `endpoints/<slot>.json` (each server's URL, polled every `POLL_S` and at each
publish) and the policies `publish(step, named)` hands over (HF-named CPU tensors, what
`weights/step_<n>` would hold). Produces: each server serving the newest policy, through
one `prime_hpc.inference.broadcast.Broadcaster` per slot (its own weight group; joined as
soon as the server is published, joined again when the slot's URL changes: a restarted
server or one of an extra job); `stats()`, the newest policy's send.

At most one exchange is under way: `publish` first waits for the previous one (the
overlap of the filesystem path: step n+1 trains while policy n travels). The newest
policy is kept, so a server that joins later (found between two publishes too) gets the
current one before the orchestrator routes to it. A server whose join or send fails is
logged in one line and left out until its endpoint changes (its supervisor restarts it;
a server that fails midway exits by itself); the trainer never fails for one server.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from loguru import logger

from prime_hpc.rundir import RunDir

POLL_S = 1.0  # how often endpoints/ is read between two publishes


@dataclass
class Link:
    """One server's weight group, as this side knows it."""

    slot: str
    url: str
    sender: Any  # a Broadcaster
    joined: bool = False
    sent: Optional[int] = None  # the newest policy it got from here
    dropped: Optional[str] = None  # why it is left out (until its slot's URL changes)
    answer: dict = field(default_factory=dict)  # the server's answer to the newest send


class WeightSender:
    """The background sender (rank 0 only). `make(url)`: a Broadcaster for a server."""

    def __init__(self, run: RunDir, make: Optional[Callable[[str], Any]] = None, poll_s: float = POLL_S) -> None:
        if make is None:
            from prime_hpc.inference.broadcast import Broadcaster

            make = Broadcaster
        self.run = run
        self.make = make
        self.poll_s = poll_s
        self.links: dict[str, Link] = {}
        self.latest: Optional[tuple[int, list, dict]] = None  # (step, [(name, tensor)], announcement)
        self.last: dict = {}  # the newest policy's send: step, seconds, servers, bytes, drain, load
        self._pending: Optional[tuple[int, list]] = None
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="prime-hpc-weight-sender", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the trainer's side
    def publish(self, step: int, named: dict[str, Any]) -> None:
        """Send policy `step` (`named`: HF name -> CPU tensor, owned by this sender from now
        on) to every server, in the background. Call `wait` first."""
        with self._cv:
            self._cv.wait_for(self._idle)
            self._pending = (int(step), list(named.items()))
            self._cv.notify_all()

    def wait(self) -> float:
        """Wait until nothing is being sent; the seconds waited."""
        t0 = time.perf_counter()
        with self._cv:
            self._cv.wait_for(self._idle)
        return time.perf_counter() - t0

    def stats(self) -> dict:
        return dict(self.last)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the background thread (after the exchange under way) and drop the groups."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            for link in self.links.values():
                _shut(link)

    def _idle(self) -> bool:
        return self._pending is None and not self._busy

    # ------------------------------------------------------------------ the background thread
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._pending is not None, timeout=self.poll_s)
                if self._closed:
                    return
                job, self._pending = self._pending, None
                self._busy = True
            try:
                if job is not None:
                    from prime_hpc.inference.broadcast import announcement

                    self.latest = (job[0], job[1], announcement(job[1]))
                self.sync(fresh=job is not None)
            except Exception as e:  # the thread must live on: the next publish waits for it
                logger.warning(f"weights: sending failed: {type(e).__name__}: {e}")
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def refresh(self) -> None:
        """Links as `endpoints/` says: a new slot or a new URL in a slot gets a fresh one;
        a slot whose endpoint is gone loses its link."""
        published = self.run.server_endpoints()
        for slot in [s for s in self.links if s not in published]:
            _shut(self.links.pop(slot))
        for slot, record in published.items():
            url = record.get("url")
            if not url:
                continue
            link = self.links.get(slot)
            if link is not None and link.url == url:
                continue
            if link is not None:
                _shut(link)
            self.links[slot] = Link(slot, str(url), self.make(str(url)))

    def sync(self, fresh: bool = False) -> None:
        """Join every new server and send the newest policy to every server that lacks it,
        all servers at once (`fresh`: a new policy, recorded in `last`)."""
        self.refresh()
        step = self.latest[0] if self.latest is not None else None
        todo = [
            link
            for link in self.links.values()
            if link.dropped is None and (not link.joined or (step is not None and link.sent != step))
        ]
        if not todo:
            if fresh:
                self.last = {"step": step, "seconds": 0.0, "servers": 0, "bytes": 0, "drain": 0.0, "load": 0.0}
            return
        t0 = time.monotonic()
        threads = [threading.Thread(target=self._serve, args=(link,), daemon=True) for link in todo]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if fresh:
            got = [link for link in self.links.values() if link.sent == step and link.answer]
            self.last = {
                "step": step,
                "seconds": time.monotonic() - t0,
                "servers": len(got),
                "bytes": max((int(link.answer.get("bytes", 0)) for link in got), default=0),
                "drain": max((float(link.answer.get("drain_s", 0)) for link in got), default=0.0),
                "load": max((float(link.answer.get("load_s", 0)) for link in got), default=0.0),
            }

    def _serve(self, link: Link) -> None:
        """Join `link`'s server if needed, then send it the newest policy; a failure drops it."""
        what = "join"
        try:
            if not link.joined:
                t0 = time.monotonic()
                link.sender.join()
                link.joined = True
                logger.info(
                    f"weights: joined the weight group of {link.slot} ({link.url}) in {time.monotonic() - t0:.2f}s"
                )
            if self.latest is not None:
                step, named, announced = self.latest
                what = f"policy {step}"
                link.answer = {}
                link.answer = link.sender.send(step, named, announced)
                link.sent = step
        except Exception as e:
            link.dropped = f"{type(e).__name__}: {e}"
            link.joined = False
            logger.warning(
                f"weights: {link.slot} ({link.url}) left out: {what} failed ({str(e).splitlines()[0][:300]}); "
                "it gets the current policy once a new server takes its slot"
            )


def _shut(link: Link) -> None:
    """Drop `link`'s group without asking its server (it is gone or replaced)."""
    try:
        link.sender.close(leave=False)
    except Exception:  # a group whose peer died: nothing to close cleanly
        pass

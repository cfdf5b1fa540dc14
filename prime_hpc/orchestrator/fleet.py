"""The fleet's membership: which inference servers the run generates with. A part of the
weight relay (it runs in the relay's task, between two weight updates, so a server that
joins never misses one).

Consumes: `endpoints/<slot>.json` (each server publishes its own once healthy and removes
it when it leaves; a supervisor removes the file of a server that died), polled every
`POLL_S`, and the admin client's losses (a server that stopped answering during an
update). Produces: a joining server first loaded with the relay's current policy (`load`,
to that server alone, once it proved it holds the job's key as the instance its endpoint
names: `inference.client.Admin.expect`; the router proves it again before it routes to
it), then added to the router (`/add_worker`, signed for the router that proved itself
against the group's `router.json`: `inference.client.RouterLink`; never the key), then a
member of every later update
(`Admin.add`); with `weights.transport=broadcast`, where the trainer sends a joining
server the current policy, `load` only says whether it has arrived (None: not yet)
and the server stays `loading weights` until it has (one line in the log after
`JOIN_TIMEOUT_S`; it goes on waiting); a server whose endpoint file is gone or was
replaced, or that stopped answering, taken out of the router and of later updates; the
relay's view of every
slot in `fleet/membership.json` (`rundir.fleet`: loading weights, serving, removed), which
`status` reads and a restarted router serves from.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Optional

from loguru import logger

from prime_hpc.inference.client import InferenceError, RouterLink, RouterURL, add_worker, forget_worker
from prime_hpc.rundir import RunDir, atomic_write_json, server_slot
from prime_hpc.rundir.fleet import LOADING, REMOVED, SERVING

POLL_S = 1.0  # how often endpoints/ is read
RETRY_S = 10.0  # a server that could not join is tried again after this
JOIN_TIMEOUT_S = 120.0  # loading the current policy into a joining server


class Membership:
    def __init__(
        self,
        run: RunDir,
        admin: Any,
        router: str,
        load: Callable[[str, dict], Awaitable[Optional[int]]],
    ) -> None:
        self.run = run
        self.kind = f"{run.group} server"  # "inference server", "teacher server": the log's word for one
        self.admin = admin
        # the router, proven against the group's router.json (`discover` gives one that is)
        self.router = router if isinstance(router, RouterURL) else RouterURL(router, RouterLink(run.router_endpoint))
        self.load = load  # load(url, endpoint record) -> the policy step it now serves (None: not yet)
        self.members: dict[str, dict] = {}  # slot -> the relay's record (rundir.fleet)
        self.failed_at: dict[str, float] = {}  # url -> when it last failed to join
        self.gone: set[str] = set()  # urls that left: a server never comes back at its old address
        self.warned: set[str] = set()  # urls named in the log for waiting long for their policy
        self.polled = float("-inf")
        self.tasks: set[asyncio.Task] = set()

    def start_with(self, records: list[dict], policy: int) -> None:
        """The servers the attempt started with: the router and the admin have them already."""
        expect = getattr(self.admin, "expect", None)
        for r in records:
            slot = r.get("slot") or server_slot(int(r.get("node", 0)))
            self.members[slot] = self._record(r, SERVING, policy)
            if expect is not None and r.get("url"):
                expect(str(r["url"]), r)
        self.write()

    def serving(self) -> int:
        return sum(1 for m in self.members.values() if m["state"] == SERVING)

    async def poll(self, force: bool = False) -> None:
        """Leaves, then joins, as `endpoints/` says (at most every `POLL_S` unless `force`)."""
        if not force and time.monotonic() - self.polled < POLL_S:
            return
        self.polled = time.monotonic()
        published = self.run.server_endpoints()
        for slot, m in list(self.members.items()):
            if m["state"] == REMOVED:
                continue
            record = published.get(slot)
            if record is None:
                self.leave(slot, "its endpoint was removed")
            elif record.get("url") != m["url"]:
                self.leave(slot, "a new server took its slot")
        for slot, record in published.items():
            member = self.members.get(slot)
            if member is not None and member["state"] == SERVING and member["url"] == record.get("url"):
                continue
            if record.get("url") in self.gone:  # its endpoint outlived it: its supervisor removes it
                continue
            if time.monotonic() - self.failed_at.get(str(record.get("url")), float("-inf")) < RETRY_S:
                continue
            await self.join(slot, record)

    async def join(self, slot: str, record: dict) -> None:
        url = str(record["url"])
        member = self.members.get(slot)
        if member is None or member["url"] != url or member["state"] != LOADING:
            self.members[slot] = self._record(record, LOADING, record.get("policy_step"))
            self.write()
        expect = getattr(self.admin, "expect", None)
        if expect is not None:  # it is sent nothing before it proves it is the server it published
            expect(url, record)
        try:
            step = await asyncio.wait_for(self.load(url, record), JOIN_TIMEOUT_S)
            if step is None:  # its policy is on its way (broadcast): asked again at the next poll
                self.still_loading(slot, url)
                return
            await add_worker(self.router, url)
        except (InferenceError, asyncio.TimeoutError) as e:
            self.failed_at[url] = time.monotonic()
            self.members[slot].update(state=REMOVED, since=time.time(), why=f"could not join: {e}")
            self.write()
            logger.warning(f"{self.kind} {slot} ({url}) could not join: {e}; trying again in {RETRY_S:g}s")
            return
        self.admin.add(url)
        self.members[slot].update(state=SERVING, since=time.time(), policy_step=step)
        self.write()
        logger.info(f"{self.kind} {slot} ({url}) joined at policy {step}; {self.serving()} serving")

    def still_loading(self, slot: str, url: str) -> None:
        """`slot` waits for the current policy: one line once it has waited `JOIN_TIMEOUT_S`."""
        waited = time.time() - float(self.members[slot].get("since", time.time()))
        if waited > JOIN_TIMEOUT_S and url not in self.warned:
            self.warned.add(url)
            logger.warning(
                f"{self.kind} {slot} ({url}) has not got the current policy after {waited:.0f}s; "
                "it is not routed until it has (the trainer sends it)"
            )

    def leave(self, slot: str, why: str) -> None:
        """`slot`'s server takes no more requests or updates (the router is told, best effort:
        it also finds a dead server by its own checks)."""
        m = self.members[slot]
        self.gone.add(m["url"])
        self.admin.remove(m["url"])
        m.update(state=REMOVED, since=time.time(), why=why)
        self.write()
        logger.warning(f"{self.kind} {slot} ({m['url']}) left: {why}; {self.serving()} serving")
        task = asyncio.get_running_loop().create_task(forget_worker(self.router, m["url"]))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def lost(self, url: str, why: str) -> None:
        """The admin client found `url` no longer answering (during an update)."""
        slot = self.slot_of(url)
        if slot is not None:
            self.leave(slot, f"it stopped answering ({why})")

    def updated(self, step: int) -> None:
        """Every serving member now serves `step`."""
        for m in self.members.values():
            if m["state"] == SERVING:
                m["policy_step"] = step
        self.write()

    def slot_of(self, url: str) -> Optional[str]:
        return next((s for s, m in self.members.items() if m["url"] == url and m["state"] != REMOVED), None)

    def write(self) -> None:
        atomic_write_json(
            self.run.fleet_membership, {"servers": self.members, "updated_at": time.time()}, durable=False
        )

    @staticmethod
    def _record(endpoint: dict, state: str, policy: Optional[int]) -> dict:
        return {
            "url": endpoint.get("url"),
            "state": state,
            "since": time.time(),
            "policy_step": policy,
            "node": endpoint.get("node"),
            "job_id": endpoint.get("job_id"),
            "hostname": endpoint.get("hostname"),
            "pid": endpoint.get("pid"),
        }


async def keep_fixed(
    run: RunDir,
    ep: Any,
    key: Optional[str],
    each: Callable[[Membership], None] = lambda m: None,
    prepare: Optional[Callable[[Any, str], Awaitable[None]]] = None,
) -> None:
    """Keep the membership of servers whose base model is never updated (a serve job's, the
    run's own teacher's, a job of several runs'; `run` names their group): a server
    restarted in its slot (a new URL) joins the router (`ep.router`) once it answers and
    `prepare(admin, url)` has made it ready (a job of several runs: every run's adapter
    loaded), one that is gone leaves it. `each(members)` after every poll; until cancelled.
    A poll that fails (a file being replaced on a shared filesystem, a router restarting)
    is logged and tried again at the next."""
    from prime_hpc.inference.client import Admin

    admin = Admin(list(ep.servers), key=key)

    async def ready(url: str, record: dict) -> int:
        if prepare is not None:
            await prepare(admin, url)
        return 0  # a server starts with the model it serves

    members = Membership(run, admin, ep.router, ready)
    try:
        members.start_with(list(run.server_endpoints().values()), 0)
        while True:
            each(members)
            try:
                await members.poll()
            except (OSError, ValueError, InferenceError) as e:
                logger.warning(f"{run.group} servers: their membership could not be updated ({e}); trying again")
            await asyncio.sleep(POLL_S)
    finally:
        await admin.aclose()

"""Which TCP sockets the processes of a run hold, read from /proc (no tools needed):
every process whose environment names the run's output dir (the launcher exports it to
every component; their children inherit it)."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
from pathlib import Path

from prime_hpc.rundir import RunDir
from tests import procs

LISTEN, ESTABLISHED = "0A", "01"


def _addr(hex_addr: str) -> str:
    ip_hex, _port = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(ip_hex, 16)))
    words = struct.unpack("<4I", raw)
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))


def _loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def run_pids(output_dir: Path) -> dict[int, str]:
    """{pid: command line} of the processes of the run in `output_dir` (they carry their
    attempt's log directory in their environment) and their children."""
    now = procs.table()
    roots = procs.with_env(f"PRIME_HPC_LOGS={RunDir(output_dir).logs_root}/", now, prefix=True)
    return {pid: cmd for pid in procs.descendants(roots, now) if (cmd := procs.cmdline(pid, limit=4096)) is not None}


def run_sockets(output_dir: Path) -> dict:
    """The run's published endpoint hosts, its listening sockets, those listening beyond
    loopback (`exposed`) and its connections to peers beyond loopback (`remote_peers`)."""
    pids = run_pids(output_dir)
    owner = {}
    for pid, cmd in pids.items():
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    owner[link[8:-1]] = cmd
        except OSError:
            continue
    listening, exposed, remote = [], [], []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            local, peer, state, inode = _addr(f[1]), _addr(f[2]), f[3], f[9]
            cmd = owner.get(inode)
            if cmd is None:
                continue
            if state == LISTEN:
                listening.append((local, cmd, int(f[1].split(":")[1], 16)))
                if not _loopback(local):
                    exposed.append((local, cmd))
            elif state == ESTABLISHED and not _loopback(peer):
                remote.append((local, peer, cmd))
    endpoints = []
    ep_dir = Path(output_dir) / "endpoints"
    for name in sorted(os.listdir(ep_dir)) if ep_dir.is_dir() else []:
        try:
            endpoints.append(json.loads((ep_dir / name).read_text())["host"])
        except (OSError, ValueError, KeyError):
            continue
    return {
        "pids": len(pids),
        "endpoints": endpoints,
        "listening": listening,
        "exposed": exposed,
        "remote_peers": remote,
    }


# What a caller without the job's key tries on every port: generation, an admin route, a
# non-preflight OPTIONS (the router's own routes included).
PROBES = (
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"POST /add_worker?url=http://127.0.0.1:1 HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    b"POST /update_weights HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
    b"Connection: close\r\n\r\n{}",
    b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
)


def probe(addr: str, port: int, request: bytes, timeout_s: float = 5.0) -> str:
    """What a listener answers to `request` sent without the key: its HTTP status
    ("401"), or "refused" (no connection), "closed" (closed without a word) or "silent"
    (accepted and answered nothing: not an HTTP listener)."""
    try:
        conn = socket.create_connection((addr, port), timeout=timeout_s)
    except OSError:
        return "refused"
    with conn:
        try:
            conn.sendall(request)
            data = conn.recv(64)
        except socket.timeout:
            return "silent"
        except OSError:
            return "closed"
    if not data:
        return "closed"
    if data.startswith(b"HTTP/"):
        return data.split(b" ", 2)[1].decode(errors="replace")
    return "not http: " + repr(data[:20])


def unkeyed_answers(output_dir: Path) -> dict[tuple[str, int, str], list[str]]:
    """{(address, port, command): [what PROBES got]} for every port a process of the run
    listens on, found from the processes' own sockets (a port that does not speak HTTP
    gets only the first probe)."""
    from concurrent.futures import ThreadPoolExecutor

    def answers(addr: str, port: int) -> list[str]:
        first = probe(addr, port, PROBES[0], timeout_s=2.0)
        if first in ("silent", "closed", "refused"):
            return [first]
        return [first, *(probe(addr, port, req) for req in PROBES[1:])]

    listening = run_sockets(output_dir)["listening"]
    with ThreadPoolExecutor(max_workers=16) as pool:
        got = list(pool.map(lambda x: answers(x[0], x[2]), listening))
    return {(addr, port, cmd): a for (addr, cmd, port), a in zip(listening, got)}

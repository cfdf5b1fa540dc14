"""Addresses and ports of this node. Servers bind to the node's address on a port the
kernel picks (several "nodes" may share one host), and publish address:port in the run
directory; nothing assumes a fixed free port.

Which address: `cluster.address` when the run sets one (`127.0.0.1` for `cluster=local`
and `cluster=dev`, where every "node" is this machine: then every socket of the run binds
to and talks over loopback), else the node's own routable address (real clusters). The
launcher exports the run's choice to every component (`one_host_env`)."""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Optional

LOOPBACK = "127.0.0.1"
ADDRESS_VAR = "PRIME_HPC_NODE_ADDRESS"  # override when the heuristics pick the wrong interface


def _routable(addr: str) -> bool:
    try:
        return not ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def node_address(configured: Optional[str] = None) -> str:
    """The IPv4 address this node's servers bind to and publish.

    `configured` (the run's `cluster.address`) if given; else `$PRIME_HPC_NODE_ADDRESS`
    if set; else what the hostname resolves to unless that is a
    loopback address (Debian maps the hostname to 127.0.1.1); else the address of the
    interface that routes outwards (a UDP connect sends no packet); else 127.0.0.1."""
    forced = configured or os.environ.get(ADDRESS_VAR)
    if forced:
        return forced
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if _routable(addr):
            return addr
    except OSError:
        pass
    for probe in ("10.255.255.255", "192.0.2.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                addr = s.getsockname()[0]
            if _routable(addr):
                return addr
        except OSError:
            continue
    return LOOPBACK


def address_env(address: Optional[str]) -> dict[str, str]:
    """Environment that makes every component of a run use `address` (nothing when the
    run uses each node's own address). On loopback the collective libraries are kept on
    the loopback interface too (they otherwise pick the interface the hostname maps to)."""
    if not address:
        return {}
    env = {ADDRESS_VAR: address, "VLLM_HOST_IP": address}  # vLLM's own connections (engine <-> workers)
    if is_loopback(address):
        env.update({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"})
    return env


def bound_socket(host: str) -> socket.socket:
    """A TCP socket bound to `host` on a port the kernel chose (kept open: no race)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s


def free_port(host: str) -> int:
    """A port free on `host` right now (for programs that only take a port number)."""
    with bound_socket(host) as s:
        return s.getsockname()[1]


def url(host: str, port: int) -> str:
    return f"http://{host}:{port}"


# How long a client keeps an idle pooled connection to a server of the run: well under the
# servers' own keep-alive (vLLM's and uvicorn's 5 s), so a request never goes out on a
# connection the server is closing at that moment (it would fail with a ReadError).
IDLE_CONNECTION_S = 1.0

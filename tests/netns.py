"""Network namespaces for end-to-end tests: PoPs joined to a router namespace by delayed links.

Each PoP gets a namespace and a veth pair to the router namespace (``10.77.<i>.1`` on the
router's side, ``10.77.<i>.2`` on the PoP's), all inside namespaces this module creates; the
host's own network is never touched. A link's delay is its added *round trip*, half per
direction: with the ``netem`` qdisc when the kernel has it, else by ``netns_relay.py``, which
listens on the PoP's address and holds every chunk for half the delay each way before passing
it to the daemon on the PoP's loopback. Either way the router dials the same ``10.77.<i>.2``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET = 0x40000000
RELAY = Path(__file__).with_name("netns_relay.py")


class NetnsError(RuntimeError):
    pass


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2 (the ip command) is not installed"
    probe = f"eiprobe-{uuid.uuid4().hex[:8]}"
    try:
        ip("netns", "add", probe)
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    ip("netns", "del", probe)
    return None


def enter(ns: str) -> None:
    """Move the calling *thread* into namespace ``ns`` (a ThreadPoolExecutor initializer):
    sockets it opens afterwards live there. Python 3.11 has no os.setns, hence libc."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({ns})")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Link:
    pop: str
    ns: str
    router_addr: str
    pop_addr: str
    delay_ms: float


class Topology:
    """A router namespace and one namespace per PoP; :meth:`down` removes them all."""

    def __init__(self, prefix: str, delays_ms: dict[str, float]) -> None:
        self.router_ns = f"{prefix}-rt"
        self.links = [
            Link(pop, f"{prefix}-{i}", f"10.77.{i}.1", f"10.77.{i}.2", delay)
            for i, (pop, delay) in enumerate(delays_ms.items(), start=1)
        ]
        self.mode = "relay"
        self._made: list[str] = []

    def up(self) -> None:
        for ns in [self.router_ns, *(link.ns for link in self.links)]:
            ip("netns", "add", ns)
            self._made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        for i, link in enumerate(self.links, start=1):
            # Created inside the namespaces, so no interface ever appears on the host.
            ip("-n", self.router_ns, "link", "add", f"r{i}", "type", "veth",
               "peer", "name", "p0", "netns", link.ns)  # fmt: skip
            ip("-n", self.router_ns, "addr", "add", f"{link.router_addr}/30", "dev", f"r{i}")
            ip("-n", link.ns, "addr", "add", f"{link.pop_addr}/30", "dev", "p0")
            ip("-n", self.router_ns, "link", "set", f"r{i}", "up")
            ip("-n", link.ns, "link", "set", "p0", "up")
        if _netem(self.router_ns, "r1", 0.5, probe=True):
            self.mode = "netem"
            for i, link in enumerate(self.links, start=1):
                _netem(self.router_ns, f"r{i}", link.delay_ms / 2)
                _netem(link.ns, "p0", link.delay_ms / 2)

    def down(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self._made.clear()

    def exec(self, ns: str, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *cmd]

    def daemon_host(self, link: Link) -> str:
        """Where a PoP's daemon binds: its link address, or loopback behind the relay."""
        return link.pop_addr if self.mode == "netem" else "127.0.0.1"

    def relay_cmd(self, link: Link, ports: list[int]) -> list[str] | None:
        """The relay to run in the PoP's namespace; None with netem (the kernel delays)."""
        if self.mode == "netem":
            return None
        args = ["--listen", link.pop_addr, "--target", "127.0.0.1"]
        args += ["--ports", ",".join(map(str, ports)), "--delay-ms", str(link.delay_ms)]
        return self.exec(link.ns, [sys.executable, str(RELAY), *args])


def _netem(ns: str, dev: str, delay_ms: float, probe: bool = False) -> bool:
    """Add a netem delay to ``dev``; with ``probe``, only report whether the kernel has netem
    ("Specified qdisc kind is unknown" where it has not)."""
    cmd = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{delay_ms}ms"]
    if shutil.which("tc") is None:
        return False
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if probe and done.returncode == 0:
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    if not probe and done.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done.returncode == 0

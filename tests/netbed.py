"""A network test bed of Linux network namespaces: a public "internet", NAT routers, shaped links.

Topology and address plan are in docs/testbed.md. Everything the bed creates is named with a short
prefix (`nb` + 5 hex digits), so leftovers of a crashed run are found by name (`cleanup_stale`) and
parallel runs never collide. Nothing is created in the root namespace: veth pairs are created with
both ends directly inside bed namespaces, and no namespace has a link out of the bed.

Stdlib only. The delay line (`python tests/netbed.py delayq ...`) is a tiny nfnetlink_queue client
written against the raw netlink socket, because this kernel has no netem.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import os
import random
import re
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

# --- address plan -------------------------------------------------------------------------------------
# The WAN ("internet") side uses 192.0.0.128/25: special-purpose (never globally routed) but, unlike the
# RFC 5737 documentation ranges, not classed as unroutable by go-multiaddr, so libp2p treats it as public
# (needed for hole punching). It exists only inside the bed's namespaces, behind the egress guard.
WAN_NET = ipaddress.ip_network("192.0.0.128/25")
WAN_GATEWAY = "192.0.0.129"  # the inet bridge's own address: every WAN host's default route, a dead end
WAN_FIRST_HOST = 130
LAN_NET = ipaddress.ip_network("10.201.0.0/16")  # LAN k = 10.201.k.0/24: router .1, host .2
BED_NETS = (str(WAN_NET), str(LAN_NET))

NAME_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31}$")
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{1,7}$")  # no '-': the namespace name is f"{prefix}-{node}"
STALE_PATTERN = r"^nb[0-9a-f]{5}-"  # what NetBed() names its namespaces by default
NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
STATE_DIR = Path("/run/netbed")  # <prefix>.owner: "pid starttime" of the process that owns the bed

GUARD_CHAIN = "NBGUARD"
SHAPE_CHAIN = "NBSHAPE"
QUEUE_NUM = 7  # NFQUEUE numbers are per namespace, so every delay line can use the same one
QUEUE_MS = 100  # the shaper's buffer, in ms at the link rate
CMD_TIMEOUT = 20.0
RESOLV_CONF = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"  # lookups fail fast, never leave


class NetBedError(RuntimeError):
    """A bed command failed (the message carries the command and its stderr)."""


class NetBedUnavailable(NetBedError):
    """This machine cannot build a bed (not root, tools missing, no namespace support)."""


# --- small helpers ------------------------------------------------------------------------------------


def _tool(name: str) -> str:
    """Full path of a system tool; /usr/sbin is searched even when PATH lacks it (non-login shells)."""
    path = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if path is None:
        raise NetBedUnavailable(f"`{name}` not found (Debian packages: iproute2, iptables)")
    return path


def _sh(argv: list[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a setup command with a bound on its time; failures raise with the command and its stderr."""
    try:
        res = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=CMD_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise NetBedError(f"timed out after {CMD_TIMEOUT}s: {' '.join(argv)}") from e
    if check and res.returncode != 0:
        raise NetBedError(f"failed ({res.returncode}): {' '.join(argv)}\n{res.stderr.strip()}")
    return res


def _in_ns(ns: str, argv: list[str]) -> list[str]:
    return [_tool("ip"), "netns", "exec", ns, *argv]


def _iptables(ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    return _sh(_in_ns(ns, [_tool("iptables"), "-w", "5", *args]))


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _list_netns() -> list[str]:
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def _proc_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the comm field may contain spaces


def _ns_pids(namespaces: Iterable[str]) -> list[int]:
    """Pids of every live process whose network namespace is one of `namespaces` (found via /proc)."""
    inodes = set()
    for ns in namespaces:
        with contextlib.suppress(OSError):
            st = os.stat(NETNS_DIR / ns)
            inodes.add((st.st_dev, st.st_ino))
    if not inodes:
        return []
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")  # fails for zombies and vanished pids
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in inodes:
            pids.append(int(entry.name))
    return pids


def _signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _kill_namespaces(
    namespaces: list[str],
    grace_s: float = 0.0,
    groups: Iterable[int] = (),
    spare: Iterable[int] = (),
    budget_s: float = 5.0,
) -> list[int]:
    """Stop every process in `namespaces`: SIGTERM first when grace_s > 0, SIGKILL after it.

    `groups` are process groups to signal as a whole (the bed's own children); each process gets one
    SIGTERM only, since a second one can cut a daemon's shutdown short. `spare` pids (the delay lines)
    get no SIGTERM, so links keep working while daemons shut down, and are SIGKILLed at the end.
    Returns the pids still alive.
    """
    groups, spare = set(groups), set(spare)
    if grace_s > 0:
        for g in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, signal.SIGTERM)
        others = [p for p in _ns_pids(namespaces) if p not in spare and _pgid(p) not in groups]
        _signal_pids(others, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while set(_ns_pids(namespaces)) - spare and time.monotonic() < deadline:
            time.sleep(0.05)
    deadline = time.monotonic() + budget_s
    for g in groups | spare:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGKILL)
    while (pids := _ns_pids(namespaces)) and time.monotonic() < deadline:
        _signal_pids(pids, signal.SIGKILL)
        time.sleep(0.05)
    return _ns_pids(namespaces)


def _delete_by_prefix(prefix: str) -> None:
    """Remove every namespace, /etc/netns dir, stray root link and state file named with `prefix`."""
    mine = [n for n in _list_netns() if n.startswith(f"{prefix}-")]
    leftover = _kill_namespaces(mine)
    if mine:
        batch = "".join(f"netns del {n}\n" for n in mine)
        _sh([_tool("ip"), "-force", "-batch", "-"], stdin=batch, check=False)
        if still := [n for n in _list_netns() if n.startswith(f"{prefix}-")]:
            raise NetBedError(f"could not delete namespaces {still}")
    # Never expected (veths are born inside bed namespaces), but a link named with the prefix in the
    # root namespace would be ours, so it is removed rather than left behind.
    links = _sh([_tool("ip"), "-o", "link", "show"], check=False).stdout
    for name in re.findall(rf"^\d+: ({re.escape(prefix)}[^:@\s]*)", links, flags=re.M):
        _sh([_tool("ip"), "link", "del", name], check=False)
    if ETC_NETNS.is_dir():
        for d in ETC_NETNS.glob(f"{prefix}-*"):
            shutil.rmtree(d, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        (STATE_DIR / f"{prefix}.owner").unlink()
    for stats in STATE_DIR.glob(f"{prefix}-*.line*") if STATE_DIR.is_dir() else ():
        stats.unlink(missing_ok=True)  # the delay lines' counters
    if leftover:
        raise NetBedError(f"processes {leftover} in {prefix}-* namespaces survived SIGKILL")


def _owner_alive(prefix: str) -> bool:
    try:
        pid_s, start = (STATE_DIR / f"{prefix}.owner").read_text().split()
    except (OSError, ValueError):
        return False
    return _proc_start_time(int(pid_s)) == start


def cleanup_stale(prefix_pattern: str = STALE_PATTERN) -> list[str]:
    """Tear down leftovers of crashed runs whose namespace names match `prefix_pattern` (a regex).

    Beds whose owning process is still alive (another test running in parallel) are left alone.
    Returns the prefixes removed.
    """
    rx = re.compile(prefix_pattern)
    names = [n for n in _list_netns() if rx.search(n)]
    if ETC_NETNS.is_dir():
        names += [d.name for d in ETC_NETNS.iterdir() if rx.search(d.name)]
    prefixes = sorted({n.split("-", 1)[0] for n in names})
    removed = []
    for prefix in prefixes:
        if not _owner_alive(prefix):
            _delete_by_prefix(prefix)
            removed.append(prefix)
    return removed


# --- capability check ---------------------------------------------------------------------------------


@cache
def _missing_capabilities() -> tuple[str, ...]:
    if sys.platform != "linux":
        return ("not Linux",)
    if os.geteuid() != 0:
        return ("not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)",)
    problems = []
    for tool in ("ip", "iptables", "iptables-restore", "tc"):
        try:
            _tool(tool)
        except NetBedUnavailable as e:
            problems.append(str(e))
    if problems:
        return tuple(problems)
    # Tools can exist where the kernel or the sandbox refuses namespaces, nftables or HTB: try them.
    prefix = NetBed._fresh_prefix()
    ns, dev = f"{prefix}-probe", f"{prefix}p"
    try:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{prefix}.owner").write_text(f"{os.getpid()} {_proc_start_time(os.getpid())}")
        _sh([_tool("ip"), "netns", "add", ns])
        _sh([_tool("ip"), "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", f"{dev}i"])
        _sh([_tool("tc"), "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"])
        _iptables(ns, "-A", "OUTPUT", "-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT")
        _iptables(ns, "-t", "mangle", "-A", "FORWARD", "-j", "NFQUEUE", "--queue-num", "1")
        _iptables(ns, "-t", "nat", "-A", "POSTROUTING", "-o", dev, "-j", "MASQUERADE")
    except (NetBedError, OSError) as e:
        return (f"namespace probe failed: {e}",)
    finally:
        with contextlib.suppress(NetBedError, OSError):
            _delete_by_prefix(prefix)
    return ()


def require_netns() -> None:
    """Skip (or, under CI=true, fail) when this machine cannot build a bed."""
    problems = _missing_capabilities()
    if not problems:
        return
    msg = "network test bed unavailable: " + "; ".join(problems)
    if _ci():
        raise NetBedUnavailable(msg + " (CI=true: a missing capability is a failure, not a skip)")
    try:
        import pytest
    except ImportError:
        raise NetBedUnavailable(msg) from None
    pytest.skip(msg + " (skipped because CI is not set; under CI=true this fails)")


# --- the bed ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """Emulated access link: both directions get the same rate, one-way delay and loss."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    loss: float = 0.0  # percent of packets dropped, each direction independently

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {self.rate_mbit}")
        if not 0 <= self.delay_ms <= 10_000:
            raise ValueError(f"delay_ms must be in [0, 10000], got {self.delay_ms}")
        if not 0 <= self.loss < 100:
            raise ValueError(f"loss must be a percentage in [0, 100), got {self.loss}")


@dataclass
class Node:
    name: str
    ns: str
    kind: str  # "inet" | "public" | "link" (a public host's shaping hop) | "nat" | "router"
    addrs: list[str] = field(default_factory=list)
    router: str | None = None  # nat host: its router's node name
    # where shaping is applied: (namespace, device) for upload and download HTB, and the delay-line ns
    up: tuple[str, str] | None = None
    down: tuple[str, str] | None = None
    delay_ns: str | None = None
    shape: Shape = field(default_factory=Shape)
    delay_proc: subprocess.Popen[bytes] | None = None
    hosts: dict[str, str] = field(default_factory=dict)


_open_beds: set[NetBed] = set()  # strong references: a bed nobody closed is still torn down at exit


@atexit.register
def _close_open_beds() -> None:
    for bed in list(_open_beds):
        if bed.owner_pid == os.getpid():  # never from a forked child that exits
            with contextlib.suppress(Exception):
                bed.close()


class NetBed:
    """Context manager building the bed; `close()` (always run by `with`) removes everything by name.

    >>> with NetBed() as bed:
    ...     bed.add_nat("a", rate_mbit=20, delay_ms=40)
    ...     server = bed.run("pub", ["python3", "-m", "http.server", "8000"])
    ...     bed.call("a", ["curl", f"http://{bed.addr('pub')}:8000/"])
    """

    def __init__(self, prefix: str | None = None, *, pub: bool = True, pub_extra_addrs: int = 0) -> None:
        self.prefix = prefix or self._fresh_prefix()
        if not PREFIX_RE.match(self.prefix):
            raise ValueError(f"prefix must match {PREFIX_RE.pattern}, got {self.prefix!r}")
        self._want_pub = pub
        self._pub_extra = pub_extra_addrs
        self.nodes: dict[str, Node] = {}
        self._procs: list[subprocess.Popen[Any]] = []
        self._next_index = 1
        self._next_wan = WAN_FIRST_HOST
        self._dns: dict[str, str] = {}
        self._built = False
        self._closed = False
        self.owner_pid = os.getpid()

    # lifecycle

    @staticmethod
    def _fresh_prefix() -> str:
        while True:
            prefix = f"nb{secrets.token_hex(3)[:5]}"
            taken = any(n.startswith(f"{prefix}-") for n in _list_netns())
            if not taken and not (STATE_DIR / f"{prefix}.owner").exists():
                return prefix

    def __enter__(self) -> NetBed:
        try:
            self.build()
        except BaseException:
            self.close()  # __exit__ does not run when __enter__ raises
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        """Create the inet bridge and (unless pub=False) the public host `pub`."""
        if self._built:
            return
        self._built = True
        _open_beds.add(self)
        # The owner file comes first, so that a crash at any later point leaves a bed that
        # cleanup_stale recognises as abandoned (its owner pid is gone).
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        me = os.getpid()
        (STATE_DIR / f"{self.prefix}.owner").write_text(f"{me} {_proc_start_time(me)}")
        inet = self._new_ns("inet", "inet")
        br = self._dev("br")
        _sh([_tool("ip"), "-n", inet.ns, "link", "add", br, "type", "bridge", "mcast_snooping", "0"])
        _sh([_tool("ip"), "-n", inet.ns, "addr", "add", f"{WAN_GATEWAY}/{WAN_NET.prefixlen}", "dev", br])
        _sh([_tool("ip"), "-n", inet.ns, "link", "set", br, "up"])
        if self._want_pub:
            self.add_public("pub", extra_addrs=self._pub_extra)

    def close(self, grace_s: float = 3.0) -> None:
        """Stop every process (SIGTERM, then SIGKILL after grace_s), delete everything named with the prefix."""
        if self._closed:
            return
        self._closed = True
        _open_beds.discard(self)
        try:
            self._stop_processes(grace_s)
        finally:
            _delete_by_prefix(self.prefix)

    def _stop_processes(self, grace_s: float) -> None:
        # Groups only of leaders not yet reaped: a reaped leader's pid may already belong to someone
        # else (pid_max can be 32768). Whatever escaped its group is found by its namespace instead.
        lines = {
            n.delay_proc.pid for n in self.nodes.values() if n.delay_proc and n.delay_proc.poll() is None
        }
        groups = {p.pid for p in self._procs if p.poll() is None} - lines
        namespaces = [n.ns for n in self.nodes.values()]
        _kill_namespaces(namespaces, grace_s=grace_s, groups=groups, spare=lines)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=2)  # reap, so no zombie outlives the bed
            for pipe in (p.stdin, p.stdout, p.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()

    # building blocks

    def _dev(self, tag: str) -> str:
        return f"{self.prefix}{tag}"  # interface names are limited to 15 characters

    def _new_ns(self, name: str, kind: str, k: int = 0, symmetric: bool = False) -> Node:
        if self._closed:
            raise NetBedError("bed is closed")
        if not self._built:
            self.build()
        if name in self.nodes or not NAME_RE.match(name):
            raise ValueError(f"bad or duplicate node name {name!r} (want {NAME_RE.pattern}, unique)")
        node = Node(name=name, ns=f"{self.prefix}-{name}", kind=kind)
        self.nodes[name] = node  # recorded before creation: teardown finds it even if setup fails
        _sh([_tool("ip"), "netns", "add", node.ns])
        self._write_etc(node)
        # IPv6 off before any interface exists, so that none gets a link-local address.
        sysctls = {"ipv6/conf/all/disable_ipv6": 1, "ipv6/conf/default/disable_ipv6": 1}
        if kind in ("router", "link"):
            sysctls["ipv4/ip_forward"] = 1
        if kind == "link":  # a transparent hop: answers ARP for both sides, never redirects
            sysctls |= {"ipv4/conf/all/proxy_arp": 1, "ipv4/conf/all/send_redirects": 0}
        script = "".join(f"echo {v} > /proc/sys/net/{k_}\n" for k_, v in sysctls.items())
        _sh(_in_ns(node.ns, ["sh", "-ec", script + f"{_tool('ip')} link set lo up\n"]))
        _sh(_in_ns(node.ns, [_tool("iptables-restore"), "-w", "5"]), stdin=self._rules(kind, k, symmetric))
        return node

    def _rules(self, kind: str, k: int, symmetric: bool) -> str:
        """iptables-restore input: the egress guard everywhere, NAT and a stateful firewall on routers."""
        guard = "".join(f"-A {GUARD_CHAIN} -d {net} -j RETURN\n" for net in BED_NETS)
        filt = (
            f"*filter\n:INPUT ACCEPT [0:0]\n:FORWARD {'DROP' if kind == 'router' else 'ACCEPT'} [0:0]\n"
            f":OUTPUT ACCEPT [0:0]\n:{GUARD_CHAIN} - [0:0]\n"
            # loopback never leaves; everything else must be addressed inside the bed or is dropped
            f"-A OUTPUT -o lo -j ACCEPT\n-A OUTPUT -j {GUARD_CHAIN}\n-A FORWARD -j {GUARD_CHAIN}\n"
            f"{guard}-A {GUARD_CHAIN} -j DROP\n"
        )
        mangle = f"*mangle\n:{SHAPE_CHAIN} - [0:0]\n"
        nat = ""
        if kind == "router":
            wan, lan = self._dev(f"r{k}w"), self._dev(f"r{k}l")
            # Stateful NAT: replies and related ICMP come back in; NEW connections from the WAN side are
            # DROPped (never rejected: a RST or ICMP error would break hole punching).
            filt += (
                "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
                f"-A FORWARD -i {lan} -o {wan} -j ACCEPT\n"
                f"-A INPUT -i {wan} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
                f"-A INPUT -i {wan} -p icmp --icmp-type echo-request -j ACCEPT\n"
                f"-A INPUT -i {wan} -j DROP\n"
            )
            mangle += f"-A FORWARD -j {SHAPE_CHAIN}\n"
            masq = "MASQUERADE --random-fully" if symmetric else "MASQUERADE"
            nat = f"*nat\n-A POSTROUTING -o {wan} -j {masq}\nCOMMIT\n"
        elif kind == "link":
            mangle += f"-A FORWARD -j {SHAPE_CHAIN}\n"
        return filt + "COMMIT\n" + mangle + "COMMIT\n" + nat

    def _wan_addr(self) -> str:
        if self._next_wan > 254:
            raise NetBedError("out of WAN addresses (192.0.0.130-254)")
        addr = str(WAN_NET.network_address + self._next_wan - 128)
        self._next_wan += 1
        return addr

    def _attach_to_inet(self, ns: str, dev: str, addrs: list[str]) -> str:
        """veth from `ns` to the inet bridge; returns the bridge-side device name."""
        inet, peer = self.nodes["inet"].ns, f"{dev}i"
        ip = _tool("ip")
        self._veth(inet, peer, ns, dev)
        _sh([ip, "-n", inet, "link", "set", peer, "master", self._dev("br"), "up"])
        for a in addrs:
            _sh([ip, "-n", ns, "addr", "add", f"{a}/{WAN_NET.prefixlen}", "dev", dev])
        _sh([ip, "-n", ns, "link", "set", dev, "up"])
        _sh([ip, "-n", ns, "route", "add", "default", "via", WAN_GATEWAY])
        return peer

    def _veth(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
        """A veth pair born with its ends inside two bed namespaces (never in the root namespace)."""
        ip = _tool("ip")
        _sh([ip, "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b])
        _sh([ip, "-n", ns_a, "link", "set", dev_a, "up"])

    # public API: topology

    def add_public(
        self,
        name: str,
        *,
        rate_mbit: float | None = None,
        delay_ms: float = 0.0,
        loss: float = 0.0,
        extra_addrs: int = 0,
    ) -> str:
        """A host directly on the internet; `extra_addrs` more WAN addresses (e.g. for several relays).

        Its access link runs through `<name>-link`, a transparent proxy-ARP router where the link is
        shaped. Delaying in the host's own namespace would not do: queued packets would still count
        against the sending socket's TCP small-queue budget and throttle TCP to a trickle (netem
        orphans its packets for that reason). The host keeps its /25 and sees the others on-link.
        """
        shape = Shape(rate_mbit, delay_ms, loss)
        self._check_host_name(name)
        k = self._take_index()
        link = self._new_ns(f"{name}-link", "link", k)
        host = self._new_ns(name, "public", k)
        wan, lan, hdev = self._dev(f"r{k}w"), self._dev(f"r{k}l"), self._dev(f"h{k}")
        # The link needs an address of its own: proxy ARP answers no request sent from 0.0.0.0, and the
        # links of two public hosts must resolve each other's hosts.
        host.addrs = [self._wan_addr() for _ in range(1 + extra_addrs)]  # first: pub is always .130
        link.addrs = [self._wan_addr()]
        self._attach_to_inet(link.ns, wan, link.addrs)
        self._veth(link.ns, lan, host.ns, hdev)
        ip = _tool("ip")
        for a in host.addrs:
            _sh([ip, "-n", host.ns, "addr", "add", f"{a}/{WAN_NET.prefixlen}", "dev", hdev])
            _sh([ip, "-n", link.ns, "route", "add", f"{a}/32", "dev", lan])
        _sh([ip, "-n", host.ns, "link", "set", hdev, "up"])
        _sh([ip, "-n", host.ns, "route", "add", "default", "via", WAN_GATEWAY])
        # Proxy ARP replies are otherwise held back by up to proxy_delay (0.8 s) each.
        script = "".join(f"echo 0 > /proc/sys/net/ipv4/neigh/{d}/proxy_delay\n" for d in (wan, lan))
        _sh(_in_ns(link.ns, ["sh", "-ec", script]))
        host.up, host.down, host.delay_ns = (link.ns, wan), (link.ns, lan), link.ns
        self._route_all_lans(link)
        self._route_all_lans(host)
        self._apply_shape(host, shape)
        return host.addrs[0]

    def add_nat(
        self,
        name: str,
        *,
        rate_mbit: float | None = None,
        delay_ms: float = 0.0,
        loss: float = 0.0,
        symmetric: bool = False,
    ) -> str:
        """A host behind its own NAT router `<name>-rtr`; returns the host's LAN address.

        `symmetric` picks a random external port per connection (MASQUERADE --random-fully), which
        defeats hole punching; the default keeps source ports (endpoint-independent mapping).
        """
        shape = Shape(rate_mbit, delay_ms, loss)
        self._check_host_name(name)
        k = self._take_index()
        if k > 254:
            raise NetBedError("out of LAN subnets")
        router = self._new_ns(f"{name}-rtr", "router", k, symmetric)
        host = self._new_ns(name, "nat", k)
        wan, lan, hdev = self._dev(f"r{k}w"), self._dev(f"r{k}l"), self._dev(f"h{k}")
        router.addrs = [self._wan_addr(), f"10.201.{k}.1"]
        host.addrs, host.router = [f"10.201.{k}.2"], router.name
        self._attach_to_inet(router.ns, wan, router.addrs[:1])
        self._veth(router.ns, lan, host.ns, hdev)
        ip = _tool("ip")
        _sh([ip, "-n", router.ns, "addr", "add", f"10.201.{k}.1/24", "dev", lan])
        _sh([ip, "-n", router.ns, "link", "set", lan, "up"])
        _sh([ip, "-n", host.ns, "addr", "add", f"10.201.{k}.2/24", "dev", hdev])
        _sh([ip, "-n", host.ns, "link", "set", hdev, "up"])
        _sh([ip, "-n", host.ns, "route", "add", "default", "via", f"10.201.{k}.1"])
        host.up, host.down, host.delay_ns = (router.ns, wan), (router.ns, lan), router.ns
        self._route_all_lans(router)
        self._route_lan_everywhere(host)
        self._apply_shape(host, shape)
        return host.addrs[0]

    def _check_host_name(self, name: str) -> None:
        # "inet", "<x>-rtr" and "<x>-link" are the bed's own nodes; checked before anything is created
        reserved = name == "inet" or name.endswith(("-rtr", "-link"))
        if reserved or name in self.nodes or not NAME_RE.match(name):
            raise ValueError(f"bad or duplicate host name {name!r} (want {NAME_RE.pattern}, unique)")

    def _take_index(self) -> int:
        k = self._next_index
        self._next_index += 1
        return k

    def _route_all_lans(self, wan_host: Node) -> None:
        """Give a new WAN-side node (public host, its link, a router) routes to every existing NAT LAN."""
        for nat in self.nodes.values():
            if nat.kind == "nat" and nat.router != wan_host.name and nat.addrs:
                self._route(wan_host, nat)

    def _route_lan_everywhere(self, nat: Node) -> None:
        """Give every other WAN-side node a route to a new NAT LAN."""
        for other in self.nodes.values():
            if other.kind in ("public", "link", "router") and other.name != nat.router:
                self._route(other, nat)

    def _route(self, wan_host: Node, nat: Node) -> None:
        # "Cannot reach a NATed host" must be enforced by the NAT's firewall, as on the real internet,
        # and not by a missing route: every WAN host routes each LAN to its router.
        router = self.nodes[nat.router or ""]
        net = ipaddress.ip_network(f"{nat.addrs[0]}/24", strict=False)
        _sh([_tool("ip"), "-n", wan_host.ns, "route", "replace", str(net), "via", router.addrs[0]])

    # public API: shaping

    def shape(
        self,
        host: str,
        *,
        rate_mbit: float | None = None,
        delay_ms: float = 0.0,
        loss: float = 0.0,
        download_only: bool = False,
    ) -> None:
        """(Re)shape a host's access link at any time; all-defaults removes shaping. `download_only` limits
        the rate towards the host only (a link that uploads fine but whose downloads starve)."""
        node = self._node(host, kinds=("public", "nat"))
        self._apply_shape(node, Shape(rate_mbit, delay_ms, loss), download_only=download_only)

    def _apply_shape(self, node: Node, shape: Shape, *, download_only: bool = False) -> None:
        assert node.up and node.down and node.delay_ns
        _iptables(node.delay_ns, "-t", "mangle", "-F", SHAPE_CHAIN)  # unhook first: no packet is lost
        self._stop_delay_line(node)
        for ns, dev in (node.up, node.down):
            _sh([_tool("tc"), "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        node.shape = shape
        if shape.rate_mbit is not None:
            kbit = max(8, round(shape.rate_mbit * 1000))
            # A router-like buffer of QUEUE_MS at the link rate, in bytes: a packet-count limit would let
            # 64 KB GSO packets pile up seconds of queue. Never below a few GSO packets, or none fits.
            limit = max(round(kbit * 1000 / 8 * QUEUE_MS / 1000), 192 * 1024)
            for ns, dev in (node.down,) if download_only else (node.up, node.down):
                batch = (
                    f"qdisc add dev {dev} root handle 1: htb default 1\n"
                    f"class add dev {dev} parent 1: classid 1:1 htb rate {kbit}kbit ceil {kbit}kbit quantum 1514\n"
                    f"qdisc add dev {dev} parent 1:1 handle 10: bfifo limit {limit}\n"
                )
                _sh([_tool("tc"), "-n", ns, "-batch", "-"], stdin=batch)
        if shape.delay_ms > 0 or shape.loss > 0:
            node.delay_proc = self._start_delay_line(node.delay_ns, shape)
            # No --queue-bypass: should the delay line die, the link goes down (loud) rather than
            # silently losing its delay; `check()` names the dead line.
            nfqueue = ["-j", "NFQUEUE", "--queue-num", str(QUEUE_NUM)]
            _iptables(node.delay_ns, "-t", "mangle", "-A", SHAPE_CHAIN, *nfqueue)

    def _line_stats(self, ns: str) -> Path:
        return STATE_DIR / f"{ns}.line"  # ns starts with the bed's prefix: removed with the bed

    def line_counts(self, name: str) -> tuple[int, int]:
        """(dropped, seen) packets of the delay line on `name`'s link so far (updated about once a second)."""
        node = self.nodes[name]
        assert node.delay_ns is not None, f"{name} has no shaped link"
        dropped, seen = self._line_stats(node.delay_ns).read_text().split()
        return int(dropped), int(seen)

    def _start_delay_line(self, ns: str, shape: Shape) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-I", "-S", str(Path(__file__).resolve()), "delayq"]
        argv += ["--queue", str(QUEUE_NUM), "--delay-ms", str(shape.delay_ms), "--loss", str(shape.loss)]
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        argv += ["--stats", str(self._line_stats(ns))]
        p = self._popen(ns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # The NFQUEUE rule is added only once the line is bound (bounded wait for its "ready" line):
        # packets queued to an unbound queue would be dropped.
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 10.0)
        line = p.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            err = p.communicate(timeout=5)[1].decode(errors="replace") if p.stderr else ""
            raise NetBedError(f"delay line in {ns} did not start: {line!r} {err.strip()}")
        return p

    def _stop_delay_line(self, node: Node) -> None:
        p, node.delay_proc = node.delay_proc, None
        if p is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=3)

    def check(self) -> None:
        """Raise if a delay line died (its link is down then); the fixture calls this after each test."""
        dead = []
        for node in self.nodes.values():
            p = node.delay_proc
            if p is not None and p.poll() is not None:
                err = p.stderr.read().decode(errors="replace").strip() if p.stderr else ""
                dead.append(f"{node.name}: exit {p.returncode} {err[-500:]}")
        if dead:
            raise NetBedError("delay line(s) died: " + "; ".join(dead))

    # public API: processes

    def _node(self, host: str, kinds: tuple[str, ...] = ("inet", "public", "link", "nat", "router")) -> Node:
        node = self.nodes.get(host)
        if node is None or node.kind not in kinds:
            raise KeyError(
                f"no {'/'.join(kinds)} node {host!r} in bed {self.prefix} (have {sorted(self.nodes)})"
            )
        return node

    def ns(self, host: str) -> str:
        """The namespace name of a node (for `ip netns exec` by hand)."""
        return self._node(host).ns

    def _popen(self, ns: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        for k in ("start_new_session", "process_group", "preexec_fn"):
            if k in kwargs:
                raise ValueError(f"{k} is set by the bed (every process gets its own session)")
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        # Forget children the caller already reaped; anything they left behind is found by namespace.
        self._procs = [p for p in self._procs if p.returncode is None]
        p = subprocess.Popen(_in_ns(ns, argv), start_new_session=True, **kwargs)
        self._procs.append(p)
        return p

    def run(self, host: str, argv: list[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside `host`'s namespace, in its own session; reaped (as a group) on close."""
        return self._popen(self._node(host).ns, argv, **popen_kwargs)

    def call(
        self, host: str, argv: list[str], timeout: float = 10.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in `host` to completion (text output captured); killed after `timeout` s."""
        p = self.run(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=5)
            raise
        res = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check and res.returncode != 0:
            raise NetBedError(
                f"{argv[0]} … {argv[-1]} in {host} failed ({res.returncode}): {err.strip()[-2000:]}"
            )
        return res

    # public API: addresses, names

    def addr(self, host: str) -> str:
        """The host's own address: a WAN address for public hosts and routers, a LAN address behind NAT."""
        node = self._node(host)
        if not node.addrs:
            raise KeyError(f"{host!r} has no address (the inet bridge is transparent)")
        return node.addrs[0]

    def public_addr(self, host: str) -> str:
        """The address others see: the router's WAN address for a NATed host."""
        node = self._node(host)
        return self.addr(node.router) if node.router else node.addrs[0]

    def addrs(self, host: str) -> list[str]:
        """All WAN addresses of a public host (primary first), or the one address of any other node."""
        node = self._node(host)
        return list(node.addrs[:1] if node.kind == "router" else node.addrs)

    def set_hosts(self, host: str, entries: Mapping[str, str]) -> None:
        """Add `name -> ip` entries to `host`'s /etc/hosts (seen by processes started afterwards)."""
        node = self._node(host)
        node.hosts.update(entries)
        self._write_etc(node)

    def add_dns(self, name: str, ip: str) -> None:
        """Make `name` resolve to `ip` in every namespace of the bed, present and future."""
        self._dns[name] = ip
        for node in self.nodes.values():
            self._write_etc(node)

    def _write_etc(self, node: Node) -> None:
        # `ip netns exec` bind-mounts /etc/netns/<ns>/* over /etc/*: a per-namespace hosts file, and a
        # resolv.conf whose lookups fail at once inside the bed instead of trying the host's resolver.
        d = ETC_NETNS / node.ns
        d.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [f"{ip} {name}" for name, ip in {**self._dns, **node.hosts}.items()]
        (d / "hosts").write_text("\n".join(lines) + "\n")
        (d / "resolv.conf").write_text(RESOLV_CONF)

    # public API: the egress guard

    def guard_report(self) -> dict[str, int]:
        """Packets dropped by the egress guard, per node (anything that tried to leave the bed)."""
        report = {}
        for node in self.nodes.values():
            out = _iptables(node.ns, "-L", GUARD_CHAIN, "-n", "-v", "-x").stdout
            report[node.name] = sum(int(line.split()[0]) for line in out.splitlines() if " DROP " in line)
        return report

    def guard_violations(self) -> int:
        """Total packets dropped by the egress guard in all namespaces; 0 means nothing tried to leave."""
        return sum(self.guard_report().values())


# --- the delay line: a minimal nfnetlink_queue client -------------------------------------------------
# Packets stay in the kernel; we receive only metadata (COPY_META) and give verdicts. With a constant
# delay the line is FIFO, so one VERDICT_BATCH (accept every queued id <= n) releases all due packets.

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NF_DROP, NF_ACCEPT = 0, 1


def _nlattr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def _nfq_msg(msg: int, queue: int, attrs: list[bytes], flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack(">H", queue) + b"".join(attrs)
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, 0, 0) + body


def _nfq_open(queue: int, gso: bool) -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    with contextlib.suppress(OSError):  # SO_RCVBUFFORCE: a burst must not overflow the socket
        sock.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)
    flags = NFQA_CFG_F_GSO if gso else 0
    attrs = [
        _nlattr(NFQA_CFG_CMD, struct.pack("=BB", NFQNL_CFG_CMD_BIND, 0) + struct.pack(">H", 0)),
        _nlattr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META)),
        _nlattr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", 100_000)),
        _nlattr(NFQA_CFG_FLAGS, struct.pack(">I", flags)),
        _nlattr(NFQA_CFG_MASK, struct.pack(">I", NFQA_CFG_F_GSO)),
    ]
    sock.send(_nfq_msg(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK))
    reply = sock.recv(65536)
    kind, err = struct.unpack_from("=H", reply, 4)[0], struct.unpack_from("=i", reply, 16)[0]
    if kind != NLMSG_ERROR or err != 0:
        raise OSError(-err, f"binding NFQUEUE {queue}: {os.strerror(-err) if err else kind}")
    return sock


def _packet_ids(datagram: bytes) -> Iterable[int]:
    """Packet ids of the NFQNL_MSG_PACKET messages in one netlink datagram."""
    off = 0
    while off + 16 <= len(datagram):
        length, kind = struct.unpack_from("=IH", datagram, off)
        if length < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            a, end = off + 20, off + length
            while a + 4 <= end:
                alen, atype = struct.unpack_from("=HH", datagram, a)
                if alen < 4:
                    break
                if atype & 0x3FFF == NFQA_PACKET_HDR:
                    yield struct.unpack_from(">I", datagram, a + 4)[0]
                    break
                a += (alen + 3) & ~3
        off += (length + 3) & ~3


def delay_line(queue: int, delay_ms: float, loss: float, stats: Path | None = None) -> None:
    """Hold every packet of NFQUEUE `queue` for delay_ms, dropping `loss` percent; runs until SIGTERM.
    With `stats`, "<dropped> <seen>" is kept there (rewritten whole about once a second)."""
    # Unsegmented GSO packets are cheap to queue, but one dropped GSO packet would be a burst of lost
    # segments; with loss the kernel segments them first, so loss is per wire packet.
    sock = _nfq_open(queue, gso=loss == 0)
    with contextlib.suppress(OSError):
        os.nice(-10)  # precedence over busy neighbours: scheduling latency adds straight to the delay
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print("ready", flush=True)
    delay, p_loss, rng = delay_ms / 1000.0, loss / 100.0, random.Random()
    pending: deque[tuple[float, int]] = deque()  # (due time, packet id), FIFO
    seen = dropped = 0
    reported = time.monotonic()
    while not stop:
        if stats is not None and time.monotonic() - reported >= 1.0:
            _write_counts(stats, dropped, seen)
            reported = time.monotonic()
        timeout = 0.5 if not pending else max(0.0, pending[0][0] - time.monotonic())
        with contextlib.suppress(InterruptedError):
            select.select([sock], [], [], timeout)
        while True:  # drain everything queued in the socket
            try:
                datagram = sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:  # ENOBUFS: the kernel dropped messages (and their packets); carry on
                continue
            now = time.monotonic()
            for pid in _packet_ids(datagram):
                seen += 1
                if p_loss and rng.random() < p_loss:
                    dropped += 1
                    verdict = struct.pack(">II", NF_DROP, pid)
                    sock.send(_nfq_msg(NFQNL_MSG_VERDICT, queue, [_nlattr(NFQA_VERDICT_HDR, verdict)]))
                else:
                    pending.append((now + delay, pid))
        now, last = time.monotonic(), None
        while pending and pending[0][0] <= now:
            last = pending.popleft()[1]
        if last is not None:
            verdict = struct.pack(">II", NF_ACCEPT, last)
            sock.send(_nfq_msg(NFQNL_MSG_VERDICT_BATCH, queue, [_nlattr(NFQA_VERDICT_HDR, verdict)]))


def _write_counts(path: Path, dropped: int, seen: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{dropped} {seen}\n")
    tmp.replace(path)  # a reader never sees half a line


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="netbed helpers (run inside a bed namespace)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    dq = sub.add_parser("delayq", help="NFQUEUE delay line")
    dq.add_argument("--queue", type=int, default=QUEUE_NUM)
    dq.add_argument("--delay-ms", type=float, default=0.0)
    dq.add_argument("--loss", type=float, default=0.0)
    dq.add_argument("--stats", type=Path, default=None, help="keep '<dropped> <seen>' in this file")
    args = ap.parse_args(argv)
    delay_line(args.queue, args.delay_ms, args.loss, args.stats)


if __name__ == "__main__":
    main()

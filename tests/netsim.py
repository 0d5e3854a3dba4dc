"""A fleet on one machine that behaves like many: hosts in their own Linux
network namespaces, each joined to a bridge by its own veth link, with its
own address, an optional rate cap, and links that can be cut and restored
while the processes behind them keep running.

Topology of one :class:`NetSim`::

    root namespace: bridge <tag>br, 198.18.N.1/24 (the gateway, the test's clients)
      |-- veth <tag>h0 <-> eth0 in namespace <tag>-<name0>: 198.18.N.2
      |-- veth <tag>h1 <-> eth0 in namespace <tag>-<name1>: 198.18.N.3
      ...

Addresses come from the benchmarking range 198.18.0.0/15 (RFC 2544), one
free /24 per simulation, so parallel runs never share one; traffic goes only
to namespaces this module made. Names carry the process id (``ig<pid>x<n>``),
and :func:`sweep` removes what a run (or a run whose process is gone) left.

What a link models:
- a separate address per host (every connection crosses a real link);
- a bandwidth cap in each direction (an ``htb`` qdisc on both veth ends);
- a partition: :meth:`NetSim.cut` sets the host's link down, so packets to
  and from it vanish silently (no reset, no refusal): the host is alive and
  unreachable; :meth:`NetSim.restore` brings it back;
- a partition between one pair of hosts (:meth:`NetSim.cut_between`): their
  packets to each other are dropped by an ``htb`` class whose queue holds
  nothing, while both still reach everyone else.

It does not model delay, jitter or loss (no ``netem`` here) nor routing
beyond one L2 segment. Needs root, ``ip`` and ``tc``; :func:`unavailable`
says why not, for a skip.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import Proc, start

PREFIX = "ig"
_LOCK = Path(tempfile.gettempdir()) / "infergate-netsim.lock"
_SUBNETS = 512  # /24s in 198.18.0.0/15
_seq = itertools.count()


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    added = _run("ip", "netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"`ip netns add` failed: {added.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _subnet_prefix(n: int) -> str:
    return f"198.18.{n}" if n < 256 else f"198.19.{n - 256}"


@dataclass
class Host:
    """One namespace, its link to the bridge, and its address."""

    name: str
    netns: str
    address: str
    veth: str  # the root end, a bridge port
    rate_mbit: float | None = None
    blocked: set[str] = field(default_factory=set)  # addresses this host's link drops traffic to and from

    def cmd(self, *argv: str) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


class NetSim:
    """One bridge and the hosts on it. Use as a context manager, or call :meth:`close`."""

    def __init__(self) -> None:
        self.tag = f"{PREFIX}{os.getpid()}x{next(_seq)}"
        self.bridge = f"{self.tag}br"
        self.hosts: dict[str, Host] = {}
        self.procs: list[Proc] = []  # started in a namespace; killed by close() if still running
        self._closed = False
        with open(_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            used = set(re.findall(r"inet (198\.1[89]\.\d+)\.", _run("ip", "-4", "-o", "addr", "show").stdout))
            start_at = os.getpid() % _SUBNETS
            for i in range(_SUBNETS):
                prefix = _subnet_prefix((start_at + i) % _SUBNETS)
                if prefix not in used:
                    break
            else:
                raise RuntimeError("no free /24 left in 198.18.0.0/15")
            self.prefix = prefix
            self.gateway_address = f"{prefix}.1"  # the root namespace's address on the bridge
            try:
                _run("ip", "link", "add", self.bridge, "type", "bridge")
                _run("ip", "addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
                _run("ip", "link", "set", self.bridge, "up")
            except Exception:
                self.close()
                raise

    def __enter__(self) -> NetSim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- hosts -------------------------------------------------------------

    def add_host(self, name: str, *, rate_mbit: float | None = None) -> Host:
        """A namespace joined to the bridge by its own link (capped at ``rate_mbit`` each way)."""
        index = len(self.hosts)
        if index > 250:
            raise ValueError("one simulation holds at most 250 hosts")
        host = Host(name, f"{self.tag}-{name}", f"{self.prefix}.{index + 2}", f"{self.tag}h{index}", rate_mbit)
        peer = f"{self.tag}p{index}"
        self.hosts[name] = host
        _run("ip", "netns", "add", host.netns)
        _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", host.netns)
        _run(*host.cmd("ip", "link", "set", peer, "name", "eth0"))
        _run(*host.cmd("ip", "addr", "add", f"{host.address}/24", "dev", "eth0"))
        _run(*host.cmd("ip", "link", "set", "lo", "up"))
        _run(*host.cmd("ip", "link", "set", "eth0", "up"))
        _run("ip", "link", "set", host.veth, "master", self.bridge)
        _run("ip", "link", "set", host.veth, "up")
        self._shape(host)
        return host

    def start(self, host: Host, args: list[str], **kwargs: object) -> Proc:
        """``infergate ARGS`` inside ``host``'s namespace (see :func:`tests.harness.start`)."""
        proc = start(args, prefix=host.cmd(), **kwargs)  # type: ignore[arg-type]
        self.procs.append(proc)
        return proc

    def start_worker(self, host: Host, model_repository: str | Path, *extra: str) -> Proc:
        """A worker listening on the host's own address, on an ephemeral port."""
        return self.start(host, ["worker", "--model-repository", str(model_repository),
                                 "--host", host.address, "--port", "0", *extra])

    # ---- links ---------------------------------------------------------------

    def cut(self, host: Host) -> None:
        """Partition ``host``: its link goes down; its processes keep running, unreachable."""
        _run("ip", "link", "set", host.veth, "down")

    def restore(self, host: Host) -> None:
        _run("ip", "link", "set", host.veth, "up")

    def cut_between(self, host: Host, other_address: str) -> None:
        """Drop everything between ``host`` and ``other_address`` (another host's, or the gateway's)."""
        host.blocked.add(other_address)
        self._shape(host)

    def restore_between(self, host: Host, other_address: str) -> None:
        host.blocked.discard(other_address)
        self._shape(host)

    def set_rate(self, host: Host, rate_mbit: float | None) -> None:
        host.rate_mbit = rate_mbit
        self._shape(host)

    def _shape(self, host: Host) -> None:
        """Rebuild the qdiscs of both ends of ``host``'s link from its rate and blocked peers."""
        # Outbound from the host: its eth0 (match dst); inbound: the bridge port (match src).
        for prefix, dev, direction in ((host.cmd(), "eth0", "dst"), ([], host.veth, "src")):
            def tc(*argv: str, _prefix: list[str] = prefix, _dev: str = dev) -> None:
                _run(*_prefix, "tc", argv[0], argv[1], "dev", _dev, *argv[2:])
            _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if host.rate_mbit is None and not host.blocked:
                continue
            tc("qdisc", "add", "root", "handle", "1:", "htb", "default", "10")
            if host.rate_mbit is None:
                tc("class", "add", "parent", "1:", "classid", "1:10", "htb", "rate", "100gbit")
            else:
                rate_bit = int(host.rate_mbit * 1e6)
                # Two milliseconds of the rate as burst, so GSO-sized packets pass at high rates.
                burst = max(64 * 1024, rate_bit // 8 // 500)
                tc("class", "add", "parent", "1:", "classid", "1:10", "htb", "rate", f"{rate_bit}bit",
                   "burst", str(burst), "cburst", str(burst))
                # A queue of 10 ms of the rate, as a NIC's: the default (1000 GSO-sized packets,
                # up to 64 MiB) would add seconds of queueing delay under a bulk transfer.
                tc("qdisc", "add", "parent", "1:10", "handle", "10:", "bfifo", "limit", str(max(2**20, rate_bit // 800)))
            if host.blocked:
                # A class whose queue holds no packet: whatever is classified there is dropped.
                tc("class", "add", "parent", "1:", "classid", "1:99", "htb", "rate", "8kbit")
                tc("qdisc", "add", "parent", "1:99", "handle", "99:", "pfifo", "limit", "0")
                for address in sorted(host.blocked):
                    tc("filter", "add", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                       "match", "ip", direction, f"{address}/32", "flowid", "1:99")

    # ---- cleanup ---------------------------------------------------------------

    def close(self) -> None:
        """Delete every namespace and link this simulation made (processes must be stopped first)."""
        if self._closed:
            return
        self._closed = True
        for proc in self.procs:
            proc.kill()  # a test that failed before stopping it; a no-op otherwise
        sweep(self.tag)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(tag: str | None = None) -> None:
    """Remove namespaces and links named for ``tag`` (a simulation, or ``ig<pid>`` for a whole run);
    with no tag, those of this process and of runs whose process is gone. Best effort."""
    names = re.compile(rf"^({PREFIX}(\d+)x\d+)(?:br|h\d+|p\d+|-.+)$")

    def doomed(name: str) -> bool:
        m = names.match(name)
        if m is None:
            return False
        if tag is not None:
            return m.group(1) == tag or (tag == f"{PREFIX}{m.group(2)}")
        pid = int(m.group(2))
        return pid == os.getpid() or not _pid_alive(pid)

    netns = _run("ip", "netns", "list", check=False).stdout.split()
    for ns in netns:
        if doomed(ns):
            _run("ip", "netns", "del", ns, check=False)  # takes the host ends of its veths with it
    links = re.findall(r"^\d+: ([^:@\s]+)", _run("ip", "-o", "link", "show", check=False).stdout, re.M)
    for link in links:
        if doomed(link):
            _run("ip", "link", "del", link, check=False)

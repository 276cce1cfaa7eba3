"""Pod networking for the process kubelet: one bridge per kubelet, one netns + veth per pod.

Everything is named `lrk<id>...` (the kubelet's 4-hex id), so parallel or aborted runs never
collide, and `sweep_stale()` removes what a dead kubelet left behind. Addresses come from a /24
of 10.213.0.0/16 that no host interface uses; the bridge's own address (x.1) is the host's end,
which the tests use to reach pods (the operator and status API run there).

Only our own bridge, veths and namespaces are touched; the host's interfaces and rules never.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "lrk"
STATE_ROOT = Path("/tmp/lorarl-kubelet")
SUPERNET = ipaddress.ip_network("10.213.0.0/16")
_LOCK = Path("/tmp/lorarl-kubelet.lock")
_OWNED = re.compile(rf"^{PREFIX}([0-9a-f]{{4}})")


class NamespacesUnavailable(RuntimeError):
    """This machine cannot create network/mount namespaces (not root, or no iproute2/nft)."""


def run(*argv: str, check: bool = True, input: str | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def require_namespaces() -> None:
    """Fail with what is missing: the harness needs root, iproute2, nftables and util-linux."""
    if os.geteuid() != 0:
        raise NamespacesUnavailable(
            "the process kubelet runs pods in network and mount namespaces and needs root "
            f"(euid {os.geteuid()})"
        )
    tools = (("ip", "iproute2"), ("nft", "nftables"), ("unshare", "util-linux"),
             ("setpriv", "util-linux"), ("mount", "mount"))  # fmt: skip
    for tool, package in tools:
        if shutil.which(tool) is None:
            raise NamespacesUnavailable(f"`{tool}` not found: apt-get install {package}")
    probe = f"{PREFIX}probe{os.getpid() % 10000}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        raise NamespacesUnavailable(f"cannot create a network namespace: {done.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_alive(kid: str) -> bool:
    try:
        pid = int((STATE_ROOT / kid / "owner.pid").read_text())
    except (OSError, ValueError):
        return False
    return _pid_alive(pid)


def kill_netns_pids(netns: str) -> None:
    for pid in run("ip", "netns", "pids", netns, check=False).split():
        with suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def sweep_stale() -> list[str]:
    """Remove namespaces, links, mounts and state of kubelets whose owner process is gone."""
    removed: list[str] = []
    for line in run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        m = _OWNED.match(name)
        if m and not owner_alive(m.group(1)):
            kill_netns_pids(name)
            run("ip", "netns", "del", name, check=False)
            removed.append(f"netns/{name}")
    for line in run("ip", "-o", "link", "show", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = _OWNED.match(name)
        if m and not owner_alive(m.group(1)):
            run("ip", "link", "del", name, check=False)
            removed.append(f"link/{name}")
    for table in host_tables():
        kid = table.rsplit("_", 1)[1]
        if not owner_alive(kid):
            run("nft", "delete", "table", "ip", table, check=False)
            removed.append(f"nft/{table}")
    if STATE_ROOT.is_dir():
        for state in STATE_ROOT.iterdir():
            if re.fullmatch(r"[0-9a-f]{4}", state.name) and not owner_alive(state.name):
                unmount_under(state)
                run("rm", "-rf", "--one-file-system", str(state), check=False)
                removed.append(f"state/{state.name}")
    return removed


HOST_TABLE = "lorarl_kubelet_svc_{kid}"  # the kubelet's service rules on the host


def host_tables() -> list[str]:
    """The host's nftables tables that some kubelet made."""
    text = run("nft", "list", "tables", "ip", check=False)
    pattern = HOST_TABLE.format(kid=r"([0-9a-f]{4})")
    return [m.group(0) for m in re.finditer(pattern, text)]


def unmount_under(path: Path) -> None:
    """Lazily unmount every mount at or below `path` in this (the host's) mount namespace."""
    prefix = str(path.resolve())
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                mounts.append(point)
    for point in sorted(mounts, key=len, reverse=True):
        run("umount", "-l", point, check=False)


@contextmanager
def _allocation_lock():
    _LOCK.touch(exist_ok=True)
    with open(_LOCK) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _used_subnets() -> set[ipaddress.IPv4Network]:
    used = set()
    for line in run("ip", "-o", "-4", "addr", "show", check=False).splitlines():
        m = re.search(r"inet (\S+)", line)
        if m:
            used.add(ipaddress.ip_interface(m.group(1)).network)
    return used


@dataclass
class PodNet:
    netns: str
    host_veth: str
    ip: str


@dataclass
class Bridge:
    """The kubelet's bridge; pods attach with `attach()` and leave with `detach()`."""

    kid: str
    subnet: ipaddress.IPv4Network = field(init=False)
    name: str = field(init=False)
    _next: int = field(default=2, init=False)
    _by_key: dict[str, str] = field(default_factory=dict, init=False)
    _serial: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.name = f"{PREFIX}{self.kid}br"
        with _allocation_lock():
            used = _used_subnets()
            free = (
                s for s in SUPERNET.subnets(new_prefix=24) if not any(s.overlaps(u) for u in used)
            )
            self.subnet = next(s for s in free if s.network_address.packed[2] not in (0, 255))
            run("ip", "link", "add", self.name, "type", "bridge")
            run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.name)
            run("ip", "link", "set", self.name, "up")
            # Service DNAT (proxy.py) sends loopback-sourced packets out of the bridge.
            run("sysctl", "-qw", f"net.ipv4.conf.{self.name}.route_localnet=1")

    @property
    def host_ip(self) -> str:
        return str(self.subnet.network_address + 1)

    def ip_for(self, key: str) -> str:
        """Stable per pod name: a recreated pod gets its old address (the hosts file only grows)."""
        if key not in self._by_key:
            if self._next > 254:
                raise RuntimeError(f"bridge {self.name}: out of addresses")
            self._by_key[key] = str(self.subnet.network_address + self._next)
            self._next += 1
        return self._by_key[key]

    def attach(self, key: str) -> PodNet:
        self._serial += 1
        net = PodNet(
            netns=f"{PREFIX}{self.kid}-{self._serial}",
            host_veth=f"{PREFIX}{self.kid}v{self._serial}",
            ip=self.ip_for(key),
        )
        ns = net.netns
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", net.host_veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        run("ip", "link", "set", net.host_veth, "master", self.name, "up")
        run("ip", "-n", ns, "addr", "add", f"{net.ip}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")
        run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", ns, "route", "add", "default", "via", self.host_ip)
        run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1",
            "net.ipv4.conf.eth0.route_localnet=1")  # fmt: skip
        return net

    @staticmethod
    def detach(net: PodNet) -> None:
        kill_netns_pids(net.netns)
        run("ip", "link", "del", net.host_veth, check=False)
        run("ip", "netns", "del", net.netns, check=False)

    def delete(self) -> None:
        for line in run("ip", "netns", "list", check=False).splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(f"{PREFIX}{self.kid}-"):
                kill_netns_pids(name)
                run("ip", "netns", "del", name, check=False)
        for line in run("ip", "-o", "link", "show", check=False).splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if name.startswith(f"{PREFIX}{self.kid}"):
                run("ip", "link", "del", name, check=False)


def leftovers(kid: str) -> list[str]:
    """What of kubelet `kid` still exists (netns, links, mounts): empty after a clean stop."""
    found = [
        f"netns/{line.split()[0]}"
        for line in run("ip", "netns", "list", check=False).splitlines()
        if line.split() and line.split()[0].startswith(f"{PREFIX}{kid}")
    ]
    for line in run("ip", "-o", "link", "show", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(f"{PREFIX}{kid}"):
            found.append(f"link/{name}")
    found += [f"nft/{t}" for t in host_tables() if t == HOST_TABLE.format(kid=kid)]
    state = str(STATE_ROOT / kid)
    with open("/proc/self/mountinfo") as f:
        found += [f"mount/{ln.split()[4]}" for ln in f if ln.split()[4].startswith(state)]
    if Path(state).exists():
        found.append(f"dir/{state}")
    return found

"""Run a command as 2 ranks joined by a slow, private link, and count the bytes on that link.

Each rank runs in its own network namespace; the two namespaces are joined by a veth pair (a
virtual Ethernet cable) whose two ends are rate-limited with a ``tc tbf`` qdisc (both
directions: a full-duplex link of ``rate``). ``rate=None`` (``--rate none``) leaves the veth
unlimited. The namespaces, the link and its private ``10.x.y.{1,2}/30`` addresses exist only for
the run: they are made with names unique to the run and deleted afterwards, whatever happens
(normal exit, failure, timeout, Ctrl-C, SIGTERM). Namespaces left by a run that was killed with
SIGKILL are deleted by the next run (their names carry the pid that made them).

Wire bytes are *counted*: the veth's ``tx_bytes``/``rx_bytes`` counters of each namespace are
read before the ranks start and after they end (``tx_bytes`` counts Ethernet frames: payload,
TCP/IP/Ethernet headers, ACKs, connection setup). A rank can also read its own interface's
counters while it runs (``/sys/class/net/$SLOWLINK_IFNAME/statistics/tx_bytes``; ``sysfs``
inside ``ip netns exec`` shows the namespace's own interfaces), which is how
``benchmarks/wire_bytes.py`` isolates single calls.

Modes:

* ``torch`` (default): runs ``cmd`` twice, rank ``r`` in namespace ``r``, with ``RANK``,
  ``WORLD_SIZE=2``, ``LOCAL_RANK`` (= ``RANK``: the ranks share this machine's devices),
  ``MASTER_ADDR`` (rank 0's veth address), ``MASTER_PORT``, and ``GLOO_SOCKET_IFNAME`` /
  ``NCCL_SOCKET_IFNAME`` / ``TP_SOCKET_IFNAME`` set to the veth, so a ``torchrun``-style script
  with ``init_process_group(init_method="env://")`` talks over the veth.
* ``mpi``: MPICH's ``mpiexec -launcher manual`` runs in namespace 0 and prints the command of each
  host's proxy; each proxy is started in its own namespace, so no ssh is needed. ``cmd`` is the
  rank command (e.g. ``python script.py --backend mpi``). ``UCX_TLS=tcp,self`` and
  ``UCX_NET_DEVICES`` make MPICH (ch4:ucx) use TCP over the veth: without them UCX would use
  shared memory between the two ranks, which share the machine, and bypass the link.
  Only MPICH's Hydra is supported (Open MPI has no manual launcher).

Both veth ends have the same name (``slink``; they are in different namespaces), so one value of
``GLOO_SOCKET_IFNAME``/``UCX_NET_DEVICES`` serves both ranks. Needs ``ip`` and ``tc``
(Debian/Ubuntu: ``apt-get install -y iproute2``) and either root (or CAP_NET_ADMIN and
CAP_SYS_ADMIN: named namespaces of this machine, ``--isolation netns``) or, for a user without
root, user namespaces (``--isolation userns``, the default for such a user): the run happens
inside ``unshare --user --map-root-user --net --mount``, where the user is root of a namespace of
its own and makes the same two namespaces and veth pair there, with a tmpfs of that mount
namespace over ``/run/netns`` for their names. The link is then exactly the one root would make
(same rates, addresses, counters, environment), and nothing of it is visible outside or outlives
the run's processes. ``--check`` says whether, and how, the link can be made here.

Command line::

    python benchmarks/slowlink.py --rate 1gbit -- python my_script.py --args
    python benchmarks/slowlink.py --check     # can the link be made here, as root or in a user namespace?
    python benchmarks/slowlink.py --rate none --mode mpi -- python my_script.py --backend mpi

Python::

    from slowlink import run_two_ranks
    out = run_two_ranks([sys.executable, "my_script.py"], rate="1gbit", timeout=300)
    out["returncode"], out["outputs"][0], out["tx_bytes"]  # bytes each rank's end sent
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

DEFAULT_PREFIX = "cosl"
IFNAME = "slink"
DEFAULT_LATENCY = "50ms"
_RATE_UNITS = {  # tc's units: bit/s multipliers (tc: "bit" = bits, "bps" = bytes per second)
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 1024, "mibit": 1024 ** 2, "gibit": 1024 ** 3,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9,
}


class SlowLinkError(RuntimeError):
    """The link could not be set up (no root, no ``ip``/``tc``, namespaces unsupported...)."""


# --- helpers ---------------------------------------------------------------------------------------
def parse_rate(rate) -> float | None:
    """Bits per second of a tc-style rate (``"1gbit"``, ``"100mbit"``, ``"12.5mbps"``, a number
    of bit/s), or ``None`` for ``None``/``"none"``/``"unlimited"``."""
    if rate is None:
        return None
    if isinstance(rate, (int, float)):
        return float(rate)
    text = str(rate).strip().lower()
    if text in ("none", "unlimited", "inf", ""):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
    if not m or (m.group(2) or "bit") not in _RATE_UNITS:
        raise ValueError(f"rate must look like 1gbit, 100mbit, 12.5mbps or none; got {rate!r}")
    return float(m.group(1)) * _RATE_UNITS[m.group(2) or "bit"]


def format_rate(rate) -> str:
    """A tc-style rate for people: ``"100mbit"`` -> ``"100 Mbit/s"``; ``"unlimited"`` for none."""
    bps = parse_rate(rate)
    if bps is None:
        return "unlimited"
    for unit, div in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= div:
            return f"{bps / div:g} {unit}"
    return f"{bps:g} bit/s"


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise SlowLinkError(f"{shlex.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


#: ``isolation``: how the two namespaces are made. ``netns``: named network namespaces of this
#: machine (``ip netns``; needs root). ``userns``: for a user without root, inside a user namespace
#: of its own (``unshare --user --map-root-user``), where it is root, with its own network namespace
#: (the parent of the link's two) and mount namespace (a tmpfs over ``/run/netns``, where ``ip
#: netns`` keeps the names): nothing outside changes, and the namespaces go with the last process
#: of the run (nothing to delete, even after SIGKILL). ``auto``: ``netns`` as root, else ``userns``.
ISOLATIONS = ("auto", "netns", "userns")
USERNS_CMD = ("unshare", "--user", "--map-root-user", "--net", "--mount")
_USERNS_ARG = "--inside-userns"  # the command line of slowlink.py inside the user namespace
ISOLATION_TEXT = {
    "netns": "veth pair between 2 network namespaces, made as root",
    "userns": "veth pair between 2 network namespaces inside an unprivileged user namespace",
}


#: where ip and tc live; a user's PATH often lacks the sbin folders (Debian's login PATH does)
SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def _check_binaries() -> None:
    path = os.environ.get("PATH", "").split(os.pathsep)
    extra = [d for d in SBIN if d not in path and os.path.isdir(d)]
    if extra and any(shutil.which(t) is None for t in ("ip", "tc")):  # this process's and its children's
        os.environ["PATH"] = os.pathsep.join(path + extra)
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        hint = ("install iproute2 (Debian/Ubuntu: apt-get install -y iproute2)" if os.geteuid() == 0
                else "install iproute2 (as root: apt-get install -y iproute2)")
        raise SlowLinkError(f"slowlink needs {' and '.join(missing)}: {hint}")


def userns_possible() -> tuple[bool, str]:
    """``(True, "")`` when this user can enter a user namespace of its own with its own network
    and mount namespaces (``unshare --user --map-root-user --net --mount``), else ``(False, why)``."""
    if not sys.platform.startswith("linux"):
        return False, "user namespaces are Linux-only"
    for path, what in (("/proc/sys/user/max_user_namespaces", "is 0"),
                       ("/proc/sys/kernel/unprivileged_userns_clone", "is 0 (Debian's switch)")):
        try:
            with open(path) as f:
                if f.read().strip() == "0":
                    return False, f"user namespaces are disabled here ({path} {what})"
        except OSError:
            pass
    if shutil.which("unshare") is None:
        return False, "no unshare command (util-linux)"
    try:
        done = subprocess.run([*USERNS_CMD, "--", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{shlex.join(USERNS_CMD)} failed: {e}"
    if done.returncode != 0:
        return False, f"{shlex.join(USERNS_CMD)} failed: {done.stderr.strip() or done.returncode}"
    return True, ""


def check_tools(isolation: str = "auto") -> str:
    """How the link is made here (``"netns"`` or ``"userns"``, see :data:`ISOLATIONS`); raises
    :class:`SlowLinkError` with what to do when it cannot be made."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    _check_binaries()
    if os.geteuid() == 0 and isolation in ("auto", "netns"):
        return "netns"
    if isolation == "netns":
        raise SlowLinkError("slowlink's isolation 'netns' creates named network namespaces and needs root (or "
                            "CAP_NET_ADMIN and CAP_SYS_ADMIN); run it as root, or use isolation 'userns'")
    ok, why = userns_possible()
    if not ok:
        raise SlowLinkError(f"slowlink needs root, or user namespaces for a user without root: {why}")
    return "userns"


def netns_supported(isolation: str = "auto") -> tuple[bool, str]:
    """``(True, "")`` when namespaces and a rate-limited veth pair can be made here (as root, or in
    a user namespace: ``isolation``), else ``(False, why)``."""
    try:
        how = check_tools(isolation)
    except SlowLinkError as e:
        return False, str(e)
    if how == "userns":
        done = subprocess.run([*USERNS_CMD, "--", sys.executable, "-P", os.path.abspath(__file__), _USERNS_ARG,
                               "probe"], capture_output=True, text=True, timeout=60)
        if done.returncode == 0:
            return True, ""
        why = done.stderr.strip() or f"exit {done.returncode}"
        try:  # Ubuntu 23.10+: a user namespace is made, but without the capabilities to use it
            with open("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") as f:
                if f.read().strip() == "1":
                    why += ("; AppArmor restricts unprivileged user namespaces here "
                            "(kernel.apparmor_restrict_unprivileged_userns = 1)")
        except OSError:
            pass
        return False, why
    try:
        link = create_link(rate="1gbit")
    except SlowLinkError as e:
        return False, str(e)
    destroy_link(link)
    return True, ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Names of the network namespaces whose name starts with ``prefix-``."""
    done = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-")]


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces ``prefix-<pid>-...`` whose creating process is gone; return their names."""
    removed = []
    for name in list_namespaces(prefix):
        m = re.match(re.escape(prefix) + r"-(\d+)-", name)
        if m and not _pid_alive(int(m.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


# --- the link --------------------------------------------------------------------------------------
@dataclass
class Link:
    """Two namespaces joined by a veth pair; ``namespaces[r]`` and ``addresses[r]`` are rank r's."""

    namespaces: list[str]
    addresses: list[str]
    ifname: str = IFNAME
    rate: str | None = None
    tbf: list[str] = field(default_factory=list)

    def exec_prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[rank]]

    def counters(self) -> list[dict]:
        """Per rank: the veth end's ``tx_bytes``, ``rx_bytes``, ``tx_packets``, ``rx_packets``."""
        out = []
        for rank in range(2):
            files = " ".join(f"/sys/class/net/{self.ifname}/statistics/{k}"
                             for k in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"))
            done = _run(self.exec_prefix(rank) + ["sh", "-c", f"cat {files}"])
            values = [int(v) for v in done.stdout.split()]
            out.append(dict(zip(("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"), values)))
        return out


_live_links: dict[str, Link] = {}
_live_lock = threading.Lock()


def _tbf_args(rate_bps: float, burst: int | None, latency: str) -> list[str]:
    # tbf needs a bucket of at least rate/HZ bytes (HZ <= 1000), and larger than one packet; GSO
    # hands veth packets of up to 64 KiB, so the bucket is at least 128 KiB.
    burst = int(burst if burst is not None else max(rate_bps / 8 / 500, 128 * 1024))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", latency]


def create_link(rate="1gbit", burst: int | None = None, latency: str = DEFAULT_LATENCY,
                prefix: str = DEFAULT_PREFIX, mtu: int | None = None, gso: bool = True) -> Link:
    """Make two namespaces joined by a veth pair limited to ``rate`` in each direction.

    ``burst``: the tbf bucket in bytes (default max(rate/500 s, 128 KiB)); ``latency``: how long a
    packet may wait in the tbf queue before it is dropped; ``mtu``: the veth MTU (default 1500,
    as on Ethernet). ``gso=False`` caps segmentation offload at one MTU-sized segment, so the
    byte counters count one set of TCP/IP/Ethernet headers per wire-sized frame, as on a real
    NIC (with GSO a veth passes up to 64 KiB per packet and counts its headers once).
    Call :func:`destroy_link` when done (``run_two_ranks`` does). Needs root (as
    :func:`run_two_ranks` is inside its user namespace: ``isolation="userns"``)."""
    check_tools("netns")
    rate_bps = parse_rate(rate)
    tag = f"{os.getpid()}-{random.getrandbits(32):08x}"
    names = [f"{prefix}-{tag}-r{r}" for r in range(2)]
    net = f"10.{random.randint(64, 254)}.{random.randint(0, 255)}.{4 * random.randint(0, 63)}"
    base = [int(x) for x in net.split(".")]
    addresses = [".".join(map(str, base[:3] + [base[3] + 1 + r])) for r in range(2)]
    link = Link(namespaces=names, addresses=addresses, rate=None if rate_bps is None else str(rate))
    with _live_lock:
        _live_links[names[0]] = link
    try:
        for name in names:
            _run(["ip", "netns", "add", name])
        _run(["ip", "link", "add", IFNAME, "netns", names[0], "type", "veth",
              "peer", "name", IFNAME, "netns", names[1]])
        for r, name in enumerate(names):
            ns = ["ip", "-n", name]
            _run(ns + ["addr", "add", f"{addresses[r]}/30", "dev", IFNAME])
            if mtu:
                _run(ns + ["link", "set", IFNAME, "mtu", str(mtu)])
            if not gso:
                _run(ns + ["link", "set", "dev", IFNAME, "gso_max_segs", "1", "gso_max_size", str(mtu or 1500)])
            _run(ns + ["link", "set", IFNAME, "up"])
            _run(ns + ["link", "set", "lo", "up"])
            if rate_bps is not None:
                tbf = _tbf_args(rate_bps, burst, latency)
                _run(link.exec_prefix(r) + ["tc", "qdisc", "add", "dev", IFNAME, "root", *tbf])
                link.tbf = tbf
        _wait_until_up(link)
    except BaseException:
        destroy_link(link)
        raise
    return link


def _wait_until_up(link: Link, timeout: float = 10.0) -> None:
    """Wait until both veth ends have carrier (``operstate`` up): MPI's UCX skips a device that
    is not running yet, and a rank started at once could find no route."""
    deadline = time.monotonic() + timeout
    path = f"/sys/class/net/{link.ifname}/operstate"
    while True:
        states = [_run(link.exec_prefix(r) + ["cat", path]).stdout.strip() for r in range(2)]
        if all(state == "up" for state in states):
            return
        if time.monotonic() > deadline:
            raise SlowLinkError(f"the veth pair did not come up within {timeout:g} s (operstate {states})")
        time.sleep(0.02)


def _namespace_pids(name: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_namespace_processes(name: str, timeout: float = 5.0) -> None:
    """SIGKILL every process still inside namespace ``name`` (all made by this run: e.g. MPI ranks,
    which Hydra's proxy puts in their own process group), and wait until they are gone: a dying
    process still holds the namespace's mounts, and deleting it then fails with EBUSY."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _namespace_pids(name)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)


def destroy_link(link: Link, timeout: float = 10.0) -> None:
    """Kill what still runs in the link's namespaces, then delete them (and with them the veth
    pair), retrying while the kernel still holds them. Never raises; a namespace that could not
    be deleted is reported on stderr (the next run deletes it, see :func:`cleanup_stale`)."""
    for name in link.namespaces:
        try:
            _kill_namespace_processes(name)
            deadline = time.monotonic() + timeout
            while True:
                done = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
                if done.returncode == 0 or name not in list_namespaces(name.split("-", 1)[0]):
                    break
                if time.monotonic() > deadline:
                    print(f"slowlink: could not delete namespace {name}: {done.stderr.strip()}", file=sys.stderr)
                    break
                time.sleep(0.1)
        except Exception as e:  # noqa: BLE001 - cleanup must go on
            print(f"slowlink: cleaning up {name}: {e}", file=sys.stderr)
    with _live_lock:
        _live_links.pop(link.namespaces[0], None)


@atexit.register
def _destroy_all() -> None:
    with _live_lock:
        links = list(_live_links.values())
    for link in links:
        destroy_link(link)


# --- running the ranks ----------------------------------------------------------------------------
class _Proc:
    """A child process in its own process group, with its output collected by a thread."""

    def __init__(self, cmd: list[str], env: dict, cwd: str | None, echo_prefix: str | None):
        self.lines: list[str] = []
        self.popen = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                                      start_new_session=True)
        self.echo_prefix = echo_prefix
        self.line_event = threading.Condition()
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        for line in self.popen.stdout:
            with self.line_event:
                self.lines.append(line)
                self.line_event.notify_all()
            if self.echo_prefix is not None:
                sys.stdout.write(self.echo_prefix + line)
                sys.stdout.flush()
        with self.line_event:
            self.line_event.notify_all()

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.popen.wait()

    @property
    def output(self) -> str:
        self.thread.join(timeout=5)
        return "".join(self.lines)


def _wait_all(procs: list[_Proc], deadline: float, grace: float) -> bool:
    """Wait for every process; when one fails, give the others ``grace`` seconds, then kill.
    Returns True when the deadline passed."""
    failed_at = None
    while True:
        codes = [p.popen.poll() for p in procs]
        if all(c is not None for c in codes):
            return False
        now = time.monotonic()
        if now > deadline:
            return True
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and now - failed_at > grace:
            return False
        time.sleep(0.05)


def _find_mpiexec(mpiexec: str | None) -> str:
    candidates = [mpiexec] if mpiexec else [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "mpiexec"]
    for c in candidates:
        path = c if os.path.sep in c else shutil.which(c)
        if path and os.access(path, os.X_OK):
            return path
    raise SlowLinkError("mode 'mpi' needs MPICH's mpiexec (pip install mpich); none found")


def run_two_ranks(cmd, rate="1gbit", timeout: float = 600.0, mode: str = "torch", env: dict | None = None,
                  burst: int | None = None, latency: str = DEFAULT_LATENCY, mtu: int | None = None,
                  port: int = 29500, cwd: str | None = None, echo: bool = False, grace: float = 15.0,
                  prefix: str = DEFAULT_PREFIX, mpiexec: str | None = None, gso: bool = True,
                  ranks_per_node: int = 1, rendezvous: str = "c10d", isolation: str = "auto") -> dict:
    """Run ``cmd`` (a list, or a shell string) as 2 ranks over a veth link limited to ``rate``.

    Returns a dict: ``returncode`` (0 when every rank exited 0; 124 on timeout; else the exit
    code of the first process that failed by itself: the others are killed ``grace`` seconds
    after it), ``returncodes`` (per process: the 2 ranks; in ``mpi`` mode mpiexec and the 2
    proxies), ``timed_out``, ``outputs`` (per rank, stdout and stderr together; in ``mpi`` mode
    stdout then stderr), ``launcher_output`` (``mpi`` mode: what mpiexec and the proxies printed),
    ``tx_bytes`` and ``rx_bytes`` (per rank: bytes its veth end sent/received
    while the command ran), ``counters_before``/``counters_after``, ``elapsed_s``, ``rate``,
    ``tbf``, ``addresses``, ``namespaces``, ``ifname``, ``gso``, ``mode``. ``env`` adds to the
    current environment; ``port`` is ``MASTER_PORT`` (free: the namespaces are new); ``echo``
    prints the ranks' lines as they come, prefixed ``[rank r]``. ``ranks_per_node`` > 1 (``torch``
    mode): each namespace is a node of that many ranks, started as on a cluster, by ``torchrun
    --nnodes 2 --node-rank r --nproc-per-node L --no-python cmd``; the
    ranks of a node talk over its loopback, the nodes over the veth (per namespace, ``outputs``
    and ``tx_bytes`` are then a node's). ``rendezvous`` (torchrun): ``"c10d"`` (the agents meet at
    a c10d store on node 0's veth address, ``--rdzv-backend c10d --rdzv-endpoint``; the
    namespaces share one host name, so each agent names its veth address with ``--local-addr``
    and node 0 says it hosts the store, ``--rdzv-conf is_host=1``, which torchrun's host-name
    match would not find) or
    ``"static"`` (``--master-addr``). In ``mpi`` mode each node's proxy starts
    ``ranks_per_node`` ranks (``-ppn``; ``outputs`` per rank). Other arguments: see
    :func:`create_link`. Everything made is deleted before returning or raising.

    ``isolation`` (:data:`ISOLATIONS`): ``"auto"`` makes the namespaces on this machine as root
    (``"netns"``) and, for a user without root, inside a user namespace of its own (``"userns"``:
    this function runs again there, in ``slowlink.py``'s process, as root of that namespace; the
    ranks see the same link, addresses and environment). The result's ``isolation`` says which.
    """
    if isinstance(cmd, str):
        cmd = shlex.split(cmd)
    if mode not in ("torch", "mpi"):
        raise ValueError(f"mode must be 'torch' or 'mpi', got {mode!r}")
    if rendezvous not in ("c10d", "static"):
        raise ValueError(f"rendezvous must be 'c10d' or 'static', got {rendezvous!r}")
    if int(ranks_per_node) < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node!r}")
    if check_tools(isolation) == "userns":
        kwargs = dict(cmd=list(cmd), rate=rate, timeout=timeout, mode=mode, env=env, burst=burst, latency=latency,
                      mtu=mtu, port=port, cwd=cwd, echo=echo, grace=grace, prefix=prefix, mpiexec=mpiexec, gso=gso,
                      ranks_per_node=ranks_per_node, rendezvous=rendezvous)
        return _run_in_userns(kwargs)
    cleanup_stale(prefix)
    link = create_link(rate=rate, burst=burst, latency=latency, prefix=prefix, mtu=mtu, gso=gso)
    procs: list[_Proc] = []
    mpi_dir = None
    launcher_output = ""
    try:
        base_env = dict(os.environ)
        base_env.setdefault("OMP_NUM_THREADS", "1")
        base_env.update(env or {})
        base_env.update(SLOWLINK_IFNAME=link.ifname, SLOWLINK_ADDRS=",".join(link.addresses),
                        SLOWLINK_RATE=str(rate))
        before = link.counters()
        start = time.monotonic()
        deadline = start + timeout
        if mode == "torch" and ranks_per_node > 1:
            for r in range(2):
                node_env = dict(base_env, GLOO_SOCKET_IFNAME=link.ifname, NCCL_SOCKET_IFNAME=link.ifname,
                                TP_SOCKET_IFNAME=link.ifname)
                torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
                            "--nproc-per-node", str(ranks_per_node), "--no-python"]  # cmd: the whole command
                if rendezvous == "c10d":
                    torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{link.addresses[0]}:{port}",
                                 "--rdzv-id", link.namespaces[0], "--local-addr", link.addresses[r],
                                 "--rdzv-conf", f"is_host={int(r == 0)}"]
                else:
                    torchrun += ["--master-addr", link.addresses[0], "--master-port", str(port)]
                procs.append(_Proc(link.exec_prefix(r) + torchrun + list(cmd), node_env, cwd,
                                   f"[node {r}] " if echo else None))
        elif mode == "torch":
            for r in range(2):
                rank_env = dict(base_env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                MASTER_ADDR=link.addresses[0], MASTER_PORT=str(port),
                                GLOO_SOCKET_IFNAME=link.ifname, NCCL_SOCKET_IFNAME=link.ifname,
                                TP_SOCKET_IFNAME=link.ifname)
                procs.append(_Proc(link.exec_prefix(r) + list(cmd), rank_env, cwd, f"[rank {r}] " if echo else None))
        else:
            mpi_dir = tempfile.mkdtemp(prefix="slowlink-mpi-")
            procs = _start_mpi(link, list(cmd), base_env, cwd, echo, deadline, mpiexec, mpi_dir, ranks_per_node)
        timed_out = _wait_all(procs, deadline, grace)
        own_codes = [p.popen.poll() for p in procs]  # None: still running, about to be killed
        for p in procs:
            p.kill()
        elapsed = time.monotonic() - start
        after = link.counters()
        codes = [p.popen.returncode for p in procs]
        outputs = [p.output for p in procs]
        if mode == "mpi":
            launcher_output = "".join(f"[{name}]\n{o}" for name, o in zip(("mpiexec", "proxy 0", "proxy 1"), outputs))
            outputs = _mpi_outputs(mpi_dir, 2 * ranks_per_node)
            if echo:
                for r, o in enumerate(outputs):
                    sys.stdout.write("".join(f"[rank {r}] {line}\n" for line in o.splitlines()))
                sys.stdout.flush()
    finally:
        for p in procs:
            p.kill()
        destroy_link(link)
        if mpi_dir is not None:
            shutil.rmtree(mpi_dir, ignore_errors=True)
    if timed_out:
        returncode = 124
    else:  # the first process that failed by itself (the others may have been killed after it)
        returncode = next((c for c in own_codes if c not in (None, 0)), 0)
    return {
        "returncode": returncode,
        "returncodes": codes,
        "timed_out": timed_out,
        "outputs": outputs,
        "launcher_output": launcher_output,
        "tx_bytes": [a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before)],
        "rx_bytes": [a["rx_bytes"] - b["rx_bytes"] for a, b in zip(after, before)],
        "tx_packets": [a["tx_packets"] - b["tx_packets"] for a, b in zip(after, before)],
        "counters_before": before,
        "counters_after": after,
        "elapsed_s": elapsed,
        "rate": link.rate,
        "tbf": link.tbf,
        "addresses": link.addresses,
        "namespaces": link.namespaces,
        "ifname": link.ifname,
        "gso": gso,
        "mode": mode,
        "isolation": "netns",
    }


def _start_mpi(link: Link, cmd: list[str], env: dict, cwd, echo: bool, deadline: float, mpiexec,
               out_dir: str, ranks_per_node: int = 1) -> list[_Proc]:
    """Start Hydra's mpiexec (manual launcher) in namespace 0, then each host's proxy in its own
    namespace. The first process returned is mpiexec. Each rank's stdout and stderr go to
    ``out_dir/out.<rank>`` and ``out_dir/err.<rank>`` (mpiexec's own output prefixes are per
    forwarded chunk, not per line, so they cannot be split reliably)."""
    exe = _find_mpiexec(mpiexec)
    env = dict(env, UCX_TLS=env.get("UCX_TLS", "tcp,self"), UCX_NET_DEVICES=link.ifname,
               MPIR_CVAR_CH4_NETMOD=env.get("MPIR_CVAR_CH4_NETMOD", "ucx"))
    launcher = [exe, "-launcher", "manual", "-hosts", ",".join(link.addresses), "-localhost", link.addresses[0],
                "-n", str(2 * ranks_per_node), "-ppn", str(ranks_per_node),
                "-outfile-pattern", os.path.join(out_dir, "out.%r"),
                "-errfile-pattern", os.path.join(out_dir, "err.%r"), *cmd]
    hydra = _Proc(link.exec_prefix(0) + launcher, env, cwd, "[mpiexec] " if echo else None)
    procs = [hydra]
    try:
        launches = _read_hydra_launches(hydra, deadline)
        for proxy_id, proxy_cmd in launches:
            procs.append(_Proc(link.exec_prefix(proxy_id) + proxy_cmd, env, cwd,
                               f"[proxy {proxy_id}] " if echo else None))
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs


def _mpi_outputs(out_dir: str, ranks: int) -> list[str]:
    """Each rank's stdout followed by its stderr, from the files mpiexec wrote."""
    outputs = []
    for rank in range(ranks):
        text = ""
        for stream in ("out", "err"):
            try:
                with open(os.path.join(out_dir, f"{stream}.{rank}"), errors="replace") as f:
                    text += f.read()
            except OSError:
                pass
        outputs.append(text)
    return outputs


def _read_hydra_launches(hydra: _Proc, deadline: float) -> list[tuple[int, list[str]]]:
    """The ``HYDRA_LAUNCH:`` commands that mpiexec -launcher manual prints, by proxy id."""
    seen = 0
    launches = []
    with hydra.line_event:
        while True:
            while seen < len(hydra.lines):
                line = hydra.lines[seen]
                seen += 1
                if line.startswith("HYDRA_LAUNCH:"):
                    argv = shlex.split(line[len("HYDRA_LAUNCH:"):])
                    proxy_id = int(argv[argv.index("--proxy-id") + 1])
                    launches.append((proxy_id, argv))
                if "HYDRA_LAUNCH_END" in line:
                    if len(launches) != 2:
                        raise SlowLinkError(f"mpiexec asked for {len(launches)} proxies, expected 2")
                    return launches
            if hydra.popen.poll() is not None and seen >= len(hydra.lines):
                raise SlowLinkError("mpiexec exited before printing its proxy commands:\n" + "".join(hydra.lines))
            if time.monotonic() > deadline:
                raise SlowLinkError("timed out waiting for mpiexec's proxy commands")
            hydra.line_event.wait(timeout=0.2)


# --- without root: the same run inside a user namespace -------------------------------------------------
def _stop(popen: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM (slowlink's main stops its ranks and deletes its link), then SIGKILL after ``grace`` s."""
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


def _run_in_userns(kwargs: dict) -> dict:
    """:func:`run_two_ranks` (``kwargs``) in a user namespace of its own: ``slowlink.py
    --inside-userns SPEC`` under ``unshare --user --map-root-user --net --mount``, the result
    passed back as JSON. Its output (``echo``) goes to this process's stdout."""
    with tempfile.TemporaryDirectory(prefix="slowlink-userns-") as tmp:
        spec, result = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec, "w") as f:
            json.dump({"kwargs": kwargs, "result": result}, f)
        cmd = [*USERNS_CMD, "--", sys.executable, "-P", os.path.abspath(__file__), _USERNS_ARG, spec]
        popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        try:  # the ranks' own timeout is inside; this one covers the setup and the cleanup
            popen.wait(timeout=kwargs["timeout"] + kwargs["grace"] + 60)
        except subprocess.TimeoutExpired:
            pass
        finally:  # also on KeyboardInterrupt: the run inside stops its ranks and deletes its link
            _stop(popen)
        try:
            with open(result) as f:
                out = json.load(f)
        except (OSError, ValueError):
            raise SlowLinkError(f"the run in the user namespace ended (exit {popen.returncode}) with no result: "
                                f"{shlex.join(cmd)}") from None
    if "error" in out:
        raise SlowLinkError(out["error"])
    out["isolation"] = "userns"
    return out


def _private_netns_dir() -> None:
    """Inside the user namespace: a tmpfs over ``/run/netns`` (over ``/run`` where that folder does
    not exist), private to this mount namespace, where ``ip netns add`` can pin its namespaces."""
    target = "/run/netns" if os.path.isdir("/run/netns") else "/run"
    _run(["mount", "-t", "tmpfs", "-o", "mode=0755", "slowlink", target])


def _stop_with_parent() -> None:
    """SIGTERM to this process (a clean stop: the ranks killed, the link deleted) when the process
    that started it is gone, e.g. killed with SIGKILL: nothing of the run outlives it."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()


def _inside_userns(spec: str) -> int:
    """``slowlink.py --inside-userns SPEC|probe``, as root of a fresh user namespace: the run of
    :func:`_run_in_userns` (its result written where SPEC says), or ``probe``: make a link, delete it."""
    _stop_with_parent()
    job = None
    if spec != "probe":
        with open(spec) as f:
            job = json.load(f)
    try:
        _private_netns_dir()
        if job is None:
            destroy_link(create_link(rate="1gbit"))
            return 0
        out = run_two_ranks(**job["kwargs"], isolation="netns")
    except SlowLinkError as e:
        if job is None:
            print(f"in a user namespace: {e}", file=sys.stderr)
            return 2
        out = {"error": f"in a user namespace: {e}"}
    with open(job["result"] + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(job["result"] + ".tmp", job["result"])
    return 0


# --- command line ----------------------------------------------------------------------------------
def _raise_on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [_USERNS_ARG]:  # internal: the run inside a user namespace (_run_in_userns)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise_on_signal)
        try:
            return _inside_userns(argv[1])
        except KeyboardInterrupt:
            return 130
    p = argparse.ArgumentParser(
        description="Run a command as 2 ranks in network namespaces joined by a rate-limited veth pair.",
        epilog="example: python benchmarks/slowlink.py --rate 1gbit -- python benchmarks/comm_bandwidth.py")
    p.add_argument("--rate", default="1gbit", help="tc rate of each direction (1gbit, 100mbit, ...) or none")
    p.add_argument("--burst", type=int, default=None, help="tbf bucket in bytes (default max(rate*2ms, 128KiB))")
    p.add_argument("--latency", default=DEFAULT_LATENCY, help="tbf queueing latency limit (default 50ms)")
    p.add_argument("--mtu", type=int, default=None, help="veth MTU (default 1500)")
    p.add_argument("--no-gso", action="store_true",
                   help="no segmentation offload on the veth: counters count MTU-sized frames, as on a NIC")
    p.add_argument("--mode", choices=("torch", "mpi"), default="torch",
                   help="torch: env for init_process_group; mpi: MPICH mpiexec with proxies per namespace")
    p.add_argument("--ranks-per-node", type=int, default=1,
                   help="ranks per namespace (torch mode: torchrun --nproc-per-node; mpi mode: -ppn)")
    p.add_argument("--rendezvous", choices=("c10d", "static"), default="c10d",
                   help="torchrun's rendezvous with --ranks-per-node > 1")
    p.add_argument("--port", type=int, default=29500, help="MASTER_PORT (inside the namespaces)")
    p.add_argument("--timeout", type=float, default=600.0, help="kill the ranks after this many seconds")
    p.add_argument("--grace", type=float, default=15.0,
                   help="when one rank fails, kill the other after this many seconds (default 15)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace name prefix")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result (with outputs) as JSON")
    p.add_argument("--quiet", action="store_true", help="do not echo the ranks' output")
    p.add_argument("--isolation", choices=ISOLATIONS, default="auto",
                   help="netns: named network namespaces (root); userns: inside a user namespace of this user's "
                        "own (no root needed); auto (default): netns as root, else userns")
    p.add_argument("--check", action="store_true",
                   help="only say whether (and how) the link can be made here: exit 0 if it can, else 2")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the rank command (after --)")
    args = p.parse_args(argv)
    if args.check:
        ok, why = netns_supported(args.isolation)
        if not ok:
            print(f"slowlink: the link cannot be made here: {why}")
            return 2
        how = check_tools(args.isolation)
        print(f"slowlink: the link can be made here: {how} ({ISOLATION_TEXT[how]})")
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command to run after --")
    try:
        parse_rate(args.rate)
    except ValueError as e:
        p.error(str(e))
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    try:
        result = run_two_ranks(cmd, rate=args.rate, timeout=args.timeout, mode=args.mode, burst=args.burst,
                               latency=args.latency, mtu=args.mtu, port=args.port, echo=not args.quiet,
                               prefix=args.prefix, gso=not args.no_gso, grace=args.grace,
                               ranks_per_node=args.ranks_per_node, rendezvous=args.rendezvous,
                               isolation=args.isolation)
    except SlowLinkError as e:
        print(f"slowlink: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    status = "timed out" if result["timed_out"] else f"exit codes {result['returncodes']}"
    print(f"# slowlink ({result['isolation']}): rate {result['rate'] or 'unlimited'}, {status}, "
          f"{result['elapsed_s']:.2f} s; "
          f"veth tx_bytes rank0 {result['tx_bytes'][0]} rank1 {result['tx_bytes'][1]} "
          f"(rx {result['rx_bytes'][0]} / {result['rx_bytes'][1]})", file=sys.stderr)
    return result["returncode"]


if __name__ == "__main__":
    sys.exit(main())

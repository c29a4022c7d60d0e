"""A real Slurm cluster on one machine for tests: `slurmctld`, one `slurmd` per test host, `munge`.

`SlurmCluster(tmp, nodes=["node1", "node2", "node3"])` builds, on the network-namespace harness of tests/netns.py
(`Hosts`), a host `ctl` (10.231.0.1) and one host per node (10.231.0.2, ...), and starts:

* `munged` (its own key, socket, PID and seed files under the cluster's directory): Slurm's authentication
  between the commands, `slurmctld`, every `slurmd` and the steps;
* `slurmctld` on `ctl`, and on each node host a `slurmd -N <node>` with the hostname of that node (a UTS
  namespace of its own), an `/etc/hosts` naming every test host (bind-mounted in the process's own mount
  namespace: the machine's stays as it is) and a `/dev/shm` of its own (a tmpfs that goes with the last of
  its processes), so that each node is a separate host to Slurm and to the job.

The configuration uses no cgroups (`proctrack/linuxproc`, `task/none`), no accounting and no database: what a
test cluster needs, nothing of the machine's own Slurm (its /etc/slurm is never read: `SLURM_CONF` names the
cluster's file). The cluster's directory (the state, spools, logs, the job's files) is the test's; the
machine's filesystem is shared by every node, as a cluster's shared home directory.

`sbatch`, `scontrol`, `squeue`, `scancel` run on `ctl` (`cmd`, `sbatch`); `close()` (also on every exit of the
`with` block and at interpreter exit) stops the daemons, then kills every process still inside the test hosts
(the steps' processes, whatever Slurm left) and deletes the namespaces; a test process SIGKILLed leaves its
namespaces to the next harness's sweep (tests/netns.py) and takes munged with it (its parent-death signal).
Needs root, `ip`, `unshare` and the Debian packages slurmctld, slurmd, slurm-client and munge; `unavailable()`
says why not, for a skip.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from netns import Hosts
from netns import unavailable as netns_unavailable

__all__ = ["SlurmCluster", "unavailable", "PROGRAMS"]

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo", "unshare")
CMD_TIMEOUT_S = 30.0
UP_TIMEOUT_S = 60.0
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")

_CONF = """\
ClusterName=pftest
SlurmctldHost=ctl({ctl_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=5
SchedulerParameters=sched_interval=1
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
LaunchParameters=use_interactive_step
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/linear
ReturnToService=2
SlurmdTimeout=30
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=300
JobRequeue=1
RequeueExit=75
PropagateResourceLimits=NONE
NodeName=DEFAULT CPUs={cpus} RealMemory=1000 State=UNKNOWN
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""

_reason: list[str | None] = []


def unavailable() -> str | None:
    """None if a Slurm cluster can be built here; else why not (for pytest.skip)."""
    if _reason:
        return _reason[0]
    why = netns_unavailable()
    if why is None:
        missing = [p for p in PROGRAMS if shutil.which(p) is None and not os.path.exists(f"/usr/sbin/{p}")]
        if missing:
            why = (f"the Slurm tests need {', '.join(missing)}: apt-get install -y slurmctld slurmd slurm-client "
                   "munge")
    _reason.append(why)
    return why


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)


def _which(p: str) -> str:
    return shutil.which(p) or f"/usr/sbin/{p}"


class SlurmCluster:
    """A Slurm cluster in test hosts; a context manager (see the module docstring)."""

    def __init__(self, tmp: Path, nodes: Sequence[str] = ("node1", "node2", "node3")) -> None:
        self.dir = Path(tmp) / "slurm"
        self.nodes = list(nodes)
        self.hosts = Hosts(["ctl", *self.nodes])
        self.munged: subprocess.Popen[bytes] | None = None
        self._closed = False
        atexit.register(self.close)

    # ------------------------------------------------------------------ build
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment Slurm's commands and daemons run with (the cluster's configuration)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def addr(self, host: str) -> str:
        return self.hosts.addr[host]

    def _write_files(self) -> None:
        d = self.dir
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        for sub in ("ctld", "spool", "munge"):
            (d / sub).mkdir(mode=0o700, exist_ok=True)
        for n in self.nodes:
            (d / "spool" / n).mkdir(mode=0o700, exist_ok=True)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.addr(n)} NodeHostname={n}" for n in self.nodes)
        self.conf.write_text(_CONF.format(ctl_addr=self.addr("ctl"), munge_socket=self.munge_socket, dir=d,
                                          cpus=os.cpu_count() or 1, nodes=nodes))
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nCgroupMountpoint=/sys/fs/cgroup\n")
        (d / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{self.addr(h)} {h}\n"
                                                                  for h in ["ctl", *self.nodes]))

    @property
    def munge_socket(self) -> str:
        return str(self.dir / "munge" / "munge.socket")

    def _in_host(self, host: str, argv: Sequence[str], log: str) -> subprocess.Popen[bytes]:
        """Start argv in `host`: its hostname, the cluster's /etc/hosts, a /dev/shm of its own."""
        setup = (f"hostname {host} && mount --bind {self.dir / 'hosts'} /etc/hosts && "
                 "mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec \"$@\"")
        return self.hosts.run(host, ["unshare", "--uts", "sh", "-c", setup, "sh", *argv],
                              log=self.dir / log, env=self.env)

    def start(self) -> None:
        self.hosts.build()
        self._write_files()
        m = self.dir / "munge"
        self.munged = subprocess.Popen(
            [_which("munged"), "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={m / 'munge.key'}",
             f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'munged.seed'}", f"--log-file={m / 'munged.log'}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent)  # (outside the test hosts: nothing else would end it if this process died)
        self._wait("munged's socket", lambda: os.path.exists(self.munge_socket))
        self._in_host("ctl", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        self._wait("slurmctld to answer", lambda: self.cmd("scontrol", "ping", check=False).returncode == 0)
        for n in self.nodes:
            self._in_host(n, [_which("slurmd"), "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}.out")
        self._wait("every node idle", lambda: all(s == "idle" for s in self.node_states().values()))

    def _wait(self, what: str, cond: object, timeout_s: float = UP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm cluster did not come up: timed out waiting for {what}; logs in "
                                   f"{self.dir}:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, chars: int = 3000) -> str:
        out = []
        for f in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    # ------------------------------------------------------------------ use
    def cmd(self, *argv: str, check: bool = True, timeout_s: float = CMD_TIMEOUT_S,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command (`scontrol ...`) on `ctl`; its output as text."""
        setup = f"mount --bind {self.dir / 'hosts'} /etc/hosts && exec \"$@\""
        p = subprocess.run(["ip", "netns", "exec", self.hosts.ns("ctl"), "sh", "-c", setup, "sh", *argv],
                           capture_output=True, text=True, timeout=timeout_s, env=env or self.env,
                           stdin=subprocess.DEVNULL)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}")
        return p

    def sbatch(self, *argv: str, env: dict[str, str] | None = None) -> int:
        """Submit a batch job; its job id."""
        out = self.cmd("sbatch", "--parsable", *argv, env=env).stdout.strip()
        return int(out.split(";")[0])

    def node_states(self) -> dict[str, str]:
        p = self.cmd("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split()[:2] for line in p.stdout.splitlines() if len(line.split()) >= 2)

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as key=value pairs ({} once Slurm forgot the job)."""
        p = self.cmd("scontrol", "-o", "show", "job", str(job_id), check=False)
        out: dict[str, str] = {}
        for tok in p.stdout.split():
            k, _, v = tok.partition("=")
            out.setdefault(k, v)
        return out

    def wait_job(self, job_id: int, timeout_s: float, done: Sequence[str] = ENDED) -> dict[str, str]:
        """Wait for the job to reach one of the states `done`; the job's record then."""
        deadline = time.monotonic() + timeout_s
        while True:
            j = self.job(job_id)
            if j.get("JobState") in done:
                return j
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {j.get('JobState')} after {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def pids(self, node: str) -> list[int]:
        return self.hosts.pids(node)

    # ------------------------------------------------------------------ cleanup
    def close(self) -> None:
        """Cancel every job, stop the daemons, kill what is left in the hosts, delete them; never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            self.cmd("scancel", "--full", "--user=root", check=False, timeout_s=10)
        except Exception:  # noqa: BLE001 - the controller may be down already
            pass
        self.hosts.close()  # (SIGKILLs the daemons, the steps and anything else inside the hosts)
        if self.munged is not None:
            try:
                os.killpg(self.munged.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.munged.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        atexit.unregister(self.close)

    def leftovers(self) -> list[str]:
        """What the cluster left behind: its namespaces, or munged."""
        out = list(self.hosts.leftovers())
        if self.munged is not None and self.munged.poll() is None:
            out.append(f"munged (pid {self.munged.pid})")
        return out

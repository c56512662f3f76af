"""A real single-host Slurm cluster, started and stopped by a test (Debian's ``slurm-wlm``
and ``munge``; root only, since ``slurmd`` starts tasks as the job's user).

    with SlurmCluster() as cluster:
        code, out = cluster.run(["srun", "-n", "4", "python", "-m", "commlib.examples.train_digits"])

Everything lives in one temporary directory: a generated munge key (``munged`` with its
own socket, pid, log and seed files), ``slurm.conf`` (free ports for ``slurmctld`` and
``slurmd``, one node named after this host at ``127.0.0.1`` with :data:`CPUS` CPUs whatever
the machine has, ``SlurmdParameters=config_overrides``; no cgroups, no accounting, no
system plug-ins, ``MpiDefault=none``, a random ``FirstJobId``), the controller's state and
``slurmd``'s spool. Nothing outside it is read or written but the daemons' listening ports (random, in 61000-65499);
the system's ``/etc/slurm`` and ``/etc/munge`` are never used (every command gets
``SLURM_CONF``).

:meth:`SlurmCluster.stop` cancels every job, stops ``slurmd``, ``slurmctld`` and ``munged``
by the process ids their pid files gave at start (SIGTERM, then SIGKILL after a grace),
ends any process left that carries this cluster's ``SLURM_CONF`` (a task or
``slurmstepd`` of a job that was cut short), and removes the directory. It returns what it
had to kill (empty on a clean stop).

By hand (prints each command's output and the cluster's teardown)::

    python tests/slurm_cluster.py srun -n 4 python -m commlib.examples.train_digits
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

CPUS = 16
DAEMONS = ("slurmd", "slurmctld", "munged")  # the order they stop in
COMMANDS = ("srun", "sbatch", "scancel", "squeue", "sinfo", "slurmctld", "slurmd", "munged")
#: What the environment of a command keeps from the caller's: a test may itself run inside
#: a Slurm job or an MPI launcher, whose variables must not leak into this cluster's jobs.
DROPPED_PREFIXES = ("SLURM_", "SLURMD_", "SBATCH_", "SALLOC_", "SRUN_", "PMI_", "PMIX_",
                    "MPIR_", "HYDRA_", "MPI_", "OMPI_", "TORCHELASTIC_")
DROPPED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
           "MASTER_PORT", "GROUP_RANK", "COMMLIB_LAUNCH", "COMMLIB_LAUNCH_PID")


def why_not() -> str | None:
    """Why no cluster can be started here (None when one can)."""
    missing = [c for c in COMMANDS if shutil.which(c, path=_sbin_path()) is None]
    if missing:
        return (f"Slurm/munge not installed ({', '.join(missing)} not found; Debian: "
                f"apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        return "slurmd must run as root (it starts each task as the job's user)"
    return None


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])


def _free_ports(n: int) -> list[int]:
    """``n`` ports free now, above Linux's default ephemeral range (32768-60999), where
    no outgoing connection takes them between this check and the daemon's bind."""
    ports: list[int] = []
    while len(ports) < n:
        port = 61000 + secrets.randbelow(4500)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class SlurmCluster:
    """One ``slurmctld`` and one ``slurmd`` (node :attr:`node`, :data:`CPUS` CPUs) with their
    own ``munged``, in :attr:`dir` (started again, on other ports, if a port was taken). Use as a context manager, or :meth:`start`/:meth:`stop`."""

    def __init__(self, cpus: int = CPUS, start_timeout: float = 60.0) -> None:
        self.cpus, self.start_timeout = cpus, start_timeout
        self.dir = ""
        self.node = socket.gethostname().split(".")[0]
        self.pids: dict[str, int] = {}
        self.conf = ""

    # -- start -------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        reason = why_not()
        if reason:
            raise RuntimeError(reason)
        # munged wants its socket's directories searchable by all and its key private.
        for attempt in range(3):  # a port taken between the check and the bind: again
            self.dir = tempfile.mkdtemp(prefix="commlib-slurm-")
            os.chmod(self.dir, 0o755)
            try:
                self._start_munge()
                self._write_conf()
                self._daemon("slurmctld", ["slurmctld", "-i"])
                self._daemon("slurmd", ["slurmd", "-N", self.node])
                self._wait_idle()
                return
            except RuntimeError as exc:
                self.stop()
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise
            except BaseException:
                self.stop()
                raise

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _start_munge(self) -> None:
        os.mkdir(self.path("munge"), 0o700)
        key = self.path("munge/munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
        self._daemon("munged", ["munged", f"--socket={self.path('munge.socket')}",
                                f"--key-file={key}", f"--pid-file={self.path('munged.pid')}",
                                f"--log-file={self.path('munged.log')}",
                                f"--seed-file={self.path('munge/munged.seed')}"])

    def _write_conf(self) -> None:
        for d in ("state", "spool"):
            os.mkdir(self.path(d), 0o755)
        open(self.path("plugstack.conf"), "w").close()
        ctld, slurmd = _free_ports(2)
        self.conf = self.path("slurm.conf")
        lines = {
            "ClusterName": "commlibtest",
            "SlurmctldHost": f"{self.node}(127.0.0.1)",
            "SlurmctldPort": ctld, "SlurmdPort": slurmd,
            "SlurmUser": "root", "SlurmdUser": "root",
            "AuthType": "auth/munge", "CredType": "cred/munge",
            "AuthInfo": f"socket={self.path('munge.socket')}",
            "StateSaveLocation": self.path("state"), "SlurmdSpoolDir": self.path("spool"),
            "SlurmctldPidFile": self.path("slurmctld.pid"),
            "SlurmdPidFile": self.path("slurmd.pid"),
            "SlurmctldLogFile": self.path("slurmctld.log"),
            "SlurmdLogFile": self.path("slurmd.log"),
            "PlugStackConfig": self.path("plugstack.conf"),
            "ProctrackType": "proctrack/pgid", "TaskPlugin": "task/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none", "JobCompType": "jobcomp/none",
            "SwitchType": "switch/none", "MpiDefault": "none",
            "SchedulerType": "sched/builtin", "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU", "SlurmdParameters": "config_overrides",
            "ReturnToService": 2, "MailProg": "/bin/true",
            # Job ids (and so the store ports commlib derives from them) differ between
            # clusters started at the same time on one host.
            "FirstJobId": 1000 + secrets.randbelow(60000),
            "KillWait": 5, "InactiveLimit": 0, "MinJobAge": 2,
        }
        text = "".join(f"{k}={v}\n" for k, v in lines.items())
        text += (f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN\n"
                 f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE "
                 f"State=UP OverSubscribe=YES\n")
        with open(self.conf, "w") as f:
            f.write(text)

    def env(self, **extra: str) -> dict:
        """The environment for this cluster's commands: the caller's without any
        launcher's variables, ``SLURM_CONF`` set, ``extra`` on top."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(DROPPED_PREFIXES) and k not in DROPPED}
        env["PATH"] = _sbin_path()
        if self.conf:
            env["SLURM_CONF"] = self.conf
        env.update(extra)
        return env

    def _daemon(self, name: str, cmd: list[str]) -> None:
        """Start a daemon (it forks into the background and writes its pid file)."""
        with open(self.path(f"{name}.start"), "w+") as out:  # not a pipe: a daemon's
            result = subprocess.run(cmd, env=self.env(), stdin=subprocess.DEVNULL,  # child
                                    stdout=out, stderr=subprocess.STDOUT, timeout=30)  # may keep it
            out.seek(0)
            said = out.read()
        pid_file = self.path(f"{name}.pid")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with open(pid_file) as f:
                    self.pids[name] = int(f.read().split()[0])
                break
            except (OSError, ValueError, IndexError):
                time.sleep(0.05)
        if result.returncode != 0 or name not in self.pids:
            raise RuntimeError(f"{name} did not start (exit status {result.returncode}): "
                               f"{said}\n{self.log(name)}")

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        state = ""
        while time.monotonic() < deadline:
            result = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, timeout=30)
            state = result.stdout.strip()
            if result.returncode == 0 and state == "idle":
                return
            for name, pid in self.pids.items():
                if not _alive(pid):
                    raise RuntimeError(f"{name} (pid {pid}) ended:\n{self.log(name)}")
            time.sleep(0.2)
        raise RuntimeError(f"node {self.node} not idle after {self.start_timeout:g} s "
                           f"({state!r}):\n{self.log('slurmctld')}\n{self.log('slurmd')}")

    def log(self, name: str, tail: int = 4000) -> str:
        try:
            with open(self.path(f"{name}.log"), errors="replace") as f:
                return f"--- {name}.log:\n" + f.read()[-tail:]
        except OSError:
            return f"--- {name}.log: none"

    # -- jobs --------------------------------------------------------------------------
    def run(self, cmd: list[str], timeout: float, **extra: str) -> tuple[int, str]:
        """(exit status, output) of ``cmd`` (``srun ...``, ``sbatch -W ...``) with this
        cluster's environment; at ``timeout`` its process group is killed (-9) and the
        cluster's jobs are cancelled."""
        proc = subprocess.Popen(cmd, env=self.env(**extra), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            return proc.returncode, out
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            self.cancel_all()
            return -9, proc.communicate()[0]

    def cancel_all(self) -> None:
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)

    # -- stop --------------------------------------------------------------------------
    def leftovers(self) -> list[int]:
        """Processes (other than this one) whose environment carries this cluster's
        ``SLURM_CONF``: the daemons themselves, ``slurmstepd``, the jobs' tasks."""
        if not self.conf:
            return []
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0") and _alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                continue
        return found

    def stop(self, grace: float = 10.0) -> list[str]:
        """Stop everything this cluster started and remove its directory (idempotent).
        Returns what had to be killed with SIGKILL, or was still there afterwards."""
        killed: list[str] = []
        if self.pids.get("slurmctld") and _alive(self.pids["slurmctld"]):
            try:
                self.cancel_all()
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline:
                    out = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env(),
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True, timeout=30).stdout
                    if not out.strip():
                        break
                    time.sleep(0.2)
            except (OSError, subprocess.SubprocessError):
                pass
        for name in DAEMONS:
            pid = self.pids.pop(name, None)
            if pid is None or not _alive(pid):
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
                killed.append(f"{name} (pid {pid})")
        for pid in self.leftovers():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    what = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                os.kill(pid, signal.SIGKILL)
                killed.append(f"{what} (pid {pid})")
            except OSError:
                pass
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""
        return killed


def main(argv: list[str]) -> int:
    reason = why_not()
    if reason:
        print(f"no Slurm cluster: {reason}", file=sys.stderr)
        return 2
    cluster = SlurmCluster()
    start = time.monotonic()
    cluster.start()
    print(f"[slurm_cluster] up in {time.monotonic() - start:.1f} s: {cluster.conf}", flush=True)
    code = 0
    try:
        if argv:
            code, out = cluster.run(argv, timeout=600)
            print(out, end="", flush=True)
    finally:
        killed = cluster.stop()
        print(f"[slurm_cluster] stopped; had to kill: {killed or 'nothing'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

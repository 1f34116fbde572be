"""A real Slurm cluster on loopback, for tests: munged + slurmctld + two slurmd ("nodes" n1, n2).

    with SlurmCluster(tmp_path) as cluster:
        job = cluster.sbatch(["--wait", "launch/slurm/bon_rerank.sbatch"], env={...})
        assert job.returncode == 0

Everything lives in one temp dir (config, munge key and socket, spool, logs); the daemons run
as root in the foreground and are stopped by PID. No cgroups (proctrack/linuxproc, task/none),
so it works in a plain container. Each node declares one count-only GPU GRES, so scripts that
ask for `--gpus-per-node=1` are scheduled exactly as on a real GPU cluster, without devices.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ports import free_port

SLURM_BINARIES = ("sbatch", "srun", "sinfo", "slurmctld", "slurmd", "munged")
APT_PACKAGES = ("slurm-wlm", "munge")


# Tests install system packages only when asked: `make test-cluster` and `.ci/run` set it.
SYSTEM_TESTS_ENV = "MMPRM_SYSTEM_TESTS"


def system_installs_allowed() -> bool:
    """True when the user asked the tests to install system packages (MMPRM_SYSTEM_TESTS=1)."""
    return os.environ.get(SYSTEM_TESTS_ENV, "") == "1"


def ensure_debian_packages(binaries: tuple[str, ...], packages: tuple[str, ...]) -> str | None:
    """Install Debian packages if any binary is missing; returns a skip reason, or None when ready.

    CI starts from a bare machine, so the tests may install what they need, but only when asked
    (MMPRM_SYSTEM_TESTS=1): a plain `make test` never changes the system. Where installing cannot
    work (not asked, not root, no apt) the caller skips with the returned reason.
    """
    if all(shutil.which(b) for b in binaries):
        return None
    if not system_installs_allowed():
        return (
            f"needs {', '.join(binaries)} (Debian packages {' '.join(packages)}), not installed; "
            f"`make test-cluster` or {SYSTEM_TESTS_ENV}=1 lets the tests apt-get install them"
        )
    if os.geteuid() != 0:
        return f"{', '.join(packages)} not installed and not root: apt-get install {' '.join(packages)}"
    if shutil.which("apt-get") is None:
        return f"{', '.join(packages)} not installed and no apt-get on this machine"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        # A bare machine may have no package lists yet: update once, then retry.
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    missing = [b for b in binaries if shutil.which(b) is None]
    if missing:
        return f"apt-get install {' '.join(packages)} failed ({done.stderr.strip()[-300:]}); missing {missing}"
    return None


def ensure_pip_tool(binary: str, requirement: str) -> str | None:
    """Pip-install REQUIREMENT if BINARY is missing (only when asked); a skip reason, or None when ready."""
    if shutil.which(binary):
        return None
    if not system_installs_allowed():
        return (
            f"needs {binary}, not installed; `make test-cluster` or {SYSTEM_TESTS_ENV}=1 lets the tests "
            f"pip install {requirement}"
        )
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement], capture_output=True, text=True)
    if shutil.which(binary) is None:
        return f"{binary} not installed and `pip install {requirement}` failed ({done.stderr.strip()[-300:]})"
    return None


@dataclass
class JobResult:
    """What `sbatch --wait` returned: its exit code (the job's) and its output."""

    returncode: int
    stdout: str
    stderr: str


class SlurmCluster:
    """munged + slurmctld + one slurmd per node, all on 127.0.0.1, under `root`."""

    def __init__(
        self, root: Path, nodes: tuple[str, ...] = ("n1", "n2"), cpus_per_node: int = 2, gpus_per_node: int = 2
    ):
        self.root = Path(root)
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.gpus_per_node = gpus_per_node
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.sock"
        self._procs: list[tuple[str, subprocess.Popen]] = []

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        """Write the config, start the daemons, and wait until every node is idle."""
        try:
            self._write_files()
            self._spawn(
                "munged",
                [
                    "munged",
                    "-F",
                    "-f",
                    f"--socket={self.munge_socket}",
                    f"--key-file={self.root / 'munge' / 'munge.key'}",
                    f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                    f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                    f"--log-file={self.root / 'log' / 'munged.log'}",
                ],
            )
            self._wait_for(lambda: self.munge_socket.exists(), 10, "munged socket")
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
            self._wait_for(self._all_idle, timeout, f"nodes {self.nodes} idle")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the daemons we started, by PID, slurmd first so no job step is orphaned."""
        for _name, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for _name, proc in reversed(self._procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._procs.clear()

    # -- client commands -------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """Environment for client commands (sbatch, srun, sinfo) that points at this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(
        self, cmd: list[str], env: dict[str, str] | None = None, timeout: float = 240, cwd: Path | str | None = None
    ) -> JobResult:
        """Run a Slurm client command against this cluster; `env` adds to the cluster env."""
        done = subprocess.run(
            cmd, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
        return JobResult(done.returncode, done.stdout, done.stderr)

    def sbatch(
        self, args: list[str], env: dict[str, str] | None = None, timeout: float = 240, cwd: Path | str | None = None
    ) -> JobResult:
        """`sbatch --wait ARGS`: blocks until the job ends and returns with the job's exit code."""
        return self.run(["sbatch", "--wait", *args], env=env, timeout=timeout, cwd=cwd)

    def logs(self) -> str:
        """Tail of every daemon log, for assertion messages when something goes wrong."""
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            parts.append(f"== {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(parts)

    # -- internals -------------------------------------------------------------------------
    def _write_files(self) -> None:
        for sub in ("munge", "log", "state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses group/world-writable parents and needs a private key.
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(exist_ok=True)
        node_lines = "\n".join(
            f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname=127.0.0.1 Port={free_port()} "
            f"CPUs={self.cpus_per_node} Gres=gpu:{self.gpus_per_node} State=UNKNOWN"
            for n in self.nodes
        )
        self.conf.write_text(f"""\
ClusterName=mmprmtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={self.root / "state"}
SlurmdSpoolDir={self.root / "spool"}/%n
SlurmctldPidFile={self.root / "slurmctld.pid"}
SlurmdPidFile={self.root / "spool"}/slurmd-%n.pid
SlurmctldLogFile={self.root / "log" / "slurmctld.log"}
SlurmdLogFile={self.root / "log"}/slurmd-%n.log
# No cgroups in a container: plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
# MinJobAge keeps `sbatch --wait` polling fast; EnforcePartLimits makes an impossible job fail.
MinJobAge=4
EnforcePartLimits=ALL
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
{node_lines}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=UNLIMITED State=UP
""")
        # Stand-in GPUs: any character devices will do (Slurm only counts and binds them, and
        # count-only GPU GRES is refused); /dev/null, /dev/zero, ... give distinct devices.
        devices = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]
        if self.gpus_per_node > len(devices):
            raise ValueError(f"gpus_per_node={self.gpus_per_node}: at most {len(devices)} stand-in GPUs")
        (self.root / "gres.conf").write_text(
            "".join(f"NodeName={n} Name=gpu File={dev}\n" for n in self.nodes for dev in devices[: self.gpus_per_node])
        )

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "wb")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        out.close()
        self._procs.append((name, proc))

    def _all_idle(self) -> bool:
        for name, proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.logs()}")
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return done.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes)

    def _wait_for(self, check, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}:\n{self.logs()}")

"""Make this machine a node that `ray up` reaches over SSH, like an on-prem host.

- a user of its own (``raykvlaunch``): its ``ray stop`` (which `ray up` and
  `ray down` run) cannot touch other users' Ray processes, which a root
  ``ray stop`` on a shared machine would kill;
- a Python environment like a node image with Ray preinstalled: a venv whose
  base packages are this checkout's venv (a ``.pth``), so the YAML's
  ``pip install`` lines run offline, and ``ray`` / ``serve`` on its PATH;
  ``RAY_TMPDIR`` of its own, so ``ray start`` / ``raykv start`` (address
  ``auto``) never find another Ray on the machine;
- key-only ``sshd`` (Debian's ``openssh-server``) on 127.0.0.1:22, stopped by ``close``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.waiting import WaitTimeout, wait_until

USER = "raykvlaunch"
PYTHON_COPY = Path("/opt/raykv-launch-python")
RAY_TMPDIR = "/tmp/raykv-launch"


def missing_prerequisites() -> str | None:
    """Why this machine cannot host the launch test (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (creates a user and runs sshd)"
    for tool, pkg in (
        ("sshd", "openssh-server"),
        ("ssh", "openssh-client"),
        ("rsync", "rsync"),
        ("ssh-keygen", "openssh-client"),
    ):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            return f"no {tool} (Debian: apt-get install -y {pkg})"
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 22))
        except OSError:
            return "port 22 is taken (ray up's local provider speaks SSH on port 22 only)"
    return None


def _run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


class LaunchHost:
    """The prepared user, key and sshd; ``close`` stops sshd."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.key = work / "id_ed25519"
        self._sshd: subprocess.Popen | None = None
        self._ensure_user()
        self.home = Path(pwd.getpwnam(USER).pw_dir)
        self._ensure_python()
        self._ensure_key()
        self._start_sshd()

    def _ensure_user(self) -> None:
        try:
            pwd.getpwnam(USER)
        except KeyError:
            _run("useradd", "-m", "-s", "/bin/bash", USER)
        _run("usermod", "-p", "*", USER)  # no password, but not locked: sshd refuses locked accounts

    def _ensure_python(self) -> None:
        # This interpreter lives under /root (mode 700): the user gets a copy of it.
        base = Path(sys.base_prefix)
        if not (PYTHON_COPY / "bin").exists():
            _run(
                "rsync",
                "-a",
                "--exclude",
                "lib/python3*/site-packages",
                "--exclude",
                "__pycache__",
                "--exclude",
                "lib/python3*/test",
                f"{base}/",
                f"{PYTHON_COPY}/",
            )
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        (PYTHON_COPY / "lib" / ver / "site-packages").mkdir(parents=True, exist_ok=True)
        venv = self.home / "venv"
        env = {**os.environ, "LD_LIBRARY_PATH": str(PYTHON_COPY / "lib")}
        if not (venv / "bin" / "python").exists():
            _run(str(PYTHON_COPY / "bin" / ver), "-m", "venv", str(venv), env=env)
        site = sysconfig.get_paths()["purelib"]  # this checkout's venv: Ray, vLLM, torch...
        (venv / "lib" / ver / "site-packages" / "raykv_launch_base.pth").write_text(site + "\n")
        for script, module, fn in (("ray", "ray.scripts.scripts", "main"), ("serve", "ray.serve.scripts", "cli")):
            path = venv / "bin" / script
            path.write_text(f"#!{venv}/bin/python\nimport sys\nfrom {module} import {fn}\nsys.exit({fn}())\n")
            path.chmod(0o755)
        profile = self.home / ".bash_profile"
        profile.write_text(
            f"export PATH=$HOME/venv/bin:$PATH\nexport LD_LIBRARY_PATH={PYTHON_COPY}/lib\n"
            f"export RAY_TMPDIR={RAY_TMPDIR}\nexport RAY_USAGE_STATS_ENABLED=0\n"
            "[ -f ~/.profile ] && . ~/.profile\n"
        )
        _run("chown", "-R", f"{USER}:{USER}", str(venv), str(profile))

    def _ensure_key(self) -> None:
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        ssh = self.home / ".ssh"
        ssh.mkdir(mode=0o700, exist_ok=True)
        (ssh / "authorized_keys").write_text(Path(f"{self.key}.pub").read_text())
        _run("chown", "-R", f"{USER}:{USER}", str(ssh))
        (ssh / "authorized_keys").chmod(0o600)

    def _start_sshd(self) -> None:
        host_key = self.work / "ssh_host_ed25519_key"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation directory
        config = self.work / "sshd_config"
        config.write_text(
            f"Port 22\nListenAddress 127.0.0.1\nHostKey {host_key}\nPidFile {self.work / 'sshd.pid'}\n"
            f"AllowUsers {USER}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PubkeyAuthentication yes\nUsePAM no\nPermitRootLogin no\nAllowTcpForwarding yes\n"
        )
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        self._sshd = subprocess.Popen(
            [sshd, "-D", "-f", str(config), "-E", str(self.work / "sshd.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        probe: subprocess.CompletedProcess[str] | None = None

        def ssh_answers() -> bool:
            nonlocal probe
            probe = subprocess.run(
                [
                    "ssh",
                    "-i",
                    str(self.key),
                    "-o",
                    "StrictHostKeyChecking=no",
                    "-o",
                    "UserKnownHostsFile=/dev/null",
                    "-o",
                    "BatchMode=yes",
                    "-o",
                    "ConnectTimeout=5",
                    f"{USER}@localhost",
                    "bash --login -c 'ray --version'",
                ],
                capture_output=True,
                text=True,
            )
            if probe.returncode != 0 and self._sshd.poll() is not None:
                raise RuntimeError("sshd exited")
            return probe.returncode == 0

        try:
            wait_until(ssh_answers, timeout_s=20, interval_s=0.5, what=f"ssh to {USER}@localhost")
        except (WaitTimeout, RuntimeError):
            self.close()
            stderr = probe.stderr[-500:] if probe else ""
            raise RuntimeError(f"ssh to {USER}@localhost failed: {stderr}") from None

    def export(self, **env: str) -> None:
        """Add environment variables to the user's login shells (what `ray up`'s commands run in)."""
        profile = self.home / ".bash_profile"
        profile.write_text(profile.read_text() + "".join(f"export {k}={v}\n" for k, v in env.items()))

    def shm_files(self) -> list[Path]:
        """The user's files in /dev/shm."""
        return [p for p in Path("/dev/shm").iterdir() if p.owner() == USER]

    def processes(self) -> list[str]:
        """Command lines of every process the user runs (none once the cluster is down)."""
        out = subprocess.run(["ps", "-u", USER, "-o", "pid=,args="], capture_output=True, text=True).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def close(self) -> None:
        if self._sshd is not None and self._sshd.poll() is None:
            self._sshd.terminate()
            try:
                self._sshd.wait(10)
            except subprocess.TimeoutExpired:
                self._sshd.kill()
                self._sshd.wait()

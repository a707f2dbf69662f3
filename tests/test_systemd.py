"""omnid under systemd: the unit files, socket activation, and the notify protocol.

No systemd instance is needed: `systemd-analyze verify` checks the shipped units
offline; `systemd-socket-activate` hands a real listening socket to a real
daemon the way systemd does (LISTEN_FDS/LISTEN_PID); and the test itself plays
systemd's side of Type=notify by binding the AF_UNIX datagram socket that
`NOTIFY_SOCKET` names.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, daemon_config, py_stage, short_tmpdir

from omnictl.client import Client
from omnid import systemd

UNITS = ROOT / "systemd"
VENV_OMNID = Path(sys.executable).parent / "omnid"


# ------------------------------------------------------------------------- the unit files


def unit_settings(path: Path) -> dict[str, list[str]]:
    """`Key=value` lines of a unit file (all sections together), comments dropped."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    service = (UNITS / "omnid.service").read_text()
    shipped = unit_settings(UNITS / "omnid.service")["ExecStart"][0].split()[0]
    assert shipped == "/usr/local/bin/omnid"
    # verify insists that ExecStart's binary exists: point it at this venv's omnid.
    assert VENV_OMNID.exists()
    (tmp_path / "omnid.service").write_text(service.replace(f"ExecStart={shipped}", f"ExecStart={VENV_OMNID}"))
    shutil.copy(UNITS / "omnid.socket", tmp_path / "omnid.socket")
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", "omnid.socket", "omnid.service"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr
    # and verify does catch mistakes: an unknown key is reported
    (tmp_path / "omnid.service").write_text(
        service.replace(f"ExecStart={shipped}", f"ExecStart={VENV_OMNID}").replace("[Service]", "[Service]\nWatchDogSec=3"))
    bad = subprocess.run(["systemd-analyze", "verify", "--man=no", "omnid.socket", "omnid.service"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "WatchDogSec" in bad.stderr


def test_units_say_what_the_spec_says() -> None:
    svc = unit_settings(UNITS / "omnid.service")
    sock = unit_settings(UNITS / "omnid.socket")
    one = {k: v[-1] for k, v in svc.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert one["WatchdogSec"] == "30" and one["Restart"] == "on-failure"
    assert one["KillMode"] == "control-group" and "TimeoutStopSec" in one
    assert "omnid" in one["RuntimeDirectory"].split() and one["StateDirectory"] == "omnid"
    assert one["RestartPreventExitStatus"] == "2"          # an invalid config: restarting cannot help
    # nothing that takes the GPUs away (or, for MemoryDenyWriteExecute=, the JIT compilers)
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock", "MemoryDenyWriteExecute"):
        assert key not in svc, f"{key}= would cut the stage workers off /dev/nvidia*"
    # the API tells users apart by SO_PEERCRED: in a user namespace they would all be nobody
    assert "PrivateUsers" not in svc
    assert sock["ListenStream"] == ["/run/omnid/omnid.sock"] and sock["SocketMode"] == ["0660"]
    assert "omnid.socket" in svc["Requires"][0] and "omnid.socket" in svc["After"][0]


def test_the_service_runs_unprivileged_and_keeps_its_files_private() -> None:
    svc = unit_settings(UNITS / "omnid.service")
    sock = unit_settings(UNITS / "omnid.socket")
    one = {k: v[-1] for k, v in svc.items()}
    assert one["User"] == "omnid" and one["Group"] == "omnid"
    assert set(one["SupplementaryGroups"].split()) == {"video", "render"}
    assert one["UMask"] == "0077" and one["StateDirectoryMode"] == "0700"
    assert one["NoNewPrivileges"] == "yes" and one["CapabilityBoundingSet"] == ""
    assert one["ProtectSystem"] == "strict"
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(one["RestrictAddressFamilies"].split())
    assert one["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert int(one["TimeoutStopSec"]) >= 90, "the drain (up to 60 s) and the workers' stop grace must fit"
    # the GPU device files are made as root before the unprivileged start; missing tools are no error
    assert all(cmd.startswith(("-+", "+-")) for cmd in svc["ExecStartPre"])
    # the socket: root and the group omnid, whose members get nothing else
    assert sock["SocketGroup"] == ["omnid"] and sock["SocketMode"] == ["0660"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_service_is_rated_ok_by_systemd_analyze_security() -> None:
    # --threshold is on a 0..100 scale: 30 is "3.0"; 7.7 EXPOSED before it ran as its own user
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=30", "--no-pager",
                             str(UNITS / "omnid.service")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None,
                    reason="systemd-sysusers or systemd-tmpfiles is not installed")
def test_sysusers_and_tmpfiles_files_apply_to_an_empty_root(tmp_path: Path) -> None:
    """Both files are applied for real, into a scratch root (--root=): the user, the groups, the folders."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)

    def sysusers(path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["systemd-sysusers", f"--root={root}", "--replace=/usr/lib/sysusers.d/omnid.conf",
                               str(path)], capture_output=True, text=True, timeout=60)

    # a mistake is caught (so the checks below mean something)
    (tmp_path / "bad.conf").write_text("u omnid - \"omnid\" /var/lib/omnid -\nx omnid video\n")
    assert sysusers(tmp_path / "bad.conf").returncode != 0
    result = sysusers(UNITS / "omnid.sysusers")
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr
    assert all(line.startswith("Creating ") for line in result.stderr.splitlines()), result.stderr
    users = {f[0]: f for f in (line.split(":") for line in (root / "etc/passwd").read_text().splitlines())}
    groups = {f[0]: f for f in (line.split(":") for line in (root / "etc/group").read_text().splitlines())}
    uid, gid, home, shell = int(users["omnid"][2]), int(users["omnid"][3]), users["omnid"][5], users["omnid"][6]
    assert 0 < uid < 1000 and gid == int(groups["omnid"][2])          # a system user, its own group
    assert home == "/var/lib/omnid" and shell.endswith("nologin")
    assert "omnid" in groups["video"][3].split(",") and "omnid" in groups["render"][3].split(",")

    result = subprocess.run(["systemd-tmpfiles", f"--root={root}", "--create",
                             "--replace=/usr/lib/tmpfiles.d/omnid.conf", str(UNITS / "omnid.tmpfiles")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr
    svc = {k: v[-1] for k, v in unit_settings(UNITS / "omnid.service").items()}
    # the same modes as the service's own *Directory= settings
    expected = {"var/lib/omnid": svc["StateDirectoryMode"], "var/cache/omnid": svc["CacheDirectoryMode"],
                "run/omnid": svc["RuntimeDirectoryMode"], "run/lock/omnid": svc["RuntimeDirectoryMode"]}
    for folder, mode in expected.items():
        st = (root / folder).stat()
        assert (oct(st.st_mode & 0o7777), st.st_uid, st.st_gid) == (oct(int(mode, 8)), uid, gid), folder


# ------------------------------------------------------------------------- helpers


PROBE = '''
import os, time

time.sleep(float(os.environ.get("PROBE_LOAD_S", "0")))   # a model that takes a while to load


def env(inputs, params, ctx):
    keys = ("LISTEN_FDS", "LISTEN_PID", "CUDA_VISIBLE_DEVICES")
    return {"env": " ".join(f"{k}={os.environ.get(k, '-')}" for k in keys)}
'''


def probe_stage(d: Path, **extra: Any) -> dict[str, Any]:
    (d / "sd_probe.py").write_text(PROBE)
    return {"engine": "python", "function": "sd_probe:env", "python_path": [str(d)], **extra}


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def reap() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Daemons a test started: SIGTERM at teardown if still running, which must make them exit 0
    within 15 s (else SIGKILL, and the teardown fails)."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    problems = []
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                if p.wait(15) != 0:
                    problems.append(f"{p.args}: exited with status {p.returncode} after SIGTERM")
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                problems.append(f"{p.args}: still running 15 s after SIGTERM; killed it")
    assert not problems, "\n".join(problems)


def daemon_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def wait_until(cond, timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None,
               log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.05)
    detail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
    raise AssertionError(f"{what}: not within {timeout} s (exit {proc.poll() if proc else None})\n{detail}")


def ready_status(client: Client) -> bool | None:
    """True/False from /v1/ready; None while the daemon does not answer yet."""
    try:
        return client.ready()[0]
    except Exception:
        return None


class NotifyListener:
    """Systemd's end of NOTIFY_SOCKET: collects the daemon's datagrams."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[tuple[float, dict[str, str]]] = []

    def drain(self) -> list[dict[str, str]]:
        new = []
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return new
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))
            new.append(fields)

    def wait_for(self, key: str, value: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.drain()
            for t, fields in self.messages:
                if fields.get(key) == value:
                    return t
            time.sleep(0.02)
        raise AssertionError(f"no {key}={value} within {timeout} s; got {self.messages}")

    def count(self, key: str, value: str) -> int:
        self.drain()
        return sum(1 for _, f in self.messages if f.get(key) == value)

    def close(self) -> None:
        self.sock.close()


# ------------------------------------------------------------------------- Type=notify


def test_ready_only_when_every_stage_is_warm_and_stopping_on_sigterm(workdir: Path, reap) -> None:
    stages = {"slow": probe_stage(workdir, env={"PROBE_LOAD_S": "1.0"}), "quick": py_stage("echo")}
    cfg = daemon_config(workdir, stages, {"p": {"stages": ["quick", "slow"]}})
    listener = NotifyListener(workdir / "notify.sock")
    log = workdir / "omnid.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "omnid", "-c", str(cfg)], stdout=out, stderr=subprocess.STDOUT,
                                env=daemon_env(NOTIFY_SOCKET=str(listener.path)))
    reap.append(proc)
    client = Client(str(workdir / "omnid.sock"), timeout=5)
    seen_not_ready = False
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        listener.drain()
        if any(m.get("READY") == "1" for _, m in listener.messages):
            # READY=1 has been sent: /v1/ready must already say every stage is warm
            ok, doc = client.ready()
            assert ok, f"READY=1 sent while /v1/ready says {doc}"
            assert set(doc["stages"].values()) == {"ready"}, doc
            break
        status = ready_status(client)
        if status is False:
            seen_not_ready = True              # the API answers while the slow stage still loads
        time.sleep(0.02)
    assert seen_not_ready, "never saw /v1/ready answer 503 before READY=1: the test proves nothing"
    ready_fields = next(m for _, m in listener.messages if m.get("READY") == "1")
    assert "STATUS" in ready_fields
    assert listener.count("STOPPING", "1") == 0
    assert listener.count("WATCHDOG", "1") == 0, "no WATCHDOG_USEC: no pings expected"
    proc.send_signal(signal.SIGTERM)
    listener.wait_for("STOPPING", "1", 15)
    assert proc.wait(30) == 0, log.read_text()
    listener.close()


def test_watchdog_pings(workdir: Path, reap) -> None:
    cfg = daemon_config(workdir, {"s": py_stage("echo")}, {"p": {"stages": ["s"]}})
    listener = NotifyListener(workdir / "notify.sock")
    log = workdir / "omnid.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "omnid", "-c", str(cfg)], stdout=out, stderr=subprocess.STDOUT,
                                env=daemon_env(NOTIFY_SOCKET=str(listener.path), WATCHDOG_USEC="400000"))
    reap.append(proc)
    t_ready = listener.wait_for("READY", "1", 60)
    wait_until(lambda: listener.count("WATCHDOG", "1") >= 5, 10, "five WATCHDOG=1 pings", proc, log)
    pings = [t for t, m in listener.messages if m.get("WATCHDOG") == "1"]
    # systemd would kill the service past WATCHDOG_USEC (0.4 s) without a ping
    gaps = [b - a for a, b in zip([t_ready] + pings, pings)]
    assert max(gaps) < 0.4, f"gaps between pings: {[round(g, 3) for g in gaps]}"
    proc.send_signal(signal.SIGTERM)
    listener.wait_for("STOPPING", "1", 15)
    assert proc.wait(30) == 0
    listener.close()


def test_watchdog_interval_and_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))   # meant for another process
    assert systemd.watchdog_interval() is None


def test_notify_without_and_with_a_socket(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert systemd.notify("READY=1") is False
    # an abstract socket ("@name"), as systemd itself uses
    name = f"omnid-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.notify("STATUS=hello") is True
        assert s.recv(100) == b"STATUS=hello"


# ------------------------------------------------------------------------- socket activation


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate is not installed")
def test_socket_activation(workdir: Path, reap) -> None:
    act = workdir / "activation.sock"
    configured = workdir / "configured.sock"
    cfg = daemon_config(workdir, {"s": probe_stage(workdir, devices=[0])}, {"p": {"stages": ["s"]}},
                        {"socket": str(configured)})
    log = workdir / "omnid.log"
    # systemd-socket-activate passes only the variables it is told to (like systemd's Environment=)
    with open(log, "wb") as out:
        proc = subprocess.Popen(["systemd-socket-activate", "-l", str(act), "-E", "PYTHONUNBUFFERED=1",
                                 sys.executable, "-m", "omnid", "-c", str(cfg)],
                                stdout=out, stderr=subprocess.STDOUT, env=daemon_env(), cwd=str(workdir))
    reap.append(proc)
    wait_until(act.is_socket, 15, "the activation socket", proc, log)
    client = Client(str(act), timeout=30)
    # The first connection makes systemd-socket-activate exec omnid (same pid) with the socket as fd 3.
    health = client.health()
    assert health["pid"] == proc.pid and health["status"] == "ok"
    wait_until(lambda: ready_status(client), 60, "/v1/ready on the activation socket", proc, log)
    assert not configured.exists(), "omnid must use the inherited socket, not open daemon.socket"
    assert f"{act} (from systemd)" in log.read_text(), "the log must name the socket really served"
    doc = client.wait(client.submit("p", {})["id"])
    assert doc["state"] == "succeeded", doc
    text = client.output(doc["id"], "env")[0].decode()
    # the LISTEN_* variables are consumed by the daemon, not passed on to its workers
    assert text == "LISTEN_FDS=- LISTEN_PID=- CUDA_VISIBLE_DEVICES=0", text
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log.read_text()
    assert act.is_socket(), "the activation socket belongs to systemd: omnid must leave it"
    assert not configured.exists()


# ------------------------------------------------------------------------- make install


def readme_verify_commands() -> tuple[str, str]:
    """The service page's (docs/getting-started/service.md) `make install` into a staging folder, and its `unshare ... systemd-analyze verify`
    command (one shell command, its continuation lines joined)."""
    readme = (ROOT / "docs/getting-started/service.md").read_text()
    [block] = re.findall(r"```sh\n(make install DESTDIR=[^\n]*\nunshare .*?)```", readme, re.S)
    install, verify = block.split("\n", 1)
    return install, verify.strip()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None or shutil.which("unshare") is None,
                    reason="systemd-analyze or unshare is not installed")
def test_make_install_into_a_destdir_gives_units_that_verify(tmp_path: Path) -> None:
    """`make install DESTDIR=...` (the control plane alone: INSTALL_EXTRAS=) stages a tree that works
    once it is at /: seen from a private mount namespace where the staged /opt/omnid and /usr/local
    stand at their places, `omnid` runs, and `systemd-analyze verify` of the installed units passes
    (it insists that ExecStart's binary exists and is executable). The staged sysusers and tmpfiles
    files are where systemd-sysusers and systemd-tmpfiles look (--root applies them)."""
    dest = tmp_path / "dest"
    made = subprocess.run(["make", "-s", "install", f"DESTDIR={dest}", "INSTALL_EXTRAS=", f"PYTHON={sys.executable}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    local = dest / "usr/local"
    assert os.readlink(local / "bin/omnid") == "/opt/omnid/venv/bin/omnid"
    assert os.readlink(local / "bin/omnictl") == "/opt/omnid/venv/bin/omnictl"
    unit = unit_settings(local / "lib/systemd/system/omnid.service")
    assert unit["ExecStart"][0].startswith("/usr/local/bin/omnid ")
    assert unit["Documentation"] == ["file:///usr/local/share/doc/omnid/README.md"]
    assert (local / "share/doc/omnid/README.md").is_file() and (dest / "etc/omnid/omnid.toml").is_file()
    # the venv names the folder it will be in, not the staging one
    assert (dest / "opt/omnid/venv/bin/omnid").read_text().splitlines()[0] == "#!/opt/omnid/venv/bin/python"
    assert str(dest) not in (dest / "opt/omnid/venv/pyvenv.cfg").read_text()
    assert "project.license" not in made.stdout + made.stderr      # setuptools' deprecation of the table form
    script = (f"mount -t tmpfs tmpfs /opt && mkdir /opt/omnid && mount --bind {dest}/opt/omnid /opt/omnid && "
              f"mount --bind {local} /usr/local && /usr/local/bin/omnid --help >/dev/null && "
              "/usr/local/bin/omnictl --help >/dev/null")
    seen = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=120)
    assert seen.returncode == 0 and seen.stdout + seen.stderr == "", seen.stdout + seen.stderr
    # the service page's command verifies the staged units, as written (its staging folder replaced by ours)
    install, verify = readme_verify_commands()
    assert install == "make install DESTDIR=/tmp/omnid-stage INSTALL_EXTRAS="
    seen = subprocess.run(["sh", "-c", verify.replace("/tmp/omnid-stage", str(dest))],
                          capture_output=True, text=True, timeout=120)
    assert seen.returncode == 0 and seen.stdout + seen.stderr == "", seen.stdout + seen.stderr
    # and it is a real check: a unit whose ExecStart names a missing binary fails it
    service = local / "lib/systemd/system/omnid.service"
    good = service.read_text()
    service.write_text(good.replace("ExecStart=/usr/local/bin/omnid ", "ExecStart=/usr/local/bin/omnid-missing "))
    seen = subprocess.run(["sh", "-c", verify.replace("/tmp/omnid-stage", str(dest))],
                          capture_output=True, text=True, timeout=120)
    assert seen.returncode != 0 and "omnid-missing" in seen.stdout + seen.stderr, seen.stdout + seen.stderr
    service.write_text(good)
    # sysusers and tmpfiles find the staged files by themselves
    applied = subprocess.run(["systemd-sysusers", f"--root={dest}"], capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0 and "omnid:" in (dest / "etc/passwd").read_text(), applied.stderr
    applied = subprocess.run(["systemd-tmpfiles", f"--root={dest}", "--create"], capture_output=True, text=True,
                             timeout=60)
    assert (dest / "var/lib/omnid").is_dir() and (dest / "run/lock/omnid").is_dir(), applied.stderr
    # a second install keeps the admin's config; uninstall takes the rest away
    (dest / "etc/omnid/omnid.toml").write_text("# mine\n")
    again = subprocess.run(["make", "-s", "install", f"DESTDIR={dest}", "INSTALL_EXTRAS=", f"PYTHON={sys.executable}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and (dest / "etc/omnid/omnid.toml").read_text() == "# mine\n", again.stderr[-2000:]
    gone = subprocess.run(["make", "-s", "uninstall", f"DESTDIR={dest}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert gone.returncode == 0 and not (dest / "opt/omnid").exists() and not (local / "bin/omnid").exists()
    assert (dest / "etc/omnid/omnid.toml").exists()

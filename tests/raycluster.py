"""A local Ray cluster for tests and benchmarks: a head and a second raylet on this machine.

Each cluster has its own temp dir and ports, so it never clashes with another one on the machine
(another test run, another engineer's); `stop()` ends the processes of this cluster only (found by
its temp dir), never `ray stop`, which would stop every Ray cluster of this user.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))
# A test cluster is local and unauthenticated, whatever the user's own Ray set-up: with RAY_AUTH_MODE
# unset, a head finds a token in ~/.ray (from a two-node set-up) and turns auth on, and its second
# raylet is refused. Everything that talks to the test cluster (its nodes, the daemons, a driver)
# gets this.
CLIENT_ENV = {"RAY_AUTH_MODE": "disabled"}
# Every process of a cluster carries its temp dir under this name in its environment: some (Ray's
# client server) do not name the temp dir in their command line.
CLUSTER_MARK = "OMNID_RAY_CLUSTER"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RayCluster:
    address: str
    temp_dir: Path
    env: dict[str, str]

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster (found by its temp dir), with their children."""
        found: dict[int, psutil.Process] = {}
        me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        for p in psutil.process_iter(["cmdline"]):
            if p.pid in me:
                continue
            try:
                if any(str(self.temp_dir) in part for part in (p.info["cmdline"] or [])) \
                        or p.environ().get(CLUSTER_MARK) == str(self.temp_dir):
                    found[p.pid] = p
                    for c in p.children(recursive=True):
                        found[c.pid] = c
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return list(found.values())

    def raylet(self, resource: str) -> psutil.Process:
        for p in self.processes():
            try:
                cmd = " ".join(p.cmdline())
            except psutil.NoSuchProcess:
                continue
            if "/raylet " in f"{cmd} " and f"static_resource_list={resource}," in cmd.replace(" ", "") \
                    or ("raylet/raylet" in cmd and f"{resource}," in cmd):
                return p
        raise AssertionError(f"no raylet with resource {resource!r}")

    def actors(self) -> list[psutil.Process]:
        out = []
        for p in self.processes():
            try:
                if p.cmdline() and p.cmdline()[0].startswith("ray::StageActor"):
                    out.append(p)
            except psutil.NoSuchProcess:
                continue
        return out

    def cli(self, *args: str) -> str:
        r = subprocess.run([RAY, *args, "--address", self.address], capture_output=True, text=True,
                           env=self.env, timeout=60)
        return r.stdout + r.stderr

    def stop(self) -> None:
        procs = self.processes()
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_cluster(head_store: int = 300_000_000, node2_store: int = 200_000_000) -> RayCluster:
    """A Ray head (2 CPUs) and a second raylet (1 CPU, custom resource `node2` = 4, label
    omnid-node=node2), with object stores of the given sizes (bytes); ready when it returns."""
    temp_dir = Path(tempfile.mkdtemp(prefix="omnid-ray-", dir="/tmp"))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "RAY_DISABLE_USAGE_STATS": "1", CLUSTER_MARK: str(temp_dir), **CLIENT_ENV}
    cluster = RayCluster(f"127.0.0.1:{port}", temp_dir, env)
    common = ["--temp-dir", str(temp_dir), "--disable-usage-stats"]
    head = [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
            f"--object-store-memory={head_store}", "--include-dashboard=false", f"--dashboard-port={_free_port()}",
            f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}", *common]
    node2 = [RAY, "start", f"--address={cluster.address}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
             f"--object-store-memory={node2_store}", '--resources={"node2": 4}', '--labels={"omnid-node": "node2"}',
             f"--dashboard-agent-listen-port={_free_port()}", *common]
    try:
        for cmd in (head, node2):
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, start_new_session=True)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    except BaseException:
        cluster.stop()
        raise
    return cluster

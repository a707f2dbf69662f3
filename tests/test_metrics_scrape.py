"""What Prometheus scrapes: the standard process series, build info, the supervisor's GC pauses, queue-wait and stage-duration
histograms, segments (tokens) per stage, per-stage memory; and /metrics over TCP when asked."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable

from conftest import RunningDaemon, daemon_config, py_stage, short_tmpdir

from omnid import __version__


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {series} in the scrape")


def test_the_scrape_has_what_people_graph_and_is_served_over_tcp(
        start_daemon: Callable[..., RunningDaemon]) -> None:
    port = free_port()
    d = start_daemon({"gen": py_stage("count", defaults={"n": 5, "delay": 0.0}), "gc": py_stage("gc_frozen")},
                     {"p": {"stages": ["gen"]}, "g": {"stages": ["gc"]}}, {"metrics_listen": f"127.0.0.1:{port}"})
    assert d.wait(d.submit("p"))["state"] == "succeeded"
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert value(text, "process_resident_memory_bytes") > 0 and value(text, "process_open_fds") > 0
    assert f'omnid_build_info{{version="{__version__}"}} 1.0' in text
    assert value(text, 'omnid_job_queue_wait_seconds_count{pipeline="p"}') == 1
    assert value(text, 'omnid_stage_duration_seconds_count{stage="gen"}') == 1
    assert value(text, 'omnid_stage_segments_total{stage="gen"}') == 6            # 5 and the closing one
    assert value(text, 'omnid_stage_rss_bytes{replica="0",stage="gen"}') > 10 << 20
    assert "omnid_stage_segments_total" in d.client.metrics()          # the same registry on the socket
    # the start's objects are frozen out of the collector's walks once ready (tens of thousands: the
    # modules, the API's routes and schemas), and the supervisor's collections are timed, the full
    # collection before that freeze among them
    assert value(text, "omnid_gc_frozen_objects") > 10_000
    assert value(text, 'omnid_gc_pause_seconds_count{generation="2"}') >= 1
    # and a stage worker's, its engine loaded, before its first job (its own process: the stage says)
    job = d.submit("g")
    assert d.wait(job)["state"] == "succeeded"
    assert int(d.client.output(job, "text")[0]) > 10_000
    try:                                                  # only /metrics over TCP: never the API
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/jobs", timeout=10)
        raise AssertionError("the API answered over TCP")
    except urllib.error.HTTPError as e:
        assert e.code == 404


def test_a_bad_metrics_address_is_a_check_error() -> None:
    d = short_tmpdir()
    cfg = daemon_config(d, {"a": py_stage("echo")}, {"p": {"stages": ["a"]}}, {"metrics_listen": "9464"})
    r = subprocess.run([sys.executable, "-m", "omnid", "--check", "-c", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2 and 'daemon.metrics_listen: must be "HOST:PORT"' in r.stderr, r.stderr

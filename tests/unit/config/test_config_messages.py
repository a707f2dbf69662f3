"""What a user reads for a bad config: the exact messages of 58 bad configs, snapshotted.

Each case is a TOML fragment merged into a valid base config (three python stages, a vllm and a
diffusers stage on fake model folders, one pipeline); `omnid.config.parse` must refuse it, and every
problem it reports (key path and message, in order) must equal the snapshot in
config_messages.snap.txt. A message that changes is a deliberate change of that file:
`OMNID_UPDATE_SNAPSHOTS=1 pytest tests/unit/config/test_config_messages.py` rewrites it.

In-process, no daemon: the messages `omnid --check` prints (tests/test_config.py runs it).
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from conftest import toml_dumps

from omnid import config as C

SNAPSHOT = Path(__file__).with_name("config_messages.snap.txt")

BASE = """
[daemon]
socket = "s.sock"
state_dir = "state"

[stages.a]
engine = "python"
function = "json:dumps"

[stages.b]
engine = "python"
function = "json:loads"

[stages.llm]
engine = "vllm"
model = "llm"

[stages.sd]
engine = "diffusers"
model = "sd"

[pipelines.p]
stages = ["a", "b"]
"""

# name -> a TOML fragment merged into BASE (tables merged key by key; a value replaces).
CASES: dict[str, str] = {
    "daemon int out of range": "[daemon]\nmax_queued_jobs = 0",
    "daemon int of wrong type": "[daemon]\nmax_queued_jobs = \"many\"",
    "daemon number given a boolean": "[daemon]\ndefault_timeout_s = true",
    "daemon int given a float": "[daemon]\nkeep_jobs = 2.5",
    "daemon negative count": "[daemon]\nkeep_jobs = -1",
    "daemon bad socket_mode": "[daemon]\nsocket_mode = \"999\"",
    "daemon socket_mode too large": "[daemon]\nsocket_mode = 4096",
    "daemon bad log_level and log_format": "[daemon]\nlog_level = \"loud\"\nlog_format = \"xml\"",
    "daemon unknown key": "[daemon]\ncolour = \"blue\"",
    "daemon not a table": "daemon = 5",
    "daemon bad metrics_listen": "[daemon]\nmetrics_listen = \"localhost\"",
    "daemon bad listen entries": "[daemon]\nlisten = [\"127.0.0.1:99999\", 5, \"127.0.0.1:80\", \"127.0.0.1:80\"]",
    "daemon bad allow_origins": "[daemon]\nallow_origins = [\"https://chat.example.com/path\", 3]",
    "owner with a bad name": "[daemon.owners.bob]\nweight = 1",
    "owner with bad values": "[daemon.owners.default]\nweight = -1\nmax_priority = 2000000\ncolour = 1",
    "owner not a table": "[daemon.owners]\n\"1000\" = 3",
    "tracing with bad values": "[daemon.tracing]\notlp_endpoint = \"ftp://x\"\nsample = 2\nservice_name = \" \"",
    "tracing unknown key and wrong type": "[daemon.tracing]\nendpoint = \"http://x\"\nsample = \"all\"",
    "realtime_transcription of no pipeline": "[daemon]\nrealtime_transcription = \"nope\"",
    "stage max_inflight zero": "[stages.a]\nmax_inflight = 0",
    "stage unknown engine": "[stages.a]\nengine = \"tensorflow\"",
    "stage unknown key": "[stages.a]\ncolour = 1",
    "stage bad devices": "[stages.a]\ndevices = [-1, 0, 0, true]",
    "stage devices mixed": "[stages.a]\ndevices = [[0], 1]",
    "stage too many replicas": "[stages.a]\nreplicas = 100",
    "stage bad function reference": "[stages.a]\nfunction = \"nomodule\"",
    "stage function module not found": "[stages.a]\nfunction = \"no_such_module_here:f\"",
    "stage env not strings": "[stages.a]\nenv = { X = 1 }",
    "stage bad placement": "[stages.a]\nplacement = \"moon\"",
    "stage bad ray needs": "[stages.a]\nray = { num_cpus = -1, resources = { gpu = 0 }, labels = { zone = 1 }, x = 2 }",
    "stage max_rss_mb a float": "[stages.a]\nmax_rss_mb = 1.5",
    "stage bad produces": "[stages.a]\nproduces = [\"pdf\"]",
    "stage python takes no model keys": "[stages.a]\nengine_core = \"inline\"\nhidden_prompt = true\nlazy = 1",
    "stage bad name": "[stages.\"bad name!\"]\nengine = \"python\"\nfunction = \"json:dumps\"",
    "stage not a table": "[stages]\nc = 3",
    "lora bad limits": "[stages.llm.lora]\nmax_loras = 0\nmax_lora_rank = 7",
    "lora bad adapter": "[stages.llm.lora]\nadapters = { \"bad name\" = \"x\", ok = 3, gone = \"no-such-folder\" }",
    "lora on a python stage": "[stages.a.lora]\nmax_loras = 2",
    "lora unknown key": "[stages.llm.lora]\nrank = 8",
    "cache unknown kind": "[stages.sd.cache]\nkind = \"nope\"",
    "cache bad option": "[stages.sd.cache]\nkind = \"first_block\"\nthreshold = -1\nspeed = 2",
    "media bad counts": "[stages.llm.media]\nimage = -1\ncolour = 1\nmax_bytes = 0",
    "vllm bad tensor keys": "[stages.llm]\nhidden_layers = [0, \"x\", -1, -1]\noutputs = [\"logits\"]",
    "vllm bad engine_core": "[stages.llm]\nengine_core = \"thread\"",
    "edge to an unknown stage": "[pipelines.p]\nedges = [{ from = \"a\", to = \"zzz\" }]",
    "edge to a stage not in the pipeline": "[pipelines.p]\nedges = [{ from = \"a\", to = \"llm\" }, { from = \"a\", to = \"b\" }]",
    "edge with window zero": "[pipelines.p]\nedges = [{ from = \"a\", to = \"b\", window = 0 }]",
    "edge with a bad window schedule": "[pipelines.p]\nedges = [{ from = \"a\", to = \"b\", window = [4, 0] }]",
    "edge with a window of wrong type": "[pipelines.p]\nedges = [{ from = \"a\", to = \"b\", window = \"big\" }]",
    "edge missing keys and unknown key": "[pipelines.p]\nedges = [{ src = \"a\" }]",
    "edge cycle and duplicate": "[pipelines.p]\nedges = [{ from = \"a\", to = \"b\" }, { from = \"b\", to = \"a\" }, "
                                "{ from = \"a\", to = \"b\" }]",
    "edge map not strings": "[pipelines.p]\nedges = [{ from = \"a\", to = \"b\", map = { prompt = 1 } }]",
    "pipeline bad timeout and retries": "[pipelines.p]\ntimeout_s = 0\nretries = -1",
    "pipeline unknown key": "[pipelines.p]\nwindow = 4",
    "pipeline empty and bad stages": "[pipelines.q]\nstages = []\n[pipelines.r]\nstages = [\"a\", 3, \"zz\", \"a\"]",
    "pipeline bad kept outputs": "[pipelines.p]\noutputs = { b = [\"text\"], zz = [\"x\"] }",
    "realtime bad values": "[pipelines.p.realtime]\noverload = \"drop\"\nmax_waiting_streams = -1\nmargin = 2\nx = 1",
    "realtime not a table": "[pipelines.p]\nrealtime = \"yes\"",
    "top-level unknown key": "stagse = 1",
}


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("config-messages")
    (root / "llm").mkdir()
    (root / "llm" / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 4}')
    (root / "sd").mkdir()
    (root / "sd" / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline", '
                                                   '"transformer": ["diffusers", "SD3Transformer2DModel"]}')
    return root


def messages(case: str, base: Path) -> list[str]:
    data = merge(tomllib.loads(BASE), tomllib.loads(CASES[case]))
    with pytest.raises(C.ConfigError) as err:
        C.parse(data, base=base)
    return [str(p).replace(str(base), "<base>") for p in err.value.problems]


def render(found: dict[str, list[str]]) -> str:
    return "".join(f"== {case}\n" + "".join(f"{m}\n" for m in lines) + "\n" for case, lines in found.items())


def read_snapshot() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for block in SNAPSHOT.read_text().split("\n\n"):
        if block.strip():
            head, *lines = block.strip("\n").split("\n")
            found[head.removeprefix("== ")] = lines
    return found


def test_the_base_config_is_valid(base: Path) -> None:
    cfg = C.parse(tomllib.loads(BASE), base=base)
    assert set(cfg.stages) == {"a", "b", "llm", "sd"}


def test_there_are_at_least_40_cases() -> None:
    assert len(CASES) >= 40


def test_the_snapshot_has_every_case_and_no_other(base: Path) -> None:
    if os.environ.get("OMNID_UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(render({case: messages(case, base) for case in CASES}))
    assert list(read_snapshot()) == list(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_messages_as_snapshotted(case: str, base: Path) -> None:
    assert messages(case, base) == read_snapshot()[case]


@pytest.mark.parametrize("case", list(CASES))
def test_every_message_names_its_key_and_no_library_words(case: str, base: Path) -> None:
    for line in messages(case, base):
        path, sep, message = line.partition(": ")
        assert sep and message, line
        assert re.match(r"(daemon|stages|pipelines)\b", path) or case == "top-level unknown key", line
        for word in ("type=", "Input should", "pydantic", "validation error", "Traceback"):
            assert word not in message, line


@pytest.mark.parametrize("case", ["daemon bad listen entries", "edge cycle and duplicate"])
def test_omnid_check_prints_the_same_and_exits_2(case: str, base: Path) -> None:
    path = base / f"{case.replace(' ', '-')}.toml"
    path.write_text(toml_dumps(merge(tomllib.loads(BASE), tomllib.loads(CASES[case]))))
    r = subprocess.run([sys.executable, "-m", "omnid", "--check", "-c", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    head, *lines = r.stderr.replace(str(base), "<base>").splitlines()
    assert head == f"omnid: invalid configuration <base>/{path.name}:"
    assert [line.removeprefix("  ") for line in lines] == read_snapshot()[case]
    path.write_text(toml_dumps(tomllib.loads(BASE)))
    ok = subprocess.run([sys.executable, "-m", "omnid", "--check", "-c", str(path)], capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0, ok.stderr

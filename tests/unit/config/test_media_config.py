"""The media side of the config, the job store and the OpenAI chat's content parts, without a daemon:
`[stages.NAME.media]` (defaults from the model's config.json, --check's problems with key paths),
vLLM's `limit_mm_per_prompt`, lists of files kept for a restart, data: URLs turned into job inputs.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from omnid import config as C
from omnid.engines.vllm_engine import engine_args
from omnid.media import MediaLimits
from omnid.store import _decode_inputs, _encode_inputs
from omnid.supervisor.http.openai.chat import ChatCompletionRequest
from omnid.supervisor.http.openai.chat import chat_messages as messages_of
from omnid.supervisor.http.openai.common import OpenAiError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def models(tmp_path: Path) -> Path:
    for name, config in {"llm": {"model_type": "llama"},
                         "vlm": {"model_type": "llava", "vision_config": {}, "image_token_index": 9},
                         "alm": {"model_type": "qwen2_audio", "audio_config": {}}}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "model_index.json").write_text("{}")
    return tmp_path


def parse(tmp_path: Path, stages: dict[str, Any], pipelines: dict[str, Any] | None = None) -> C.Config:
    data = {"daemon": {"socket": str(tmp_path / "s.sock"), "state_dir": "state", "lock_dir": "lock"},
            "stages": stages, "pipelines": pipelines or {name: {"stages": [name]} for name in stages}}
    return C.parse(data, base=tmp_path)


def problems(tmp_path: Path, stages: dict[str, Any], pipelines: dict[str, Any] | None = None) -> dict[str, str]:
    with pytest.raises(C.ConfigError) as e:
        parse(tmp_path, stages, pipelines)
    return {p.path: p.message for p in e.value.problems}


def test_media_defaults_come_from_the_models_config_json(models: Path) -> None:
    cfg = parse(models, {"see": {"engine": "vllm", "model": "vlm"}, "hear": {"engine": "vllm", "model": "alm"},
                         "text": {"engine": "vllm", "model": "llm"}, "draw": {"engine": "diffusers", "model": "sd"}})
    see, hear, text = cfg.stages["see"].media, cfg.stages["hear"].media, cfg.stages["text"].media
    assert (see.image, see.audio, see.video, see.detected) == (1, 0, 0, ("image",))
    assert (hear.image, hear.audio, hear.detected) == (0, 1, ("audio",))
    assert text.kinds == () and cfg.stages["draw"].media.kinds == ()
    assert see.max_pixels == MediaLimits().max_pixels


def test_media_table_sets_counts_and_limits(models: Path) -> None:
    cfg = parse(models, {"see": {"engine": "vllm", "model": "vlm",
                                 "media": {"image": 3, "max_pixels": 1000, "max_bytes": 5000}},
                         "hear": {"engine": "vllm", "model": "alm", "media": {"max_audio_s": 7.5}}})
    see, hear = cfg.stages["see"].media, cfg.stages["hear"].media
    assert (see.image, see.max_pixels, see.max_bytes) == (3, 1000, 5000)
    assert (hear.audio, hear.max_audio_s) == (1, 7.5)
    assert engine_args(cfg.stages["see"])["limit_mm_per_prompt"] == {"image": 3}
    off = parse(models, {"see": {"engine": "vllm", "model": "vlm", "media": {"image": 0}}}).stages["see"]
    assert off.media.kinds == () and engine_args(off)["limit_mm_per_prompt"] == {"image": 0}
    text = parse(models, {"text": {"engine": "vllm", "model": "llm"}}).stages["text"]
    assert "limit_mm_per_prompt" not in engine_args(text)


def test_media_problems_have_key_paths(models: Path) -> None:
    found = problems(models, {
        "see": {"engine": "vllm", "model": "vlm",
                "media": {"image": -1, "max_pixels": 0, "max_audio_s": "long", "colour": 1}},
        "text": {"engine": "vllm", "model": "llm", "media": {"image": 1}},
        "hear": {"engine": "vllm", "model": "alm", "args": {"limit_mm_per_prompt": {"audio": 2}}},
        "fn": {"engine": "python", "function": "json:dumps", "media": {"image": 1}},
        "bad": {"engine": "vllm", "model": "vlm", "media": "lots"},
    })
    assert "must be >= 0" in found["stages.see.media.image"]
    assert "must be > 0" in found["stages.see.media.max_pixels"]
    assert "must be an integer or a number" in found["stages.see.media.max_audio_s"]
    assert "unknown key" in found["stages.see.media.colour"]
    assert "takes no image input: its config.json has no vision_config" in found["stages.text.media.image"]
    assert "media table instead" in found["stages.hear.args.limit_mm_per_prompt"]
    assert "only vllm stages take media inputs" in found["stages.fn.media"]
    assert "must be a table" in found["stages.bad.media"]


def test_edges_that_hand_media_to_a_stage_that_takes_none(models: Path) -> None:
    stages = {"draw": {"engine": "diffusers", "model": "sd"}, "text": {"engine": "vllm", "model": "llm"},
              "see": {"engine": "vllm", "model": "vlm"}, "hear": {"engine": "vllm", "model": "alm"}}
    found = problems(models, stages, {
        "chain": {"stages": ["draw", "text"]},
        "mapped": {"stages": ["see", "hear"], "edges": [{"from": "see", "to": "hear", "map": {"image": "text"}}]},
        "fine": {"stages": ["draw", "see"]},
    })
    assert "stage 'text' takes no image input" in found["pipelines.chain.stages"]
    assert "stage 'hear' takes no image input (the media its model takes: audio" in \
        found["pipelines.mapped.edges[0].map.image"]
    assert not [k for k in found if k.startswith("pipelines.fine")]


def test_the_demo_config_passes_check() -> None:
    if not (ROOT / ".models" / "vlm" / "config.json").is_file():
        pytest.skip("no tiny models (python -m omnid.tinymodels .models)")
    result = subprocess.run([sys.executable, "-m", "omnid", "--check", "-c", str(ROOT / "etc" / "omnid-demo.toml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    cfg = C.load(ROOT / "etc" / "omnid-demo.toml")
    assert cfg.stages["describe"].media.image >= 1 and cfg.stages["listen"].media.audio >= 1


def test_store_keeps_lists_of_files() -> None:
    inputs = {"prompt": "x", "image": [b"\x89PNG1", b"\x89PNG2"], "audio": b"RIFF", "tags": ["a", "b"]}
    assert _decode_inputs(_encode_inputs(inputs)) == inputs


# ------------------------------------------------------------------ OpenAI content parts

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 8


def chat_messages(raw: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[str, bytes, str]]]:
    """A chat's messages as the door reads them: the body's model, then its media decoded."""
    return messages_of(ChatCompletionRequest.parse({"model": "m", "messages": raw}).messages)


def data_url(data: bytes, ctype: str = "image/png") -> str:
    return f"data:{ctype};base64," + base64.b64encode(data).decode()


def test_content_parts_become_media_inputs_in_order() -> None:
    messages, media = chat_messages([
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "compare"},
                                     {"type": "image_url", "image_url": {"url": data_url(b"one")}},
                                     {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"wav").decode(),
                                                                             "format": "wav"}},
                                     {"type": "image_url", "image_url": data_url(b"two")}]},
    ])
    assert messages[0] == {"role": "system", "content": "be brief"}          # text parts stay text
    assert messages[1]["content"] == [{"type": "text", "text": "compare"}, {"type": "image"}, {"type": "audio"},
                                      {"type": "image"}]
    assert [(kind, data, where) for kind, data, where in media] == [
        ("image", b"one", "messages[1].content[1]"), ("audio", b"wav", "messages[1].content[2]"),
        ("image", b"two", "messages[1].content[3]")]


@pytest.mark.parametrize("part,words", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "only data: URLs"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, "must be base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
    ({"type": "image_url"}, "image_url must be"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}}, "only \"wav\""),
    ({"type": "input_audio", "input_audio": "AAAA"}, "input_audio must be"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "not 'video_url'"),
    ({"type": "text", "text": 3}, "content parts are text"),
])
def test_bad_content_parts_name_their_place(part: dict[str, Any], words: str) -> None:
    with pytest.raises(OpenAiError) as e:
        chat_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    assert e.value.status == 400 and e.value.param == "messages[0].content[1]"
    assert words in e.value.message


def test_the_door_imports_no_decoder() -> None:
    """The supervisor checks media from their headers: no numpy, PIL, torch or vLLM in its process."""
    code = ("import sys, omnid.media, omnid.config, omnid.supervisor.http.api.app, omnid.supervisor.http.openai.routes; "
            "print(sorted(m for m in ('numpy', 'PIL', 'torch', 'vllm', 'transformers') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd="/", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

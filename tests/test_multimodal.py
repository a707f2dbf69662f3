"""Images and audio into vLLM stages: the tiny LLaVA (`.models/vlm`) and Qwen2-Audio (`.models/alm`)
in real stage workers under one real daemon, with real vLLM. Nothing is mocked.

Media come from everywhere a user sends them: a job's files (the client library and the real
`omnictl submit --file`), JSON samples, an upstream stage's output through an edge (diffusers'
image, the toy vocoder's WAV, a numpy stage's pixels and samples), and the OpenAI chat endpoint's
content parts. Bad media are refused at the door (400 naming the input) or, when only the model
can tell, fail their own job alone. A batch of image jobs runs in one stage at once, and a media
job can be cancelled mid-generation.

One daemon for the module: three vLLM stages, diffusers, python stages (about 30 s to start on
2 CPU cores, most of it importing vLLM three times at once).
"""

from __future__ import annotations

import base64
import io
import math
import os
import struct
import subprocess
import sys
import threading
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    MODELS,
    ROOT,
    RunningDaemon,
    build_tiny_models,
    demo_stage,
    module_daemon,
    openai_on_socket,
    python_stage,
    short_tmpdir,
    tiny_llm,
    tiny_sd,
)

from omnictl.client import ApiError

pytestmark = [pytest.mark.engines, pytest.mark.vllm]

PIXELS = 256 * 256              # the describe stage's media.max_pixels
AUDIO_S = 25                    # the listen stage's media.max_audio_s


def png(color: str = "red", size: tuple[int, int] = (64, 64), fmt: str = "PNG") -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, fmt)
    return buf.getvalue()


def wav(freq: float = 440.0, seconds: float = 1.0, rate: int = 22050) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(12000 * math.sin(2 * math.pi * freq * t / rate)))
                               for t in range(int(rate * seconds))))
    return buf.getvalue()


def b64file(data: bytes, filename: str | None = None) -> dict[str, Any]:
    return {"b64": base64.b64encode(data).decode("ascii"), **({"filename": filename} if filename else {})}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    build_tiny_models("llm", "sd", "vlm", "alm")
    d = short_tmpdir()
    greedy = {"max_tokens": 8, "temperature": 0.0, "seed": 7}
    stages = {
        "describe": tiny_llm(greedy, model=MODELS / "vlm", max_inflight=4, queue_capacity=8,
                             media={"image": 2, "max_pixels": PIXELS}),
        "listen": tiny_llm(greedy, model=MODELS / "alm", media={"audio": 1, "max_audio_s": AUDIO_S}),
        "expand": tiny_llm({"max_tokens": 12, "seed": 7}, max_model_len=256),
        "draw": tiny_sd({"num_inference_steps": 2, "seed": 0}),
        "speak": demo_stage("vocoder", defaults={"seconds_per_word": 0.05}),
        "tone": python_stage("mediastages", "tone"),
        "picture": python_stage("mediastages", "picture"),
    }
    pipelines = {
        "describe": {"stages": ["describe"]},
        "listen": {"stages": ["listen"]},
        "chat": {"stages": ["expand"]},
        "draw_describe": {"stages": ["draw", "describe"],
                          "edges": [{"from": "draw", "to": "describe", "map": {"image": "image", "prompt": "prompt"}}]},
        "speak_listen": {"stages": ["expand", "speak", "listen"],
                         "edges": [{"from": "expand", "to": "speak", "window": 4, "map": {"text": "text"}},
                                   {"from": "speak", "to": "listen", "map": {"audio": "audio"}}]},
        "tone_listen": {"stages": ["tone", "listen"]},
        "picture_describe": {"stages": ["picture", "describe"]},
    }
    with module_daemon(d, stages, pipelines, {"heartbeat_timeout_s": 60.0}) as rd:
        yield rd


def run(d: RunningDaemon, pipeline: str, inputs: dict[str, Any], params: dict[str, Any] | None = None,
        state: str = "succeeded") -> dict[str, Any]:
    """Submit, wait for the end; the job document (in `state`, else the test fails with why)."""
    job = d.submit(pipeline, inputs, params)
    doc = d.wait(job)
    assert doc["state"] == state, (doc["state"], doc["error"], d.diagnose(job))
    return doc


def text_of(d: RunningDaemon, doc: dict[str, Any]) -> str:
    data, ctype = d.client.output(doc["id"], "text")
    assert ctype.startswith("text/plain")
    return data.decode()


def refused(d: RunningDaemon, pipeline: str, inputs: dict[str, Any]) -> ApiError:
    before = len(d.client.jobs(pipeline=pipeline, limit=1000)["jobs"])
    with pytest.raises(ApiError) as e:
        d.submit(pipeline, inputs)
    assert e.value.status == 400, e.value
    assert len(d.client.jobs(pipeline=pipeline, limit=1000)["jobs"]) == before      # no job was made
    return e.value


# ------------------------------------------------------------------ images


def test_an_image_file_is_described(daemon: RunningDaemon) -> None:
    doc = run(daemon, "describe", {"image": b64file(png("red"), "red.png"), "prompt": "What is this?"})
    assert text_of(daemon, doc).strip()
    assert doc["inputs"]["image"] == {"filename": "red.png", "size": len(png("red")), "format": "PNG",
                                      "width": 64, "height": 64}
    # media alone is a job too: the stage's template gets the image and no text
    assert text_of(daemon, run(daemon, "describe", {"image": b64file(png("blue", fmt="JPEG"))})).strip()


def test_the_model_sees_the_pixels(daemon: RunningDaemon) -> None:
    """Greedy decoding from different images gives different text: the vision tower's features
    reach the language model (the tiny model's words are random, but not independent of the image)."""
    texts = {color: text_of(daemon, run(daemon, "describe", {"image": b64file(png(color))},
                                        {"describe": {"max_tokens": 12}}))
             for color in ("red", "blue", "white")}
    assert len(set(texts.values())) > 1, texts
    again = text_of(daemon, run(daemon, "describe", {"image": b64file(png("blue"))}, {"describe": {"max_tokens": 12}}))
    assert again == texts["blue"]


def test_several_images_in_one_job(daemon: RunningDaemon) -> None:
    doc = run(daemon, "describe", {"image": [b64file(png("red"), "a.png"), b64file(png("blue"), "b.png")],
                                   "prompt": "Compare them."})
    assert text_of(daemon, doc).strip()
    assert [i["filename"] for i in doc["inputs"]["image"]] == ["a.png", "b.png"]


def test_omnictl_submit_with_a_file(daemon: RunningDaemon, tmp_path: Path) -> None:
    photo = tmp_path / "photo.png"
    photo.write_bytes(png("green"))
    clip = tmp_path / "clip.wav"
    clip.write_bytes(wav(330, 1.5, 16000))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for pipeline, arg in (("describe", f"image={photo}"), ("listen", f"audio={clip}")):
        out = tmp_path / pipeline
        result = subprocess.run([sys.executable, "-m", "omnictl", "--socket", str(daemon.socket), "submit", pipeline,
                                 "--file", arg, "--wait", "-o", str(out)], env=env, capture_output=True, text=True,
                                timeout=120, cwd=tmp_path)
        assert result.returncode == 0, result
        assert (out / "text.txt").read_text().strip(), result
        assert f"{pipeline}: finished" in result.stderr


def test_an_upstream_image_through_an_edge(daemon: RunningDaemon) -> None:
    """diffusers draws, the vision-language stage describes what it drew (a PIL image, no file)."""
    doc = run(daemon, "draw_describe", {"prompt": "a red fox in the snow"})
    assert text_of(daemon, doc).strip()
    assert doc["stages"]["draw"]["state"] == doc["stages"]["describe"]["state"] == "succeeded"
    # a numpy stage's pixels (H, W, 3) go the same way
    assert text_of(daemon, run(daemon, "picture_describe", {}, {"picture": {"level": 30}})).strip()


# ------------------------------------------------------------------ audio


def test_a_wav_file_is_heard_at_any_rate(daemon: RunningDaemon) -> None:
    """22.05 kHz and 8 kHz WAVs are resampled to the 16 kHz of the model's feature extractor."""
    for rate in (22050, 8000, 44100):
        doc = run(daemon, "listen", {"audio": b64file(wav(440, 1.0, rate), f"tone{rate}.wav"),
                                     "prompt": "What do you hear?"})
        assert text_of(daemon, doc).strip()
        assert doc["inputs"]["audio"]["rate"] == rate and doc["inputs"]["audio"]["seconds"] == 1.0


def test_json_samples_with_their_rate(daemon: RunningDaemon) -> None:
    samples = [round(0.4 * math.sin(2 * math.pi * 300 * t / 11025), 5) for t in range(11025)]
    doc = run(daemon, "listen", {"audio": {"samples": samples, "rate": 11025}})
    assert text_of(daemon, doc).strip()
    assert doc["inputs"]["audio"]["samples"] == 11025 and doc["inputs"]["audio"]["rate"] == 11025


def test_the_model_hears_the_sound(daemon: RunningDaemon) -> None:
    """As for images: different sounds, different greedy text (a tone, noise, a chirp)."""
    import numpy as np

    t = np.arange(32000) / 16000
    clips = {"tone": 0.5 * np.sin(2 * np.pi * 300 * t), "noise": 0.3 * np.random.default_rng(0).standard_normal(t.size),
             "chirp": 0.5 * np.sin(2 * np.pi * (100 + 2000 * t) * t)}
    texts = {name: text_of(daemon, run(daemon, "listen", {"audio": {"samples": x.round(4).tolist(), "rate": 16000}},
                                       {"listen": {"max_tokens": 12}}))
             for name, x in clips.items()}
    assert len(set(texts.values())) > 1, texts


def test_upstream_audio_through_edges(daemon: RunningDaemon) -> None:
    """The LLM writes, the toy vocoder speaks (a streamed WAV whose header has no length), the
    audio-language stage listens; and a numpy stage's (samples, rate) at 22.05 kHz."""
    doc = run(daemon, "speak_listen", {"prompt": "good morning"})
    assert text_of(daemon, doc).strip()
    assert all(doc["stages"][s]["state"] == "succeeded" for s in ("expand", "speak", "listen"))
    assert text_of(daemon, run(daemon, "tone_listen", {}, {"tone": {"rate": 22050, "seconds": 1.5}})).strip()


# ------------------------------------------------------------------ the OpenAI chat endpoint


@pytest.fixture(scope="module")
def openai_client(daemon: RunningDaemon) -> Iterator[Any]:
    with openai_on_socket(daemon, 120) as client:
        yield client


def test_openai_chat_with_an_image_url(daemon: RunningDaemon, openai_client: Any) -> None:
    url = "data:image/png;base64," + base64.b64encode(png("red")).decode()
    chat = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    assert openai_client.models.retrieve("describe").model_extra["omnid"]["media"] == ["image"]
    assert openai_client.models.retrieve("chat").model_extra["omnid"]["media"] == []
    answer = openai_client.chat.completions.with_raw_response.create(model="describe", messages=chat, max_tokens=6)
    completion = answer.parse()
    assert completion.choices[0].message.content.strip()
    assert completion.usage.completion_tokens == 6
    job = daemon.client.job(answer.headers["x-omnid-job"])
    assert job["state"] == "succeeded"
    assert job["inputs"]["image"] == [{"filename": None, "size": len(png("red")), "format": "PNG",
                                       "width": 64, "height": 64}]
    # streamed, the same answer (greedy, same seed)
    stream = openai_client.chat.completions.create(model="describe", messages=chat, max_tokens=6, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        completion.choices[0].message.content


def test_a_text_chat_to_a_media_model(openai_client: Any) -> None:
    """No media: the chat still goes through the model's processor's template."""
    completion = openai_client.chat.completions.create(
        model="describe", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        max_tokens=4)
    assert completion.choices[0].message.content.strip()


def test_openai_chat_with_input_audio(openai_client: Any) -> None:
    chat = [{"role": "system", "content": "You listen."},
            {"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(500, 1.0, 24000)).decode(),
                                                        "format": "wav"}},
                {"type": "text", "text": "What do you hear?"}]}]
    completion = openai_client.chat.completions.create(model="listen", messages=chat, max_tokens=5)
    assert completion.choices[0].message.content.strip()


def test_openai_refuses_bad_media_naming_the_part(openai_client: Any) -> None:
    openai = pytest.importorskip("openai")
    text_url = "data:image/png;base64," + base64.b64encode(b"just some text").decode()
    good_url = "data:image/png;base64," + base64.b64encode(png()).decode()
    cases = [
        ("describe", [{"type": "image_url", "image_url": {"url": text_url}}], "invalid_media", "not an image"),
        ("chat", [{"type": "image_url", "image_url": {"url": good_url}}], "media_not_accepted", "takes no image"),
        ("describe", [{"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}], None, "data: URLs"),
        ("listen", [{"type": "input_audio", "input_audio": {"data": base64.b64encode(png()).decode(),
                                                           "format": "wav"}}], "invalid_media", "not a WAV file"),
    ]
    for model, parts, code, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            openai_client.chat.completions.create(model=model, messages=[
                {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}])
        error = e.value.body
        assert error["param"] == "messages[0].content[1]" and words in error["message"], error
        if code:
            assert error["code"] == code, error


# ------------------------------------------------------------------ bad media


def test_bad_media_is_refused_at_the_door_naming_the_input(daemon: RunningDaemon) -> None:
    cases: list[tuple[str, dict[str, Any], str, str]] = [
        ("describe", {"image": b64file(b"Dear diary, ...", "notes.txt")}, "invalid_media",
         "input 'image' (notes.txt): not an image"),
        ("describe", {"image": b64file(wav(), "clip.wav")}, "invalid_media", "this is a WAV file"),
        ("describe", {"image": b64file(png(size=(300, 300)), "big.png")}, "invalid_media",
         f"(90000 pixels); the stage takes at most {PIXELS} pixels"),
        ("describe", {"image": [b64file(png())] * 3}, "invalid_media", "3 images, but the stage takes at most 2"),
        ("describe", {"image": "cat.png"}, "invalid_media", "input 'image' must be a file"),
        ("listen", {"audio": b64file(png(), "photo.png")}, "invalid_media", "input 'audio' (photo.png): not a WAV file"),
        ("listen", {"audio": b64file(wav(seconds=AUDIO_S + 1, rate=8000), "long.wav")}, "invalid_media",
         f"26.0 s of audio; the stage takes at most {AUDIO_S} s"),
        ("listen", {"audio": {"samples": [0.1, "loud"], "rate": 8000}}, "invalid_media", "finite numbers"),
        ("chat", {"prompt": "hi", "image": b64file(png())}, "media_not_accepted",
         "input 'image': pipeline 'chat' starts with stage 'expand', whose model takes no image input"),
        ("describe", {"audio": b64file(wav())}, "media_not_accepted", "takes no audio input (the media it takes: image)"),
        ("describe", {"image": b64file(png("red", (128, 128))[:300], "cut.png")}, "invalid_media",
         "input 'image' (cut.png): a truncated PNG (300 bytes"),
        ("describe", {"image": b64file(png("red", (128, 128))[:-12], "no-end.png")}, "invalid_media",
         "without its IEND chunk"),
    ]
    for pipeline, inputs, code, words in cases:
        e = refused(daemon, pipeline, inputs)
        assert e.code == code and words in e.message, (pipeline, e.code, e.message)
        assert e.body["error"]["input"] in ("image", "audio")


def test_a_model_side_failure_fails_that_job_alone(daemon: RunningDaemon) -> None:
    """What only the model can tell: an image whose file is whole but whose pixels are not (the
    door reads headers and chunk lengths only), and a clip whose tokens do not fit the model's
    max_model_len. Each fails as the request's fault (`input_rejected`), not the stage's."""
    pids = {name: daemon.stage_pid(name) for name in ("describe", "listen")}
    good = png("red", (128, 128))
    at = good.index(b"IDAT")                            # its pixel data zeroed, every chunk length kept
    (length,) = struct.unpack(">I", good[at - 4:at])
    broken = good[:at + 4] + bytes(length) + good[at + 4 + length:]
    jobs = {"broken": daemon.submit("describe", {"image": b64file(broken, "broken.png")}),
            "good": daemon.submit("describe", {"image": b64file(good)}),
            "long": daemon.submit("listen", {"audio": b64file(wav(300, 20.0, 8000))}),
            "short": daemon.submit("listen", {"audio": b64file(wav(300, 1.0, 8000))})}
    docs = {name: daemon.wait(job) for name, job in jobs.items()}
    assert docs["broken"]["state"] == "failed"
    assert "input 'image': the image cannot be decoded" in docs["broken"]["error"]["message"]
    assert docs["broken"]["error"]["stage"] == "describe"
    assert docs["broken"]["error"]["code"] == docs["long"]["error"]["code"] == "input_rejected"
    assert docs["long"]["state"] == "failed"
    assert "longer than the maximum model length" in docs["long"]["error"]["message"]
    assert docs["good"]["state"] == docs["short"]["state"] == "succeeded"
    assert {name: daemon.stage_pid(name) for name in pids} == pids          # no worker was restarted


def test_an_edge_into_a_stage_takes_its_limits_too(daemon: RunningDaemon) -> None:
    """An upstream image larger than media.max_pixels fails its job with a reason (no door to stop it)."""
    doc = run(daemon, "picture_describe", {}, {"picture": {"side": 300}}, state="failed")
    assert "input 'image'" in doc["error"]["message"] and f"at most {PIXELS} pixels" in doc["error"]["message"]


# ------------------------------------------------------------------ batching and cancelling


def test_a_batch_of_image_jobs_runs_at_once(daemon: RunningDaemon) -> None:
    colors = ["red", "blue", "green", "white", "black", "yellow"]
    params = {"describe": {"max_tokens": 48, "ignore_eos": True}}
    jobs: list[str] = [""] * len(colors)

    def submit(i: int) -> None:
        jobs[i] = daemon.submit("describe", {"image": b64file(png(colors[i]))}, params)
    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(colors))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    docs = [daemon.wait(job) for job in jobs]
    assert [d["state"] for d in docs] == ["succeeded"] * len(colors), [d["error"] for d in docs]
    spans = sorted((d["stages"]["describe"]["started_at"], d["stages"]["describe"]["finished_at"]) for d in docs)
    overlapping = max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans)
    assert overlapping >= 2, spans                 # vLLM had several media jobs in one batch
    assert all(len(text_of(daemon, d).split()) >= 24 for d in docs)


def test_cancel_a_media_job(daemon: RunningDaemon) -> None:
    pid = daemon.stage_pid("describe")
    job = daemon.submit("describe", {"image": b64file(png("red"))},
                        {"describe": {"max_tokens": 400, "ignore_eos": True, "temperature": 0.9}})
    for ev in daemon.follow(job, 60, "the first token of the media job"):
        if ev["type"] == "segment":
            break
    assert daemon.client.cancel(job)["state"] == "cancelled"
    doc = daemon.wait(job)
    assert doc["state"] == "cancelled" and doc["stages"]["describe"]["state"] == "cancelled"
    assert doc["stages"]["describe"]["segments"] < 400
    assert text_of(daemon, run(daemon, "describe", {"image": b64file(png("blue"))})).strip()
    assert daemon.stage_pid("describe") == pid


def test_discovery_says_what_media_a_pipeline_takes(daemon: RunningDaemon) -> None:
    inputs = daemon.client.pipeline("describe")["inputs"]["describe"]
    assert inputs["inputs"]["prompt"]["required"] is False
    assert "at most 2 per job" in inputs["inputs"]["image"]["description"]
    assert inputs["media"]["image"] == 2 and inputs["media"]["max_pixels"] == PIXELS
    assert "image" not in daemon.client.pipeline("chat")["inputs"]["expand"]["inputs"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    shown = subprocess.run([sys.executable, "-m", "omnictl", "--socket", str(daemon.socket), "pipelines", "describe"],
                           env=env, capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and "image  file, optional  (stage describe, vllm)" in shown.stdout, shown
    assert "at most 2 per job" in shown.stdout
    info = daemon.stages()["listen"]["info"]
    assert info["media"] == {"audio": 1} and info["audio_rate"] == 16000


def test_media_answers_match_the_openapi_document(daemon: RunningDaemon) -> None:
    """The job request, the job documents with media summaries, the pipeline description and the
    door's refusal, against GET /v1/openapi.json (as tests/test_discovery.py does for the rest)."""
    jsonschema = pytest.importorskip("jsonschema")
    doc = daemon.client.openapi()

    def check(schema_name: str, body: Any) -> None:
        jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{schema_name}",
                                         "components": doc["components"]}).validate(body)

    requests = [{"pipeline": "describe", "inputs": {"image": [b64file(png(), "a.png"), b64file(png("blue"))]}},
                {"pipeline": "listen", "inputs": {"audio": {"samples": [0.0, 0.5, -0.5], "rate": 8000}}}]
    for request in requests:
        check("JobRequest", request)
        job = daemon.client.submit(request["pipeline"], request["inputs"])
        check("NewJob", job)                   # (the 201: the job and its links)
        check("Job", daemon.wait(job["id"]))
    check("PipelineDescription", daemon.client.pipeline("describe"))
    with pytest.raises(ApiError) as e:
        daemon.submit("describe", {"image": b64file(b"text")})
    check("Error", e.value.body)
    assert e.value.body["error"]["input"] == "image"

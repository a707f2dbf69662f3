"""A stage's `lora` table and `omnid.lora`'s checks of an adapter folder, in-process.

The adapters and models are fakes written here: a safetensors file is an 8-byte header length, a
JSON header (names, shapes) and the bytes, and `omnid.lora` reads only the header. So a "model" is
one weight file whose shapes the adapters must fit.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from omnid import config as C
from omnid import lora as L
from omnid.engines.capabilities import job_param_problem


def _safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        size = 4
        for n in shape:
            size *= n
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def _model(folder: Path, hidden: int = 16) -> Path:
    (folder / "config.json").parent.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    _safetensors(folder / "model.safetensors", {"model.layers.0.self_attn.q_proj.weight": [hidden, hidden],
                                                "model.layers.0.mlp.up_proj.weight": [4 * hidden, hidden]})
    return folder


def _adapter(folder: Path, rank: int = 4, hidden: int = 16, module: str = "self_attn.q_proj") -> Path:
    out = 4 * hidden if "up_proj" in module else hidden
    prefix = f"base_model.model.model.layers.0.{module}"
    _safetensors(folder / "adapter_model.safetensors", {f"{prefix}.lora_A.weight": [rank, hidden],
                                                        f"{prefix}.lora_B.weight": [out, rank]})
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    return folder


def _config(tmp_path: Path, lora: Any, **stage: Any) -> dict[str, Any]:
    return {"stages": {"chat": {"engine": "vllm", "model": str(_model(tmp_path / "llm")), **stage,
                                **({"lora": lora} if lora is not None else {})}},
            "pipelines": {"chat": {"stages": ["chat"]}}}


def _problems(data: dict[str, Any], base: Path) -> dict[str, str]:
    with pytest.raises(C.ConfigError) as err:
        C.parse(copy.deepcopy(data), base=base)
    return {p.path: p.message for p in err.value.problems}


def test_a_lora_table_parses_with_its_adapters_resolved(tmp_path: Path) -> None:
    _adapter(tmp_path / "sql")
    cfg = C.parse(_config(tmp_path, {"adapters": {"sql": "sql"}, "max_loras": 2, "max_lora_rank": 8},
                          defaults={"adapter": "sql"}), base=tmp_path)
    stage = cfg.stages["chat"]
    assert stage.lora is not None and stage.lora.max_loras == 2 and stage.lora.max_lora_rank == 8
    assert stage.adapters == {"sql": tmp_path / "sql"}
    # the adapter set is not part of the stage's definition (run-time adds keep the worker)
    assert stage.with_adapters({}) == stage and stage.with_adapters({}).adapters == {}


def test_check_refuses_no_adapter_a_rank_too_high_and_another_base(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _adapter(tmp_path / "big", rank=16)
    _adapter(tmp_path / "other", hidden=32)                      # made for a wider model
    _adapter(tmp_path / "elsewhere", module="self_attn.k_proj")  # a module the model has not
    found = _problems(_config(tmp_path, {"max_lora_rank": 8, "adapters": {
        "none": "empty", "big": "big", "other": "other", "elsewhere": "elsewhere", "gone": "nowhere"}}), tmp_path)
    assert "holds no LoRA adapter" in found["stages.chat.lora.adapters.none"]
    assert "rank is 16, above the stage's max_lora_rank (8)" in found["stages.chat.lora.adapters.big"]
    assert "another base model" in found["stages.chat.lora.adapters.other"]
    assert "does not have" in found["stages.chat.lora.adapters.elsewhere"]
    assert "does not exist" in found["stages.chat.lora.adapters.gone"]


def test_check_refuses_lora_keys_where_they_do_not_belong(tmp_path: Path) -> None:
    _adapter(tmp_path / "sql")
    found = _problems(_config(tmp_path, {"max_lora_rank": 12, "size": 1, "adapters": {"bad name": "sql"}},
                              args={"enable_lora": True}, defaults={"adapter": "nope"}), tmp_path)
    assert "vLLM takes one of" in found["stages.chat.lora.max_lora_rank"]
    assert "unknown key" in found["stages.chat.lora.size"]
    assert "adapter's name" in found["stages.chat.lora.adapters.bad name"]
    assert "lora table" in found["stages.chat.args.enable_lora"]
    assert "has no adapter 'nope'" in found["stages.chat.defaults.adapter"]
    found = _problems(_config(tmp_path, None, defaults={"adapter": "sql"}), tmp_path)
    assert "no lora table" in found["stages.chat.defaults.adapter"]
    py = {"stages": {"f": {"engine": "python", "function": "os:getcwd", "lora": {}}},
          "pipelines": {"f": {"stages": ["f"]}}}
    assert "only vllm, diffusers stages" in _problems(py, tmp_path)["stages.f.lora"]


def test_the_job_params_and_their_door_checks() -> None:
    assert job_param_problem("draw", "diffusers", {}, "adapters", {"style": 0.8}) is None
    assert "weight" in (job_param_problem("draw", "diffusers", {}, "adapters", {"style": True}) or "")
    assert "no parameter 'adapters'" in (job_param_problem("chat", "vllm", {}, "adapters", {"a": 1}) or "")
    assert L.adapter_problem("chat", "vllm", {"a": Path("/x")}, "adapter", "a") is None
    why = L.adapter_problem("chat", "vllm", {"a": Path("/x")}, "adapter", "b")
    assert why == "params.chat.adapter: stage 'chat' has no adapter 'b' (its adapters: a)"
    assert L.job_adapters({"adapter": "a", "adapters": {"b": 0.5}}) == {"a": 1.0, "b": 0.5}
    assert L.job_adapters({}) == {}


def test_a_pipelines_adapters_are_its_last_lora_stages(tmp_path: Path) -> None:
    """`PIPELINE:ADAPTER` names an adapter of the pipeline's last stage with a `lora` table (the one
    that answers), not of an earlier one."""
    _adapter(tmp_path / "sql")
    _adapter(tmp_path / "poem")
    data = _config(tmp_path, {"adapters": {"sql": "sql"}})
    data["stages"]["write"] = dict(data["stages"]["chat"], lora={"adapters": {"poem": "poem"}})
    data["stages"]["plain"] = {k: v for k, v in data["stages"]["chat"].items() if k != "lora"}
    data["pipelines"] = {"two": {"stages": ["chat", "write", "plain"]}, "one": {"stages": ["plain", "chat"]},
                         "none": {"stages": ["plain"]}}
    cfg = C.parse(data, base=tmp_path)
    assert L.adapter_stage(cfg, cfg.pipelines["two"]) == "write"
    assert L.pipeline_adapters(cfg, cfg.pipelines["two"]) == ["poem"]
    assert L.adapter_stage(cfg, cfg.pipelines["one"]) == "chat"
    assert L.adapter_stage(cfg, cfg.pipelines["none"]) is None and L.pipeline_adapters(cfg, cfg.pipelines["none"]) == []


def test_inspect_reads_a_folder_or_a_file_and_says_what_is_wrong(tmp_path: Path) -> None:
    a = _adapter(tmp_path / "sql", rank=6)
    (a / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 6, "base_model_name_or_path": "llm"}))
    info = L.inspect(a)
    assert (info.path, info.weights, info.rank, info.base) == (a, a / "adapter_model.safetensors", 6, "llm")
    assert info.modules == {"base_model.model.model.layers.0.self_attn.q_proj": ((6, 16), (16, 6))}
    # the weight file itself; its folder's config still counts
    assert L.inspect(a / "adapter_model.safetensors").base == "llm"
    # without a config, or with an empty base: no base; a config without peft_type is a LoRA's
    (a / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": ""}))
    assert L.inspect(a).base is None
    (a / "adapter_config.json").unlink()
    assert L.inspect(a).base is None and L.inspect(a).rank == 6
    # diffusers' file name, and the lora.down/up spelling
    d = tmp_path / "style"
    _safetensors(d / "pytorch_lora_weights.safetensors", {"unet.x.lora.down.weight": [2, 8], "unet.x.lora.up.weight": [8, 2],
                                                          "unet.y.alpha": [1]})
    assert L.inspect(d).modules == {"unet.x": ((2, 8), (8, 2))} and L.inspect(d).weights.name == "pytorch_lora_weights.safetensors"

    def refused(path: Path) -> str:
        with pytest.raises(L.AdapterError) as e:
            L.inspect(path)
        return str(e.value)

    (tmp_path / "empty").mkdir()
    assert refused(tmp_path / "empty") == (f"{str(tmp_path / 'empty')!r} holds no LoRA adapter "
                                           "(no adapter_model.safetensors or pytorch_lora_weights.safetensors)")
    assert refused(tmp_path / "gone") == f"{str(tmp_path / 'gone')!r} does not exist"
    (tmp_path / "notes.txt").write_text("x")
    assert refused(tmp_path / "notes.txt") == f"{str(tmp_path / 'notes.txt')!r} is not an adapter folder nor a .safetensors file"
    (a / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    assert refused(a) == f"{str(a)!r} is a IA3 adapter, not a LoRA"
    (a / "adapter_config.json").write_text("[1]")
    assert refused(a) == f"{a / 'adapter_config.json'} is not a JSON object"
    (a / "adapter_config.json").write_text("{")
    assert refused(a).startswith(f"{a / 'adapter_config.json'} is not JSON: ")
    half = tmp_path / "half"
    _safetensors(half / "adapter_model.safetensors", {"m.lora_A.weight": [4, 16], "n.lora_B.weight": [16, 4]})
    assert refused(half) == f"{str(half / 'adapter_model.safetensors')!r} holds no LoRA weights (no lora_A/lora_B pairs)"


def test_describe_a_stages_lora(tmp_path: Path) -> None:
    _adapter(tmp_path / "sql")
    _adapter(tmp_path / "poem")
    cfg = C.parse(_config(tmp_path, {"adapters": {"sql": "sql", "poem": "poem"}, "max_loras": 3, "max_lora_rank": 16}),
                  base=tmp_path)
    assert L.describe(cfg.stages["chat"]) == {
        "base": str(tmp_path / "llm"), "adapters": [{"name": "poem", "path": str(tmp_path / "poem")},
                                                    {"name": "sql", "path": str(tmp_path / "sql")}],
        "max_loras": 3, "max_lora_rank": 16}
    assert L.describe(C.parse(_config(tmp_path, None), base=tmp_path).stages["chat"]) is None


def test_adapter_problem_names_the_stages_adapters() -> None:
    have = {"b": Path("/b"), "a": Path("/a")}
    assert L.adapter_problem("s", "diffusers", have, "adapters", {"a": 1, "b": 0.5}) is None
    assert L.adapter_problem("s", "diffusers", have, "adapters", {"a": 1, "c": 0.5}) == \
        "params.s.adapters: stage 's' has no adapter 'c' (its adapters: a, b)"
    assert L.adapter_problem("s", "vllm", {}, "adapter", "x") == \
        "params.s.adapter: stage 's' has no adapter 'x' (its adapters: none)"
    assert L.adapter_problem("s", "vllm", have, "adapter", ["a"]) is not None      # a name is a string
    assert L.adapter_problem("s", "vllm", have, "adapters", ["zzz"]) is None       # (not an object: its rule says so)


def test_safetensors_headers_that_are_not_one(tmp_path: Path) -> None:
    def refused(raw: bytes) -> str:
        (tmp_path / "w.safetensors").write_bytes(raw)
        with pytest.raises(L.AdapterError) as e:
            L.header(tmp_path / "w.safetensors")
        return str(e.value)

    f = tmp_path / "w.safetensors"
    assert refused(b"1234567") == f"{f} is not a safetensors file (too short)"
    assert refused(struct.pack("<Q", 2**63)) == f"{f} is not a safetensors file (header size {2**63})"
    assert refused(struct.pack("<Q", L.MAX_HEADER + 1)) == f"{f} is not a safetensors file (header size {L.MAX_HEADER + 1})"
    assert refused(struct.pack("<Q", 3) + b"{x}") == f"{f} is not a safetensors file (its header is not JSON)"
    assert refused(struct.pack("<Q", 2) + b"[]") == f"{f} is not a safetensors file"
    f.write_bytes(struct.pack("<Q", L.MAX_HEADER) + b"{}")        # the largest size said (the file may be shorter)
    assert L.header(f) == {}


def test_an_adapter_against_its_base_model(tmp_path: Path) -> None:
    model = _model(tmp_path / "llm")
    fits = L.inspect(_adapter(tmp_path / "ok", module="mlp.up_proj"))
    assert L.base_problem(fits, model) is None
    wide = L.inspect(_adapter(tmp_path / "wide", hidden=32))
    assert L.base_problem(wide, model) == (
        "its 'base_model.model.model.layers.0.self_attn.q_proj' is for a weight of shape [32, 32], but the model in "
        f"{str(model)!r} has [16, 16]: another base model")
    other = L.inspect(_adapter(tmp_path / "k", module="self_attn.k_proj"))
    assert L.base_problem(other, model) == ("it adapts 'base_model.model.model.layers.0.self_attn.k_proj', which the "
                                            f"model in {str(model)!r} does not have: another base model?")
    # a diffusers pipeline: its components are subfolders, an adapter names them first; a weight with a
    # base_layer; a 1-d lora weight (a bias's) is not compared; entries without a shape are skipped
    pipe = tmp_path / "pipe"
    _safetensors(pipe / "unet" / "diffusion_pytorch_model.safetensors",
                 {"down.attn.to_q.base_layer.weight": [8, 4, 1, 1], "down.attn.to_k.weight": [8, 4]})
    (pipe / "unet" / "extra.safetensors").parent.mkdir(exist_ok=True)
    raw = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    (pipe / "unet" / "extra.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    (pipe / "unet" / "a_broken.safetensors").write_bytes(b"x")         # skipped, the others still read
    style = tmp_path / "style"
    _safetensors(style / "pytorch_lora_weights.safetensors",
                 {"unet.down.attn.to_q.lora.down.weight": [2, 4], "unet.down.attn.to_q.lora.up.weight": [8, 2],
                  "unet.down.attn.to_k.lora_down.weight": [2], "unet.down.attn.to_k.lora_up.weight": [8]})
    info = L.inspect(style)
    assert info.modules == {"unet.down.attn.to_q": ((2, 4), (8, 2)), "unet.down.attn.to_k": ((2,), (8,))}
    assert L.base_problem(info, pipe) is None
    _safetensors(style / "pytorch_lora_weights.safetensors",
                 {"unet.down.attn.to_q.lora_A.weight": [2, 5], "unet.down.attn.to_q.lora_B.weight": [8, 2]})
    assert "has [8, 4]: another base model" in (L.base_problem(L.inspect(style), pipe) or "")
    assert L.base_problem(info, tmp_path / "empty_model") is None     # no safetensors to compare with

"""A `[pipelines.NAME]` table: its stages, its edges (`from`, `to`, `window` or a window schedule,
`map`, `transform`), no cycle, every stage on an edge, the outputs kept from stages that are not
last; and what an edge hands on must be what its stages can give and take (media, tensors). The
tables' keys, types and bounds are their models' (schema.py's `PipelineTable`, `EdgeTable`,
`RealtimeTable`, which they are read through).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnid.config.checker import Checker, check_callable_ref, typename
from omnid.config.schema import EdgeTable, PipelineTable, RealtimeTable, read
from omnid.config.stages import model_dims
from omnid.config_types import FULL_WINDOW, EdgeConfig, PipelineConfig, RealtimeConfig, StageConfig
from omnid.engines.capabilities import capabilities, engines_that
from omnid.media import MEDIA_KINDS

# Engines a streaming edge (window = N > 0) may feed (why the others cannot be: their `whole_input`).
STREAM_ENGINES = engines_that(lambda e: e.streamed_input)


def _parse_edge(c: Checker, raw: Any, path: str, members: tuple[str, ...],
                known_stages: Mapping[str, Any]) -> EdgeConfig | None:
    edge = read(c, EdgeTable, raw, path)
    if edge is None:
        return None
    for key in ("from", "to"):
        if key not in raw:
            c.add(f"{path}.{key}", "is required")
    src, dst = edge.from_, edge.to
    ok = src is not None and dst is not None
    for key, stage in (("from", src), ("to", dst)):
        if stage is None:
            continue
        if stage not in known_stages:
            c.add(f"{path}.{key}", f"unknown stage {stage!r}")
            ok = False
        elif stage not in members:
            c.add(f"{path}.{key}", f"stage {stage!r} is not in this pipeline's stages")
            ok = False
    if ok and src == dst:
        c.add(path, f"an edge from {src!r} to itself is a cycle")
        ok = False
    window, schedule = _parse_window(c, raw.get("window", FULL_WINDOW), f"{path}.window")
    if window is None:
        window, ok = FULL_WINDOW, False
    dst_stage = known_stages.get(dst) if isinstance(dst, str) else None
    whole = capabilities(dst_stage.engine).whole_input if isinstance(dst_stage, StageConfig) else ""
    if window > 0 and isinstance(dst_stage, StageConfig) and not capabilities(dst_stage.engine).streamed_input:
        c.add(f"{path}.window", f"stage {dst!r} ({dst_stage.engine}) cannot be fed by a window edge: "
                                f"{whole}. Only {', '.join(STREAM_ENGINES)} stages take streamed inputs; use window = -1")
        ok = False
    mapping, transform = edge.map, edge.transform
    if isinstance(raw.get("map"), dict) and not all(isinstance(v, str) for v in raw["map"].values()):
        ok = False                      # (the model said which)
    if transform is not None:
        # A transform runs in the upstream stage's worker, with that stage's python_path.
        src_stage = known_stages.get(src) if src is not None else None
        src_path = src_stage.python_path if isinstance(src_stage, StageConfig) else ()
        check_callable_ref(c, transform, f"{path}.transform", src_path)
    src_stage = known_stages.get(src) if isinstance(src, str) else None
    gives = capabilities(src_stage.engine).gives if isinstance(src_stage, StageConfig) else None
    if mapping is not None and isinstance(src_stage, StageConfig) and gives is not None:
        for k, v in mapping.items():
            if isinstance(v, str) and v not in gives:
                c.add(f"{path}.map.{k}", f"stage {src!r} ({src_stage.engine}) cannot give {v!r}: it gives "
                                         f"{', '.join(gives)}")
                ok = False
    if not ok or src is None or dst is None:
        return None
    return EdgeConfig(src=src, dst=dst, window=window, map=mapping, transform=transform, schedule=schedule)


def _parse_window(c: Checker, raw: Any, path: str) -> tuple[int | None, tuple[int, ...]]:
    """`window`: -1, N > 0, or a schedule [N1, N2, ...] (the last size repeats): (first, schedule),
    or (None, ()) when it is none of them."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw == FULL_WINDOW or raw > 0:
            return raw, ()
        c.add(path, f"must be -1 (full trigger) or a segment count > 0, not {raw}")
        return None, ()
    if isinstance(raw, list):
        if not raw:
            c.add(path, "a window schedule lists at least one size, e.g. [4, 8, 16, 25]")
            return None, ()
        bad = [i for i, n in enumerate(raw) if not isinstance(n, int) or isinstance(n, bool) or n <= 0]
        for i in bad:
            c.add(f"{path}[{i}]", f"a window size is a segment count > 0, not {raw[i]!r}")
        if bad:
            return None, ()
        return int(raw[0]), tuple(int(n) for n in raw)
    c.add(path, f"must be an integer, not {typename(raw)} (or a list of integers: a schedule)")
    return None, ()


def _check_tensor_edges(c: Checker, path: str, edge: EdgeConfig, stages: Mapping[str, StageConfig]) -> None:
    """An edge that hands a vllm stage `prompt_embeds` or `prompt_token_ids` from a vllm stage must
    give what it can take: hidden states of its width (one layer), token ids."""
    src, dst = stages.get(edge.src), stages.get(edge.dst)
    if edge.map is None or src is None or dst is None or not capabilities(dst.engine).tensors \
            or not capabilities(src.engine).tensors:
        return
    for down, up in edge.map.items():
        where = f"{path}.map.{down}"
        if down == "prompt_embeds":
            if up != "hidden_states":
                c.add(where, f"prompt_embeds are (tokens, hidden) rows: map them from \"hidden_states\", not {up!r}")
                continue
            if len(src.hidden_layers) > 1:
                c.add(where, f"stage {edge.src!r} gives {len(src.hidden_layers)} layers (hidden_layers): "
                             "prompt_embeds take one; use a transform to pick it")
            mine, theirs = model_dims(src.model), model_dims(dst.model)
            if mine is not None and theirs is not None and mine[0] != theirs[0]:
                c.add(where, f"stage {edge.src!r} gives hidden states of width {mine[0]}, but the model of "
                             f"stage {edge.dst!r} takes embeddings of width {theirs[0]} (hidden_size in "
                             f"{dst.model}/config.json): use a transform that projects them")
        elif down == "prompt_token_ids" and up not in ("token_ids", "prompt_token_ids"):
            c.add(where, f"prompt_token_ids are token ids: map them from \"token_ids\" (or "
                         f"\"prompt_token_ids\"), not {up!r}")


def _check_media_edges(c: Checker, path: str, edges: list[EdgeConfig], stages: Mapping[str, StageConfig]) -> None:
    """An edge that hands media (by its map, or a diffusers stage's `image` by name) to a vllm stage
    whose model takes none would fail every job: said now."""
    for edge in edges:
        src, dst = stages.get(edge.src), stages.get(edge.dst)
        if dst is None or not capabilities(dst.engine).media:
            continue
        if edge.map is not None:
            names = [(f"{path}.map.{k}", k) for k in edge.map]
        elif edge.transform is None and src is not None and capabilities(src.engine).answer == "image":
            names = [(path, "image")]           # what a diffusers stage gives, passed on by name
        else:
            names = []
        for where, kind in names:
            if kind in MEDIA_KINDS and dst.media.count(kind) == 0:
                c.add(where, f"stage {edge.dst!r} takes no {kind} input (the media its model takes: "
                             f"{', '.join(dst.media.kinds) or 'none'}; stages.{edge.dst}.media)")


def _find_cycle(stages: tuple[str, ...], edges: list[EdgeConfig]) -> list[str] | None:
    graph = {s: [e.dst for e in edges if e.src == s] for s in stages}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if state.get(nxt) is None and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for s in stages:
        if state.get(s) is None and (found := visit(s)):
            return found
    return None


def parse_pipeline(c: Checker, name: str, raw: Any, known_stages: Mapping[str, Any],
                    parsed: Mapping[str, StageConfig]) -> PipelineConfig | None:
    path = f"pipelines.{name}"
    pl = read(c, PipelineTable, raw, path)
    if pl is None:
        return None
    p: dict[str, Any] = raw             # (the keys given, and those the parser checks itself)
    members_raw = c.get(p, "stages", path, list, [], required=True)
    members: list[str] = []
    for i, s in enumerate(members_raw):
        if not isinstance(s, str):
            c.add(f"{path}.stages[{i}]", f"must be a stage name, not {typename(s)}")
        elif s not in known_stages:
            c.add(f"{path}.stages[{i}]", f"unknown stage {s!r}")
        elif s in members:
            c.add(f"{path}.stages[{i}]", f"stage {s!r} is listed twice")
        else:
            members.append(s)
    if "stages" in p and not members_raw:
        c.add(f"{path}.stages", "must name at least one stage")
    edges_raw = c.get(p, "edges", path, list)
    if edges_raw is None:
        # A plain chain: each stage feeds the next, outputs passed by name.
        edges = [EdgeConfig(src=a, dst=b) for a, b in zip(members, members[1:])]
        _check_media_edges(c, f"{path}.stages", edges, parsed)
    else:
        edges = _parse_edges(c, edges_raw, path, members, known_stages, parsed)
    keep = _parse_kept_outputs(c, p, path, members, edges)
    return PipelineConfig(name=name, stages=tuple(members), edges=tuple(edges), timeout_s=pl.timeout_s,
                          retries=pl.retries, keep=keep, realtime=_realtime(pl.realtime))


def _parse_edges(c: Checker, edges_raw: list[Any], path: str, members: list[str], known_stages: Mapping[str, Any],
                 parsed: Mapping[str, StageConfig]) -> list[EdgeConfig]:
    """A pipeline's `edges`: each edge, none twice, a stage fed by a window edge fed by no other, no
    cycle, every stage on some edge."""
    edges: list[EdgeConfig] = []
    seen: set[tuple[str, str]] = set()
    named: set[str] = set()         # the stages each edge names, those refused too
    for i, raw_edge in enumerate(edges_raw):
        if isinstance(raw_edge, dict):
            named |= {v for k in ("from", "to") if isinstance(v := raw_edge.get(k), str)}
        edge = _parse_edge(c, raw_edge, f"{path}.edges[{i}]", tuple(members),
                           {k: parsed.get(k, v) for k, v in known_stages.items()})
        if edge is None:
            continue
        if (edge.src, edge.dst) in seen:
            c.add(f"{path}.edges[{i}]", f"duplicate edge {edge.src} -> {edge.dst}")
            continue
        seen.add((edge.src, edge.dst))
        edges.append(edge)
        _check_media_edges(c, f"{path}.edges[{i}]", [edge], parsed)
        _check_tensor_edges(c, f"{path}.edges[{i}]", edge, parsed)
    for edge in edges:
        others = [e.src for e in edges if e.dst == edge.dst and e is not edge]
        if edge.window > 0 and others:
            c.add(f"{path}.edges", f"stage {edge.dst!r} is fed by a window edge from {edge.src!r} and also by "
                                   f"{', '.join(repr(o) for o in others)}: a stage fed by a window edge "
                                   "takes no other input (merge them upstream, or use window = -1)")
    cycle = _find_cycle(tuple(members), edges)
    if cycle:
        c.add(f"{path}.edges", f"the edges form a cycle: {' -> '.join(cycle)}")
    elif members and len(members) > 1:
        # (a stage an edge names, refused for another reason, is said once: by that edge)
        linked = {e.src for e in edges} | {e.dst for e in edges} | named
        for s in members:
            if s not in linked:
                c.add(f"{path}.edges", f"stage {s!r} is in the pipeline but on no edge")
    return edges


def _realtime(r: RealtimeTable | None) -> RealtimeConfig | None:
    """`realtime = { overload = "queue" | "refuse", max_waiting_streams = N, margin = 0.9,
    start_slack_s = 0, warmup = { INPUT = VALUE } | false, warmup_params = { STAGE = { ... } } }`."""
    if r is None:
        return None
    warmup = RealtimeConfig().warmup if r.warmup is True else None if r.warmup is False else dict(r.warmup)
    return RealtimeConfig(overload=r.overload, max_waiting_streams=r.max_waiting_streams, margin=r.margin,
                          start_slack_s=r.start_slack_s, warmup=warmup, warmup_params=dict(r.warmup_params))


def _parse_kept_outputs(c: Checker, p: Mapping[str, Any], path: str, members: list[str],
                        edges: list[EdgeConfig]) -> dict[str, tuple[str, ...]]:
    """A pipeline's `outputs = { STAGE = ["name", ...] }`: outputs of stages that are not last,
    kept as the job's too."""
    raw = c.get(p, "outputs", path, dict, {})
    keep: dict[str, tuple[str, ...]] = {}
    for stage, names in raw.items():
        where = f"{path}.outputs.{stage}"
        if stage not in members:
            c.add(where, f"stage {stage!r} is not in the pipeline")
        elif not any(e.src == stage for e in edges):
            c.add(where, f"stage {stage!r} is a last stage: all its outputs are the job's already")
        elif not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            c.add(where, "must be a list of output names, e.g. [\"text\"]")
        else:
            keep[stage] = tuple(dict.fromkeys(names))
    return keep

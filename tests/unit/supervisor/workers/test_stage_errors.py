"""How a worker's load error is told: the whole message, not only its first line (in-process)."""

from __future__ import annotations

from omnid.supervisor.workers.stage import describe_exit, error_summary


def test_a_multi_line_message_keeps_its_cause_and_drops_the_traceback() -> None:
    error = ("ValidationError: 1 validation error for ModelConfig\n"
             "  Value error, User-specified max_model_len (1024) is greater than the derived max_model_len "
             "(max_position_embeddings=512 in model's config.json). [type=value_error]\n"
             "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n")
    assert error_summary(error) == (
        "ValidationError: 1 validation error for ModelConfig Value error, User-specified max_model_len (1024) "
        "is greater than the derived max_model_len (max_position_embeddings=512 in model's config.json). "
        "[type=value_error]")
    assert error_summary("x" * 1000).endswith(" [...]") and len(error_summary("x" * 1000)) == 606


def test_exit_statuses_are_told_in_words() -> None:
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert describe_exit(3) == "could not load its engine (exit status 3)"
    assert describe_exit(1) == "exited with status 1"
    assert describe_exit(None) == "is still running"


# ------------------------------------------------------------------ a load failure's root cause

VLLM_CORE_OUTPUT = b"""INFO 12-03 core.py:101] initializing
ERROR 12-03 core.py:900] EngineCore failed to start.
Traceback (most recent call last):
  File "/x/processing.py", line 1, in apply
    raise ValueError("Mismatch in `audio` token count. Got ids=[510] and text=[750].")
ValueError: Mismatch in `audio` token count. Got ids=[510] and text=[750].

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/x/processor.py", line 2, in call
    raise ValueError(msg) from exc
ValueError: Failed to apply Qwen2AudioProcessor on data={'text': '...'}
WARNING 12-03 a line after it
"""


def test_the_root_cause_is_the_first_exception_of_the_last_chain_printed() -> None:
    from omnid.supervisor.workers.stage_logs import ExceptionLines

    seen = ExceptionLines()
    seen.read([b"Traceback (most recent call last):", b"  File x", b"KeyError: 'an earlier, unrelated one'"])
    seen.read(VLLM_CORE_OUTPUT.split(b"\n"))
    assert seen.root_cause() == "ValueError: Mismatch in `audio` token count. Got ids=[510] and text=[750]."
    assert seen.chain[-1].startswith("ValueError: Failed to apply Qwen2AudioProcessor")
    # a new traceback that is no continuation starts a new chain; indented and prose lines are no exceptions
    seen.read([b"Traceback (most recent call last):", b"  raise OSError('x')", b"an Error: in prose",
               b"torch.OutOfMemoryError: CUDA out of memory"])
    assert seen.chain == ["torch.OutOfMemoryError: CUDA out of memory"]
    assert ExceptionLines().root_cause() is None


def test_a_load_error_names_the_root_cause_its_worker_printed() -> None:
    from omnid.supervisor.workers.stage import with_root_cause

    said = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    root = "ValueError: Mismatch in `audio` token count."
    assert with_root_cause(said, root) == f"{said} (root cause: {root})"
    assert with_root_cause(said, None) == said
    # an error that already says it is not told twice
    assert with_root_cause("ValueError: Mismatch in `audio` token count.\nTraceback (most recent call last):\n  x", root) == root

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

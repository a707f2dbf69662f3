"""What reading a 1 MB chat body costs at the door: `json.loads`, its model's checks
(`ChatCompletionRequest.parse`: openai/chat.py) and its messages made a job's (`chat_messages`),
for three shapes of about 1 MB: one long message, 10,000 short messages, 10,000 text parts.

Run by hand (not part of `make bench`): `PYTHONPATH=. .venv/bin/python tests/benchmarks/request_body_parse.py`.
Issue 44 measured it on the 2-core dev machine (quiet), the hand checks before the models and the
models alternating, best of 15: one 1 MB message 1.48 -> 1.55 ms, 10,000 messages 8.0 -> 9.6 ms,
10,000 text parts 8.8 -> 11.5 ms (json.loads alone: 1.5, 3.3, 3.3 ms). Messages made models cost
twice that; they are typed dicts, checked in place.
"""

from __future__ import annotations

import json
import timeit

from omnid.supervisor.http.openai.chat import ChatCompletionRequest, chat_messages

SHAPES = {
    "one 1 MB message": {"model": "chat", "messages": [{"role": "user", "content": "x" * 1_000_000}],
                         "temperature": 0.5, "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}},
    "10,000 messages": {"model": "chat", "messages": [{"role": "user" if i % 2 else "assistant", "content": "word " * 18}
                                                      for i in range(10_000)], "temperature": 0.5, "max_tokens": 16},
    "10,000 text parts": {"model": "chat", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "word " * 18} for _ in range(10_000)]}]},
}


def read(raw: bytes) -> None:
    chat = ChatCompletionRequest.parse(json.loads(raw))
    chat.stream_flags()
    chat.audio_format()
    chat_messages(chat.messages)


def main() -> None:
    for name, body in SHAPES.items():
        raw = json.dumps(body).encode()
        whole = min(timeit.repeat(lambda: read(raw), number=10, repeat=15)) / 10
        loads = min(timeit.repeat(lambda: json.loads(raw), number=10, repeat=15)) / 10
        print(f"{name} ({len(raw) / 1e6:.2f} MB): {whole * 1e3:.2f} ms (json.loads alone {loads * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()

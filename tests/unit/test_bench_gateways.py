"""bench/gateways.py's count of token events in a streamed HTTP answer, as its bytes arrive in
pieces: each event counted once, whole, wherever the pieces are cut."""

from __future__ import annotations

import json

from bench.gateways import TOKEN_MARKS, token_events


def sse(events: list[dict]) -> bytes:
    body = b"".join(b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events)
    return body + b"data: [DONE]\n\n"


CHAT = sse(
    [{"choices": [{"delta": {"role": "assistant"}}]}]
    + [{"choices": [{"delta": {"content": f" t{i}"}}]} for i in range(7)]
    + [{"choices": [], "usage": {"completion_tokens": 7}}]
)


def test_a_whole_answer_counts_its_token_events_only():
    assert token_events(CHAT) == 7
    assert token_events(sse([{"choices": [{"text": " a"}]}, {"choices": [{"text": " b"}]}])) == 2


def test_an_answer_arriving_in_pieces_counts_each_event_once_wherever_it_is_cut():
    for size in (1, 2, 3, 5, 11, 64, len(CHAT)):
        response = bytearray()
        starts = [0] * len(TOKEN_MARKS)
        counted = 0
        for at in range(0, len(CHAT), size):
            response += CHAT[at : at + size]
            counted += token_events(response, starts)
        assert counted == 7, size

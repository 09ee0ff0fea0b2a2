"""Incremental detokenization and stop strings for streamed generation.

Streaming text one token at a time must not split a character: a byte-level BPE token can
end in the middle of a UTF-8 sequence (a Chinese character is three bytes), and decoding it
alone yields U+FFFD. `IncrementalDetokenizer` holds text back until it is complete, the way
vLLM does (prefix/read offsets over the token list), so the deltas it returns concatenate to
exactly `tokenizer.decode(all_ids)`. `StopMatcher` holds back text that may be the start of a
stop string and cuts the output before the stop string once one appears. `TextStream`
chains the two. All three can be primed with ids generated earlier (by another replica):
they replay them silently and then emit only what the new tokens add.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from services.worker.engine import TokenDelta

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """Anything with `decode(ids, skip_special_tokens=...)`: a `tokenizers.Tokenizer` or a
    transformers tokenizer."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Text is decoded over a short window starting at `prefix_offset`, so tokenizers whose
    decoding depends on the previous token (leading-space rules) come out right too. New text
    is released only when the window decodes to more than before and does not end in U+FFFD.
    """

    def __init__(self, tokenizer: Decoder, initial_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        for token_id in initial_ids:
            self.push(token_id)  # replay: the text was already sent by whoever generated it

    @property
    def ids(self) -> list[int]:
        return self._ids

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Append one token; return the text it completes (often "", never a partial char)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back, at the end of generation (may hold U+FFFD when the last
        bytes never formed a character, exactly as a full decode would)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]


class StopMatcher:
    """Finds the first stop string in streamed text; the stop string itself is never emitted.

    Text is released only once it cannot be the beginning of a stop string: the longest
    suffix that is a proper prefix of some stop string is held until the next text decides.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was reached)."""
        if self.stopped:
            return "", True
        buf = self._pending + text
        if not self._stops:
            self._pending = ""
            return buf, False
        # Any match starts inside `buf`: text before it was released only because no suffix
        # of it could begin a stop string.
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._pending, self.stopped = "", True
            return buf[: min(hits)], True
        hold = self._held_suffix_length(buf)
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def _held_suffix_length(self, buf: str) -> int:
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:length]):
                    best = length
                    break
        return best

    def flush(self) -> str:
        """Held text at the end of generation: it turned out not to be a stop string."""
        text, self._pending = self._pending, ""
        return "" if self.stopped else text


class TextStream:
    """Token ids in, text deltas out: incremental detokenization, then stop strings."""

    def __init__(
        self,
        tokenizer: Decoder,
        stops: Sequence[str] = (),
        initial_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stops = StopMatcher(stops)
        for token_id in initial_ids:
            self.push(token_id)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def push(self, token_id: int) -> tuple[str, bool]:
        """Append one token; return (new text, whether a stop string was reached)."""
        return self._stops.feed(self._detok.push(token_id))

    def finish(self) -> str:
        """Everything held back, when generation ends for a reason other than a stop string."""
        text, stopped = self._stops.feed(self._detok.flush())
        return text if stopped else text + self._stops.flush()


def finished_before_start(text: TextStream, max_tokens: int) -> TokenDelta | None:
    """The only delta of a stream with nothing left to generate, or None: an earlier replica
    already reached a stop string (finish at once), or max_tokens is 0 (release the text held
    back for a stop string that never came). Every engine starts its streams with this."""
    from services.worker.engine import FinishReason, TokenDelta

    if text.stopped:
        return TokenDelta([], "", FinishReason.STOP, prefill_tokens=0)
    if max_tokens == 0:
        return TokenDelta([], text.finish(), FinishReason.LENGTH, prefill_tokens=0)
    return None

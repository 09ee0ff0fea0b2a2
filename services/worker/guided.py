"""Guided decoding for every engine: a JSON Schema as an allowed-token mask per step.

`GuideCompiler` turns a model's tokenizer into llguidance's view of it once, and compiles
each schema into a grammar matcher (cached, then copied per request). `JsonGuide` follows
one request: `mask()` says which token ids may come next, `advance(token)` records the one
chosen, and `accepting` / `finished` say when the output is a complete document that
conforms to the schema. The torch engine masks its logits with it, the sim engine draws under
it, and the vLLM engine follows vLLM's own grammar (the same one: llguidance, compact JSON)
with it, token by token.

The rules, the same on every engine (each calls the helpers here, so they cannot drift):

  * A request's guide is built with `GuideCompiler.for_request`: a stream resumed on another
    replica is fast-forwarded over the tokens already generated, so the grammar continues
    where the first replica was. Generated tokens that the schema's grammar does not accept
    are refused with InvalidArgument: a resumed stream that breaks its own schema is a bug or
    bad input, and going on unguided could emit invalid JSON.
  * The end of a guided document (`document_end`, after `advance(token)`): the stream stops
    with finish STOP right after the token that leaves the grammar `finished` (complete, and
    only EOS could follow: that token is sent, and no forward pass is spent on the EOS), or at
    an EOS chosen while the grammar is `accepting` (complete, though more could follow, as
    after the digits of a top-level number: the EOS is not sent). EOS is allowed only in an
    accepting state, so a guided stream never ends on an incomplete document except at
    `max_tokens` (finish LENGTH), where the router's repair step closes it.

Engine hook, per decode step (engine thread, sampling on the CPU):

    logits = guide.apply(logits)          # disallowed ids -> -inf
    token = select_token(logits, ...)
    guide.advance(token)
    end = document_end(guide, token)      # None, AT_EOS (not sent) or COMPLETE (sent)
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import llguidance

from services.common.errors import InvalidArgument
from services.common.schema_limits import SchemaLimits, parse_schema

if TYPE_CHECKING:
    import torch

# numpy and torch are imported where a mask is built (`JsonGuide.mask`): the sim engine
# guides with the compiler and the matcher alone (`accepts`, `advance`), without torch.

# Compact separators and no free whitespace between tokens: a weak model given the freedom
# to emit whitespace can spend its whole budget on newlines and never close the document.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

# llguidance's own bounds, tighter than its defaults: a grammar of at most 200k symbols and a
# lexer of at most 50k states (1-2 kB each), so a schema that slips past the schema limits
# still fails that one request instead of growing the worker by gigabytes. Its size check runs
# only after the grammar is built, which is why the schema limits come first: a billion-item
# array aborts the process while it is being built.
PARSER_LIMITS = {
    "max_grammar_size": 200_000,
    "max_lexer_states": 50_000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "verbose_errors": False,
}


class GuideMismatch(ValueError):
    """Tokens that the grammar does not accept (e.g. a resumed stream that was not guided)."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


class GuideCompiler:
    """One model's tokenizer as llguidance sees it, and compiled schemas for it.

    Build once per model (tens of ms for a small vocabulary, about a second for 128k
    tokens). Compiling a schema takes a few ms; the compiled matcher is kept in a small LRU
    and each request gets a copy (microseconds), so a hot schema costs nothing to reuse.
    """

    def __init__(
        self,
        tokenizer_json: str | bytes,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = 64,
        limits: SchemaLimits | None = None,
    ) -> None:
        """`vocab_size` is the length of the model's logits (it may exceed the tokenizer's
        vocabulary when the embedding is padded); `eos_token_ids` end a generation; `limits`
        bound each schema before it is compiled (default: SchemaLimits())."""
        if isinstance(tokenizer_json, bytes):
            tokenizer_json = tokenizer_json.decode()
        eos = [int(t) for t in eos_token_ids]
        if not eos:
            # Without an EOS id a guided generation could never end on its own.
            raise ValueError("guided decoding needs at least one EOS token id")
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(eos)
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)
        self._cache_size = cache_size
        self._limits = limits or SchemaLimits()
        self._parser_limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(
        cls, model_dir: Path, eos_token_ids: Sequence[int] | None = None, **kwargs: Any
    ) -> "GuideCompiler":
        """From a Hugging Face model folder: tokenizer.json, config.json's vocab_size and
        EOS ids (generation_config.json first, as transformers does)."""
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config = config.get("text_config") or config
        if eos_token_ids is None:
            generation = model_dir / "generation_config.json"
            source = json.loads(generation.read_text()) if generation.is_file() else config
            raw = source.get("eos_token_id", config.get("eos_token_id"))
            eos_token_ids = raw if isinstance(raw, list) else [raw]
        return cls((model_dir / "tokenizer.json").read_text(), int(config["vocab_size"]), eos_token_ids, **kwargs)

    def guide(self, schema: str | Mapping[str, Any], generated_ids: Sequence[int] = ()) -> "JsonGuide":
        """A guide for one request, fast-forwarded over `generated_ids`.

        Raises InvalidArgument when the schema cannot be guided (not JSON, unsupported
        keywords, unsatisfiable) and GuideMismatch when `generated_ids` leave the grammar.
        """
        # Key order matters: llguidance emits object properties in the schema's order.
        text = schema if isinstance(schema, str) else json.dumps(schema)
        guide = JsonGuide(self._matcher(text), self.vocab_size, self.eos_token_ids)
        guide.fast_forward(generated_ids)
        return guide

    def for_request(self, schema: str, generated_ids: Sequence[int] = ()) -> "JsonGuide":
        """The guide of one request (the rule every engine follows): InvalidArgument when the
        schema cannot be guided, and when `generated_ids` (a resumed stream's) leave its
        grammar; nothing has started then, so the refusal changes nothing."""
        try:
            return self.guide(schema, generated_ids)
        except GuideMismatch as exc:
            raise InvalidArgument(
                f"the generated ids do not fit response_format: {exc}; a resumed guided stream must "
                "continue a document of its own schema"
            ) from None

    def _matcher(self, schema_text: str) -> llguidance.LLMatcher:
        with self._lock:
            template = self._compiled.get(schema_text)
            if template is not None:
                self._compiled.move_to_end(schema_text)
                return template.deep_copy()
        template = self._compile(schema_text)
        with self._lock:
            self._compiled[schema_text] = template
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def _compile(self, schema_text: str) -> llguidance.LLMatcher:
        # Bounded before llguidance sees it (validate_request did too; this compiler may be
        # used without it).
        parse_schema(schema_text, self._limits, what="response_format for guided decoding")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidArgument(f"response_format cannot be used for guided decoding: {exc}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._parser_limits)
        if matcher.is_error():
            raise InvalidArgument(f"response_format cannot be used for guided decoding: {matcher.get_error()}")
        return matcher


class JsonGuide:
    """The grammar state of one generation. Not thread-safe: one sequence, one thread."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.consumed = 0
        self._mask: torch.Tensor | None = None

    # --- state ----------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """The tokens so far form a complete document that the schema accepts."""
        return self._matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Complete, and nothing but EOS may follow (the engine can stop without sampling it)."""
        return self._matcher.is_accepting() and self._matcher.is_stopped()

    @property
    def eos_allowed(self) -> bool:
        mask = self.mask()
        return any(bool(mask[t]) for t in self.eos_token_ids if t < self.vocab_size)

    def accepts(self, token: int) -> bool:
        """Whether the grammar allows `token` next (nothing is consumed)."""
        return self._matcher.validate_tokens([int(token)]) == 1

    # --- per step -------------------------------------------------------------------
    def mask(self) -> "torch.Tensor":
        """Bool tensor of `vocab_size` on the CPU: True for each id allowed next."""
        if self._mask is None:
            import numpy as np
            import torch

            bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
            # llguidance packs id i into bit i % 32 of 32-bit word i // 32, little-endian.
            allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
            if not allowed.any():
                # A matcher that hit its resource limits allows nothing: let the sequence end
                # (the router repairs or fails it) rather than sample from an empty set.
                allowed[[t for t in self.eos_token_ids if t < self.vocab_size]] = True
            self._mask = torch.from_numpy(allowed)
        return self._mask

    def apply(self, logits: "torch.Tensor") -> "torch.Tensor":
        """A float32 CPU copy of 1-D `logits` with every disallowed id at -inf."""
        import torch

        out = logits.detach().to(device="cpu", dtype=torch.float32).reshape(-1).clone()
        mask = self.mask()
        n = min(out.numel(), mask.numel())
        out[:n][~mask[:n]] = float("-inf")
        # Ids past the guide's vocabulary (a logits row longer than the tokenizer) never fit.
        out[n:] = float("-inf")
        return out

    def advance(self, token: int) -> None:
        """Record the token chosen for this step; GuideMismatch if the grammar forbids it."""
        if int(token) in self.eos_token_ids and self._matcher.is_error():
            # The matcher hit its resource limits: `mask` then allows only EOS, which ends the
            # sequence (see `document_end`).
            self.consumed += 1
            self._mask = None
            return
        if not self._matcher.consume_token(int(token)):
            raise GuideMismatch(
                f"token {token} at generated position {self.consumed} does not fit the schema: "
                f"{self._matcher.get_error()}",
                self.consumed,
            )
        self.consumed += 1
        self._mask = None

    def fast_forward(self, token_ids: Sequence[int]) -> None:
        """Consume tokens generated earlier (by this or another replica) in one call."""
        ids = [int(t) for t in token_ids]
        if not ids:
            return
        accepted = self._matcher.try_consume_tokens(ids)
        if accepted != len(ids):
            index = self.consumed + accepted
            raise GuideMismatch(
                f"generated token {ids[accepted]} at position {index} does not fit the schema; "
                "the stream was not produced under this schema",
                index,
            )
        self.consumed += len(ids)
        self._mask = None

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (e.g. `{"name":"`); an engine may feed them in one
        forward pass instead of sampling them one by one."""
        return list(self._matcher.compute_ff_tokens())


class DocumentEnd(Enum):
    """How a guided document ended at a token (see the module docstring)."""

    # The token is an EOS, chosen in an accepting state: the stream stops before it (not sent).
    AT_EOS = "eos"
    # The token completed the document and only EOS could follow: sent, then the stream stops.
    COMPLETE = "complete"


def document_end(guide: JsonGuide, token: int) -> DocumentEnd | None:
    """Whether the guided document ends at `token`, which `guide` has just advanced over;
    None while it goes on. The one end rule of every engine."""
    if int(token) in guide.eos_token_ids:
        return DocumentEnd.AT_EOS
    if guide.finished:
        return DocumentEnd.COMPLETE
    return None

"""The last rung of the ladder: intents as data, matched by keywords and regular expressions,
answered from templates whose slots are filled from the user's own words.

A rules file (YAML, see `default_intents.yaml`) declares slots (word lists or patterns),
intents (keywords, patterns, an answer per language) and a default answer. Everything is
checked at load: a bad file is rejected with a message naming its line, so a typo never
reaches a user. Matching is pure and fast (no I/O), in English and Chinese alike: text is
NFKC-normalised and case-folded; ASCII keywords match whole words, others match anywhere
(Chinese has no spaces between words).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import string
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

from services.router.degrade.yaml_lines import LList, LMap, YamlError, line_of, load_located

DEFAULT_RULES_PATH = Path(__file__).with_name("default_intents.yaml")
# Text beyond this many characters is not matched: bounds the cost of every pattern.
MAX_MATCH_CHARS = 4000
MAX_SLOT_CHARS = 64
MAX_INTENTS = 1000
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_ASCII_WORD = re.compile(r"^[\x20-\x7e]+$")
_SPACES = re.compile(r"(?<=\S) {2,}(?=\S)")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TOP_KEYS = {"version", "languages", "slots", "intents", "default"}
_SLOT_KEYS = {"words", "pattern", "default"}
_INTENT_KEYS = {"name", "keywords", "patterns", "priority", "answer"}
_DEFAULT_KEYS = {"name", "answer"}


class RulesError(ValueError):
    """The rules file is invalid; the message names the file and line."""


def normalize(text: str) -> str:
    """NFKC (full-width → ASCII, compatibility forms) and case-folded: what keywords match."""
    return unicodedata.normalize("NFKC", text).casefold()


def detect_language(text: str) -> str:
    return "zh" if _CJK.search(text) else "en"


@dataclass(frozen=True)
class Slot:
    name: str
    # (word as written in the file, its compiled matcher), longest first.
    words: tuple[tuple[str, re.Pattern], ...] = ()
    pattern: re.Pattern | None = None
    default: Mapping[str, str] = field(default_factory=dict)

    def fill(self, original: str, folded: str, language: str) -> str:
        if self.pattern is not None:
            match = self.pattern.search(original)
            if match:
                value = next((g for g in match.groups() if g), None) or match.group(0)
                return value.strip()[:MAX_SLOT_CHARS]
        # Longest word first, so "phone case" wins over "phone".
        for word, regex in self.words:
            if regex.search(folded):
                return word
        return self.default.get(language, next(iter(self.default.values()), ""))


@dataclass(frozen=True)
class Intent:
    name: str
    keywords: tuple[tuple[str, re.Pattern], ...]
    patterns: tuple[re.Pattern, ...]
    answers: Mapping[str, str]
    priority: int = 0
    order: int = 0

    def score(self, original: str, folded: str) -> tuple[int, dict[str, str]]:
        hits = sum(1 for _word, regex in self.keywords if regex.search(folded))
        groups: dict[str, str] = {}
        for pattern in self.patterns:
            match = pattern.search(original)
            if match:
                hits += 1
                for key, value in match.groupdict().items():
                    if value and key not in groups:
                        groups[key] = value.strip()[:MAX_SLOT_CHARS]
        return hits, groups


@dataclass(frozen=True)
class RuleAnswer:
    intent: str
    language: str
    text: str
    slots: Mapping[str, str]
    matched: bool


def _keyword_regex(folded_word: str) -> re.Pattern:
    escaped = re.escape(folded_word)
    if _ASCII_WORD.match(folded_word):
        # Whole words only: "price" must not fire on "priceless".
        return re.compile(rf"(?<!\w){escaped}(?!\w)")
    return re.compile(escaped)


class _Checker:
    """Collects the file's name so every error says `file:line: what`."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, line: int, message: str) -> RulesError:
        return RulesError(f"{self.source}:{line}: {message}")

    def mapping(self, value: Any, line: int, where: str, allowed: set[str]) -> LMap:
        if not isinstance(value, LMap):
            raise self.fail(line_of(value, line), f"{where} must be a mapping")
        for key in value:
            if key not in allowed:
                raise self.fail(
                    value.line_of(key), f"{where}: unknown field {key!r}; allowed: {', '.join(sorted(allowed))}"
                )
        return value

    def text(self, value: Any, line: int, where: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(line, f"{where} must be a non-empty string (got {value!r})")
        return value

    def strings(self, value: Any, line: int, where: str) -> list[tuple[str, int]]:
        if isinstance(value, str):
            return [(self.text(value, line, where), line)]
        if not isinstance(value, LList):
            raise self.fail(line_of(value, line), f"{where} must be a string or a list of strings")
        return [(self.text(item, value.line_of(i), f"{where}[{i}]"), value.line_of(i)) for i, item in enumerate(value)]

    def regex(self, text: str, line: int, where: str) -> re.Pattern:
        try:
            return re.compile(text, re.IGNORECASE)
        except re.error as exc:
            raise self.fail(line, f"{where}: invalid regular expression {text!r}: {exc}") from None

    def by_language(self, value: Any, line: int, where: str, allow_empty: bool = False) -> dict[str, str]:
        if isinstance(value, str):
            if not allow_empty:
                self.text(value, line, where)
            return {"*": value}
        if not isinstance(value, LMap) or not value:
            raise self.fail(line_of(value, line), f"{where} must be a string or a mapping of language to string")
        out: dict[str, str] = {}
        for lang, text in value.items():
            if not isinstance(text, str) or (not allow_empty and not text.strip()):
                raise self.fail(
                    value.line_of(lang), f"{where}.{lang} must be a {'' if allow_empty else 'non-empty '}string"
                )
            out[lang] = text
        return out

    def template_fields(self, template: str, line: int, where: str, known: set[str]) -> None:
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise self.fail(line, f"{where}: bad template ({exc}); write literal braces as {{{{ and }}}}") from None
        for _literal, name, spec, conversion in parsed:
            if name is None:
                continue
            if not _IDENTIFIER.match(name) or spec or conversion:
                raise self.fail(line, f"{where}: slot {{{name}}} must be a plain name like {{product}}")
            if name not in known:
                raise self.fail(
                    line, f"{where}: unknown slot {{{name}}}; declared: {', '.join(sorted(known)) or 'none'}"
                )


class RuleEngine:
    """Matches a user's text to an intent and renders its answer (pure, thread-safe)."""

    def __init__(
        self, slots: Mapping[str, Slot], intents: list[Intent], default: Intent, version: str, source: str
    ) -> None:
        self.slots = dict(slots)
        self.intents = intents
        self.default = default
        self.version = version
        self.source = source

    # -- loading --------------------------------------------------------------------------

    @classmethod
    def from_text(cls, text: str, source: str = "<rules>") -> "RuleEngine":
        check = _Checker(source)
        try:
            doc = load_located(text, source)
        except YamlError as exc:
            raise RulesError(str(exc)) from None
        doc = check.mapping(doc, 1, "the rules file", _TOP_KEYS)
        version = doc.get("version", 1)
        if version != 1:
            raise check.fail(doc.line_of("version"), f"version: only 1 is known (got {version!r})")
        slots = cls._load_slots(check, doc)
        raw_intents = doc.get("intents", LList(doc.line))
        if not isinstance(raw_intents, LList):
            raise check.fail(doc.line_of("intents"), "intents must be a list")
        if len(raw_intents) > MAX_INTENTS:
            raise check.fail(raw_intents.line, f"intents: at most {MAX_INTENTS}")
        intents: list[Intent] = []
        names: dict[str, int] = {}
        for i, raw in enumerate(raw_intents):
            intent = cls._load_intent(check, raw, raw_intents.line_of(i), f"intents[{i}]", slots, order=i)
            if intent.name in names:
                raise check.fail(
                    raw_intents.line_of(i),
                    f"intents[{i}]: name {intent.name!r} is already used on line {names[intent.name]}",
                )
            names[intent.name] = raw_intents.line_of(i)
            intents.append(intent)
        if "default" not in doc:
            raise check.fail(doc.line, "a 'default' answer is required (used when no intent matches)")
        raw_default = check.mapping(doc["default"], doc.line_of("default"), "default", _DEFAULT_KEYS)
        if "answer" not in raw_default:
            raise check.fail(raw_default.line, "default: 'answer' is required")
        name = raw_default.get("name", "default")
        check.text(name, raw_default.line_of("name"), "default.name")
        answers = check.by_language(raw_default["answer"], raw_default.line_of("answer"), "default.answer")
        for lang, template in answers.items():
            check.template_fields(template, raw_default.line_of("answer"), f"default.answer.{lang}", set(slots))
        default = Intent(name, (), (), answers, order=len(intents))
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return cls(slots, intents, default, f"rules-{digest}", source)

    @classmethod
    def from_file(cls, path: str | Path) -> "RuleEngine":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RulesError(f"{path}: cannot read the rules file: {exc}") from None
        return cls.from_text(text, str(path))

    @classmethod
    def default_rules(cls) -> "RuleEngine":
        return cls.from_file(DEFAULT_RULES_PATH)

    @staticmethod
    def _load_slots(check: _Checker, doc: LMap) -> dict[str, Slot]:
        raw_slots = doc.get("slots", LMap(doc.line))
        if not isinstance(raw_slots, LMap):
            raise check.fail(doc.line_of("slots"), "slots must be a mapping of slot name to definition")
        slots: dict[str, Slot] = {}
        for name, raw in raw_slots.items():
            line = raw_slots.line_of(name)
            if not _IDENTIFIER.match(name):
                raise check.fail(line, f"slot name {name!r} must be an identifier (letters, digits, _)")
            spec = check.mapping(raw, line, f"slots.{name}", _SLOT_KEYS)
            if ("words" in spec) == ("pattern" in spec):
                raise check.fail(spec.line, f"slots.{name}: give exactly one of 'words' or 'pattern'")
            words: tuple[tuple[str, re.Pattern], ...] = ()
            pattern = None
            if "words" in spec:
                listed = check.strings(spec["words"], spec.line_of("words"), f"slots.{name}.words")
                ordered = sorted((w for w, _ in listed), key=len, reverse=True)
                words = tuple((w, _keyword_regex(normalize(w))) for w in ordered)
            else:
                text = check.text(spec["pattern"], spec.line_of("pattern"), f"slots.{name}.pattern")
                pattern = check.regex(text, spec.line_of("pattern"), f"slots.{name}.pattern")
            default = check.by_language(
                spec.get("default", ""), spec.line_of("default"), f"slots.{name}.default", allow_empty=True
            )
            slots[name] = Slot(name, words, pattern, default)
        return slots

    @staticmethod
    def _load_intent(check: _Checker, raw: Any, line: int, where: str, slots: Mapping[str, Slot], order: int) -> Intent:
        spec = check.mapping(raw, line, where, _INTENT_KEYS)
        for required in ("name", "answer"):
            if required not in spec:
                raise check.fail(spec.line, f"{where}: {required!r} is required")
        name = check.text(spec["name"], spec.line_of("name"), f"{where}.name")
        where = f"intent {name!r} ({where})"
        keywords = []
        if "keywords" in spec:
            for word, word_line in check.strings(spec["keywords"], spec.line_of("keywords"), f"{where}.keywords"):
                keywords.append((word, _keyword_regex(normalize(word))))
        patterns = []
        groups: set[str] = set()
        if "patterns" in spec:
            for text, pattern_line in check.strings(spec["patterns"], spec.line_of("patterns"), f"{where}.patterns"):
                pattern = check.regex(text, pattern_line, f"{where}.patterns")
                groups.update(pattern.groupindex)
                patterns.append(pattern)
        if not keywords and not patterns:
            raise check.fail(
                spec.line, f"{where}: needs 'keywords' or 'patterns' (only the default answer matches everything)"
            )
        priority = spec.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool) or not -1000 <= priority <= 1000:
            raise check.fail(
                spec.line_of("priority"), f"{where}.priority must be an integer from -1000 to 1000 (got {priority!r})"
            )
        answers = check.by_language(spec["answer"], spec.line_of("answer"), f"{where}.answer")
        for lang, template in answers.items():
            check.template_fields(template, spec.line_of("answer"), f"{where}.answer.{lang}", set(slots) | groups)
        return Intent(name, tuple(keywords), tuple(patterns), answers, priority, order)

    # -- matching -------------------------------------------------------------------------

    def match(self, text: str) -> tuple[Intent, dict[str, str]]:
        """The best intent for the text (highest priority, then most hits, then file order)."""
        original = unicodedata.normalize("NFKC", text[:MAX_MATCH_CHARS])
        folded = original.casefold()
        best: tuple[tuple[int, int, int], Intent, dict[str, str]] | None = None
        for intent in self.intents:
            hits, groups = intent.score(original, folded)
            if hits == 0:
                continue
            rank = (intent.priority, hits, -intent.order)
            if best is None or rank > best[0]:
                best = (rank, intent, groups)
        if best is None:
            return self.default, {}
        return best[1], best[2]

    def answer(self, text: str) -> RuleAnswer:
        """Renders the answer to `text` in its language (English unless it holds Chinese)."""
        language = detect_language(text)
        intent, groups = self.match(text)
        template = intent.answers.get(language) or intent.answers.get("*") or next(iter(intent.answers.values()))
        original = unicodedata.normalize("NFKC", text[:MAX_MATCH_CHARS])
        folded = original.casefold()
        values: dict[str, str] = {}
        for _literal, name, _spec, _conv in string.Formatter().parse(template):
            if name is None or name in values:
                continue
            if name in groups:
                values[name] = groups[name]
            elif name in self.slots:
                values[name] = self.slots[name].fill(original, folded, language)
            else:
                values[name] = ""  # a pattern group of this intent that did not take part
        # An empty slot must not leave a double space behind ("your order  is").
        text = _SPACES.sub(" ", template.format_map(values))
        return RuleAnswer(intent.name, language, text, values, intent is not self.default)

    def answer_request(self, request: Any) -> RuleAnswer:
        """Answers the latest user message of a request (or its raw prompt)."""
        return self.answer(request_text(request))


def request_text(request: Any) -> str:
    """The text a rule should read: the last user message, else the prompt, else the last message."""
    messages = getattr(request, "messages", ()) or ()
    for message in reversed(messages):
        if message.role == "user":
            return message.content
    prompt = getattr(request, "prompt", None)
    if prompt:
        return prompt
    return messages[-1].content if messages else ""


_PIECE = re.compile(
    r"[\u3000-\u303f\u3400-\u9fff\uf900-\ufaff\uff00-\uffef]|[^\s\u3000-\u303f\u3400-\u9fff\uf900-\ufaff\uff00-\uffef]+\s*|\s+"
)


def split_pieces(text: str, min_chars: int = 8) -> list[str]:
    """Cuts text into pieces of about `min_chars` at word (or CJK character) boundaries."""
    pieces: list[str] = []
    current = ""
    for match in _PIECE.finditer(text):
        current += match.group(0)
        if len(current) >= min_chars:
            pieces.append(current)
            current = ""
    if current:
        pieces.append(current)
    return pieces


async def stream_text(text: str, min_chars: int = 8, delay_s: float = 0.0) -> AsyncIterator[str]:
    """Yields the answer piece by piece, like a model would, giving the loop a turn each time."""
    for piece in split_pieces(text, min_chars):
        yield piece
        await asyncio.sleep(delay_s)

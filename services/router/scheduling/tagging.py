"""Auto-tagging: rule documents (YAML or JSON) give a request without a tier its tier and weight.

Rules are data, live-updatable (the router reads them from etcd key `<prefix>config/tiering`).
Document shape, as in `default_tiering.yaml`:

    version: 1
    default: {tier: A, weight: 1.0}
    sessions: {regenerate_window_s: 600, ttl_s: 3600, max_tracked: 100000}
    rules:
      - name: regenerate-storm
        when: {regenerate: true, session_regenerates_at_least: 3}
        tier: S
        sticky_s: 300
      - name: mobile
        when: {platform: [ios, android, mobile]}
        weight_multiplier: 1.5

Rules are tried in order. The first matching rule that names a tier decides the tier; every
matching rule's `weight_multiplier` applies to the weight. A rule with `sticky_s` keeps
matching in that session for that long after it matched (the session is "lifted"), then the
session falls back to what the other rules say. Conditions in `when` must all hold; string
conditions take one value or a list and compare case-insensitively; no `when` matches all.

A bad document raises RuleError (a ValueError) naming the rule and the field; the classifier
keeps its previous rules in that case.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, TYPE_CHECKING

import yaml

from services.common.tier import Tier
from services.router.scheduling.tiers import TIERS

if TYPE_CHECKING:
    from services.router.requests import InferenceRequest

# Relative to the etcd prefix (`/ballast/` by default).
TIERING_KEY = "config/tiering"
DEFAULT_RULE = "default"
STRING_CONDITIONS = ("business_tag", "platform", "tenant", "model")
MAX_RULES = 1000


class RuleError(ValueError):
    """A tiering rule document is invalid; the message names the rule and field."""


@dataclass(frozen=True)
class Condition:
    """What a request must look like for a rule to match; None means "any"."""

    business_tag: frozenset[str] | None = None
    platform: frozenset[str] | None = None
    tenant: frozenset[str] | None = None
    model: frozenset[str] | None = None
    regenerate: bool | None = None
    session_regenerates_at_least: int | None = None

    def matches(self, request: "TagInput", session_regenerates: int) -> bool:
        for name in STRING_CONDITIONS:
            allowed = getattr(self, name)
            if allowed is not None and getattr(request, name).lower() not in allowed:
                return False
        if self.regenerate is not None and request.regenerate != self.regenerate:
            return False
        if self.session_regenerates_at_least is not None:
            return session_regenerates >= self.session_regenerates_at_least
        return True


@dataclass(frozen=True)
class Rule:
    name: str
    when: Condition
    tier: Tier | None = None
    weight_multiplier: float = 1.0
    sticky_s: float = 0.0


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...] = ()
    default_tier: Tier = Tier.A
    default_weight: float = 1.0
    # Regenerates older than this no longer count towards a session's total.
    regenerate_window_s: float = 600.0
    # A session idle this long is forgotten; at most max_tracked sessions are remembered.
    session_ttl_s: float = 3600.0
    max_tracked_sessions: int = 100_000

    @property
    def regenerate_memory(self) -> int:
        """Regenerate timestamps worth keeping per session: the largest threshold any rule uses."""
        thresholds = [r.when.session_regenerates_at_least or 0 for r in self.rules]
        return max([1, *thresholds])


@dataclass(frozen=True)
class TagInput:
    """The request facts rules may look at."""

    tenant: str = ""
    session_id: str = ""
    platform: str = ""
    regenerate: bool = False
    business_tag: str = ""
    model: str = ""

    @classmethod
    def from_request(cls, request: "InferenceRequest") -> "TagInput":
        return cls(
            tenant=request.tenant,
            session_id=request.session_id,
            platform=request.signals.platform,
            regenerate=request.signals.regenerate,
            business_tag=request.signals.business_tag,
            model=request.model,
        )


@dataclass(frozen=True)
class Classification:
    tier: Tier
    weight: float
    # The rule that decided the tier ("default" when none did).
    rule: str
    # Rules whose weight multiplier applied, in order.
    weight_rules: tuple[str, ...] = ()


# ----- parsing ---------------------------------------------------------------------------


def load_rules(text: str | bytes) -> RuleSet:
    """Parses a YAML or JSON rule document; raises RuleError naming what is wrong."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RuleError(f"tiering rules are not valid YAML or JSON: {exc}") from None
    return parse_rules(data)


def default_rules() -> RuleSet:
    """The rules shipped with Ballast (`default_tiering.yaml`)."""
    text = resources.files(__package__).joinpath("default_tiering.yaml").read_text(encoding="utf-8")
    return load_rules(text)


def _fail(where: str, field_name: str, problem: str) -> RuleError:
    return RuleError(f"{where} field '{field_name}': {problem}")


def _only(raw: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(str(key) for key in raw if key not in allowed)
    if unknown:
        raise RuleError(
            f"{where}: unknown field(s) {', '.join(repr(k) for k in unknown)}; allowed: {', '.join(sorted(allowed))}"
        )


def _mapping(raw: Any, where: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RuleError(f"{where} must be a mapping (got {type(raw).__name__})")
    return raw


def _tier(raw: Any, where: str, field_name: str) -> Tier:
    if not isinstance(raw, str) or raw not in TIERS:
        raise _fail(where, field_name, f"must be one of {', '.join(TIERS)} (got {raw!r})")
    return Tier(raw)


def _number(raw: Any, where: str, field_name: str, *, minimum: float = 0.0, allow_zero: bool = False) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise _fail(where, field_name, f"must be a number (got {raw!r})")
    if raw < minimum or (raw == minimum and not allow_zero):
        relation = ">=" if allow_zero else ">"
        raise _fail(where, field_name, f"must be {relation} {minimum} (got {raw!r})")
    return float(raw)


def _strings(raw: Any, where: str, field_name: str) -> frozenset[str]:
    values = [raw] if isinstance(raw, str) else raw
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
        raise _fail(where, field_name, f"must be a non-empty string or list of non-empty strings (got {raw!r})")
    return frozenset(v.lower() for v in values)


def _condition(raw: Any, where: str) -> Condition:
    raw = _mapping(raw, f"{where} field 'when'")
    _only(raw, {*STRING_CONDITIONS, "regenerate", "session_regenerates_at_least"}, f"{where} field 'when'")
    values: dict[str, Any] = {}
    for name in STRING_CONDITIONS:
        if name in raw:
            values[name] = _strings(raw[name], where, f"when.{name}")
    if "regenerate" in raw:
        if not isinstance(raw["regenerate"], bool):
            raise _fail(where, "when.regenerate", f"must be true or false (got {raw['regenerate']!r})")
        values["regenerate"] = raw["regenerate"]
    if "session_regenerates_at_least" in raw:
        count = raw["session_regenerates_at_least"]
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 100:
            raise _fail(where, "when.session_regenerates_at_least", f"must be an integer from 1 to 100 (got {count!r})")
        values["session_regenerates_at_least"] = count
    return Condition(**values)


def _rule(raw: Any, index: int, seen: set[str]) -> Rule:
    where = f"tiering rule rules[{index}]"
    raw = _mapping(raw, where)
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _fail(where, "name", f"must be a non-empty string (got {name!r})")
    where = f"tiering rule {name!r} (rules[{index}])"
    if name in seen or name == DEFAULT_RULE:
        raise _fail(where, "name", "is already used" if name in seen else f"{DEFAULT_RULE!r} is reserved")
    seen.add(name)
    _only(raw, {"name", "when", "tier", "weight_multiplier", "sticky_s"}, where)
    tier = _tier(raw["tier"], where, "tier") if "tier" in raw else None
    multiplier = 1.0
    if "weight_multiplier" in raw:
        multiplier = _number(raw["weight_multiplier"], where, "weight_multiplier")
        if multiplier > 100:
            raise _fail(where, "weight_multiplier", f"must be at most 100 (got {multiplier!r})")
    sticky = 0.0
    if "sticky_s" in raw:
        sticky = _number(raw["sticky_s"], where, "sticky_s")
        if tier is None:
            raise _fail(where, "sticky_s", "needs a 'tier' to keep")
    if tier is None and "weight_multiplier" not in raw:
        raise RuleError(f"{where}: sets neither 'tier' nor 'weight_multiplier', so it would do nothing")
    return Rule(
        name=name, when=_condition(raw.get("when"), where), tier=tier, weight_multiplier=multiplier, sticky_s=sticky
    )


def parse_rules(data: Any) -> RuleSet:
    """Validates an already-decoded rule document."""
    if not isinstance(data, dict):
        raise RuleError("tiering rules: the document must be a mapping with a 'rules' list")
    _only(data, {"version", "default", "sessions", "rules"}, "tiering rules")
    version = data.get("version", 1)
    if version != 1:
        raise _fail("tiering rules", "version", f"only version 1 is known (got {version!r})")
    default = _mapping(data.get("default"), "tiering rules field 'default'")
    _only(default, {"tier", "weight"}, "tiering rules field 'default'")
    default_tier = _tier(default.get("tier", "A"), "tiering rules", "default.tier")
    default_weight = _number(default.get("weight", 1.0), "tiering rules", "default.weight")
    sessions = _mapping(data.get("sessions"), "tiering rules field 'sessions'")
    _only(sessions, {"regenerate_window_s", "ttl_s", "max_tracked"}, "tiering rules field 'sessions'")
    window = _number(sessions.get("regenerate_window_s", 600.0), "tiering rules", "sessions.regenerate_window_s")
    ttl = _number(sessions.get("ttl_s", 3600.0), "tiering rules", "sessions.ttl_s")
    max_tracked = sessions.get("max_tracked", 100_000)
    if isinstance(max_tracked, bool) or not isinstance(max_tracked, int) or not 1 <= max_tracked <= 10_000_000:
        raise _fail(
            "tiering rules", "sessions.max_tracked", f"must be an integer from 1 to 10000000 (got {max_tracked!r})"
        )
    raw_rules = data.get("rules", [])
    if not isinstance(raw_rules, list):
        raise _fail("tiering rules", "rules", f"must be a list (got {type(raw_rules).__name__})")
    if len(raw_rules) > MAX_RULES:
        raise _fail("tiering rules", "rules", f"at most {MAX_RULES} rules (got {len(raw_rules)})")
    seen: set[str] = set()
    rules = tuple(_rule(raw, index, seen) for index, raw in enumerate(raw_rules))
    if window > ttl:
        raise _fail("tiering rules", "sessions.regenerate_window_s", f"must not exceed sessions.ttl_s ({ttl})")
    for index, rule in enumerate(rules):
        # A lift must not outlive the memory of its session.
        if rule.sticky_s > ttl:
            raise _fail(
                f"tiering rule {rule.name!r} (rules[{index}])", "sticky_s", f"must not exceed sessions.ttl_s ({ttl})"
            )
    return RuleSet(
        rules=rules,
        default_tier=default_tier,
        default_weight=default_weight,
        regenerate_window_s=window,
        session_ttl_s=ttl,
        max_tracked_sessions=max_tracked,
    )


# ----- classification --------------------------------------------------------------------


@dataclass
class _Session:
    last_seen: float
    regenerates: deque[float]
    # Rule name -> time its lift ends.
    lifts: dict[str, float] = field(default_factory=dict)


class _Sessions:
    """Per-session memory, bounded in count (least recently used goes) and in idle time."""

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, _Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def touch(self, session_id: str, now: float, rules: RuleSet) -> _Session:
        session = self._sessions.get(session_id)
        memory = rules.regenerate_memory
        if session is None:
            session = _Session(now, deque(maxlen=memory))
            self._sessions[session_id] = session
        else:
            self._sessions.move_to_end(session_id)
            if session.regenerates.maxlen != memory:
                session.regenerates = deque(session.regenerates, maxlen=memory)
        session.last_seen = now
        self._evict(now, rules)
        return session

    def _evict(self, now: float, rules: RuleSet) -> None:
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if len(self._sessions) <= rules.max_tracked_sessions and now - oldest.last_seen <= rules.session_ttl_s:
                return
            self._sessions.popitem(last=False)


class TierClassifier:
    """Classifies AUTO-tier requests; pure apart from the bounded per-session memory."""

    def __init__(
        self,
        rules: RuleSet | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_hit: Callable[[str], None] | None = None,
    ) -> None:
        self.rules = rules if rules is not None else default_rules()
        self.clock = clock
        # Matches per rule name (and "default"); only names of the current rules are kept.
        self.rule_hits: dict[str, int] = {}
        self.on_hit = on_hit
        self._sessions = _Sessions()

    @property
    def tracked_sessions(self) -> int:
        return len(self._sessions)

    def update(self, rules: RuleSet) -> None:
        """Swaps the rules in; session memory is kept, hit counts of removed rules dropped."""
        names = {rule.name for rule in rules.rules} | {DEFAULT_RULE}
        self.rule_hits = {name: count for name, count in self.rule_hits.items() if name in names}
        self.rules = rules

    def update_from_text(self, text: str | bytes) -> RuleSet:
        """Parses and applies a document; on RuleError the current rules stay in force."""
        rules = load_rules(text)
        self.update(rules)
        return rules

    def _hit(self, name: str) -> None:
        self.rule_hits[name] = self.rule_hits.get(name, 0) + 1
        if self.on_hit is not None:
            self.on_hit(name)

    def classify(self, request: TagInput) -> Classification:
        rules = self.rules
        now = self.clock()
        session = self._sessions.touch(request.session_id, now, rules) if request.session_id else None
        regenerates = 0
        if session is not None:
            if request.regenerate:
                session.regenerates.append(now)
            while session.regenerates and session.regenerates[0] < now - rules.regenerate_window_s:
                session.regenerates.popleft()
            regenerates = len(session.regenerates)
            session.lifts = {name: until for name, until in session.lifts.items() if until > now}
        tier: Tier | None = None
        decided = DEFAULT_RULE
        weight = rules.default_weight
        weight_rules: list[str] = []
        for rule in rules.rules:
            matched = rule.when.matches(request, regenerates)
            lifted = session is not None and rule.name in session.lifts
            if not (matched or lifted):
                continue
            self._hit(rule.name)
            if rule.tier is not None and tier is None:
                tier, decided = rule.tier, rule.name
            if matched and rule.sticky_s > 0 and session is not None:
                session.lifts[rule.name] = now + rule.sticky_s
                if rule.when.session_regenerates_at_least is not None:
                    # Extending the lift takes a new run of regenerates, not one more.
                    session.regenerates.clear()
            if rule.weight_multiplier != 1.0:
                weight *= rule.weight_multiplier
                weight_rules.append(rule.name)
        if tier is None:
            tier = rules.default_tier
            self._hit(DEFAULT_RULE)
        return Classification(tier=tier, weight=weight, rule=decided, weight_rules=tuple(weight_rules))

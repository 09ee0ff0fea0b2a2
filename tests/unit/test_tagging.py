"""Auto-tagging: the default rules, session lifts, live updates and rejected documents."""

from __future__ import annotations

import json

import pytest

from services.router.scheduling.tagging import RuleError, TagInput, TierClassifier, default_rules, load_rules
from tests.unit.fake_clock import FakeClock


def make(rules=None) -> tuple[TierClassifier, FakeClock]:
    clock = FakeClock()
    return TierClassifier(rules if rules is not None else default_rules(), clock), clock


class TestDefaultRules:
    def test_default_is_a(self):
        classifier, _ = make()
        result = classifier.classify(TagInput(tenant="t", session_id="s1"))
        assert (result.tier, result.weight, result.rule) == ("A", 1.0, "default")

    def test_promotion_is_s_and_archive_is_b(self):
        classifier, _ = make()
        promo = classifier.classify(TagInput(business_tag="promotion"))
        archive = classifier.classify(TagInput(business_tag="Archive"))
        assert (promo.tier, promo.rule) == ("S", "promotion")
        assert (archive.tier, archive.rule) == ("B", "archive")

    def test_mobile_multiplies_the_weight_without_deciding_the_tier(self):
        classifier, _ = make()
        result = classifier.classify(TagInput(platform="android", business_tag="archive"))
        assert (result.tier, result.rule) == ("B", "archive")
        assert result.weight == pytest.approx(1.5)
        assert result.weight_rules == ("mobile",)
        assert classifier.classify(TagInput(platform="web")).weight == 1.0

    def test_third_regenerate_lifts_the_session_to_s_for_a_while(self):
        classifier, clock = make()
        regenerate = TagInput(session_id="s1", regenerate=True)
        tiers = []
        for _ in range(3):
            tiers.append(classifier.classify(regenerate).tier)
            clock.advance(10)
        assert tiers == ["A", "A", "S"]
        # The lift holds for plain requests of the session, and not for other sessions.
        follow_up = classifier.classify(TagInput(session_id="s1"))
        assert (follow_up.tier, follow_up.rule) == ("S", "regenerate-storm")
        assert classifier.classify(TagInput(session_id="s2")).tier == "A"
        clock.advance(300)
        back = classifier.classify(TagInput(session_id="s1"))
        assert (back.tier, back.rule) == ("A", "default")

    def test_regenerates_outside_the_window_do_not_count(self):
        classifier, clock = make()
        regenerate = TagInput(session_id="s1", regenerate=True)
        classifier.classify(regenerate)
        classifier.classify(regenerate)
        clock.advance(601)
        assert classifier.classify(regenerate).tier == "A"

    def test_regenerates_without_a_session_are_not_tracked(self):
        classifier, _ = make()
        tiers = [classifier.classify(TagInput(regenerate=True)).tier for _ in range(5)]
        assert tiers == ["A"] * 5
        assert classifier.tracked_sessions == 0

    def test_rule_hits_are_counted(self):
        calls: list[str] = []
        classifier, _ = make()
        classifier.on_hit = calls.append
        classifier.classify(TagInput(business_tag="promotion", platform="ios"))
        classifier.classify(TagInput())
        assert classifier.rule_hits == {"promotion": 1, "mobile": 1, "default": 1}
        assert calls == ["promotion", "mobile", "default"]


class TestDocuments:
    def test_json_documents_work_too(self):
        doc = {
            "version": 1,
            "default": {"tier": "B", "weight": 2},
            "rules": [{"name": "vip", "when": {"tenant": ["acme", "globex"]}, "tier": "S"}],
        }
        classifier, _ = make(load_rules(json.dumps(doc)))
        assert classifier.classify(TagInput(tenant="ACME")).tier == "S"
        other = classifier.classify(TagInput(tenant="initech"))
        assert (other.tier, other.weight) == ("B", 2.0)

    def test_first_rule_with_a_tier_wins(self):
        rules = load_rules(
            """
            rules:
              - {name: first, when: {business_tag: promotion}, tier: B}
              - {name: second, when: {business_tag: promotion}, tier: S}
            """
        )
        classifier, _ = make(rules)
        assert classifier.classify(TagInput(business_tag="promotion")).rule == "first"

    def test_live_update_keeps_sessions_and_drops_old_hit_counts(self):
        classifier, clock = make()
        classifier.classify(TagInput(business_tag="promotion"))
        for _ in range(3):
            classifier.classify(TagInput(session_id="s1", regenerate=True))
        classifier.update_from_text(
            """
            rules:
              - name: regenerate-storm
                when: {regenerate: true, session_regenerates_at_least: 3}
                tier: S
                sticky_s: 300
              - {name: promotion, when: {business_tag: promotion}, tier: B}
            """
        )
        assert "mobile" not in classifier.rule_hits
        assert classifier.classify(TagInput(business_tag="promotion")).tier == "B"
        # The lift granted under the old rules is still in force.
        assert classifier.classify(TagInput(session_id="s1")).tier == "S"

    def test_bad_update_keeps_the_old_rules(self):
        classifier, _ = make()
        with pytest.raises(RuleError):
            classifier.update_from_text("rules: [{name: x, tier: Z}]")
        assert classifier.classify(TagInput(business_tag="promotion")).tier == "S"

    @pytest.mark.parametrize(
        "text, fragments",
        [
            ("rules: [{name: promo, when: {business_tag: promotion}, tier: X}]", ["'promo'", "rules[0]", "'tier'"]),
            ("rules: [{name: m, when: {platform: ios}, weight_multiplier: -1}]", ["'m'", "'weight_multiplier'"]),
            ("rules: [{name: m, when: {platfrom: ios}, tier: S}]", ["'m'", "'platfrom'"]),
            ("rules: [{name: m, when: {regenerate: yes please}, tier: S}]", ["'m'", "when.regenerate"]),
            (
                "rules: [{name: r, when: {session_regenerates_at_least: 0}, tier: S}]",
                ["'r'", "when.session_regenerates_at_least"],
            ),
            ("rules: [{name: r, when: {platform: ios}, sticky_s: 10, weight_multiplier: 2}]", ["'r'", "'sticky_s'"]),
            ("rules: [{name: idle, when: {platform: ios}}]", ["'idle'", "neither"]),
            ("rules: [{name: a, tier: S}, {name: a, tier: B}]", ["rules[1]", "'name'", "already used"]),
            ("rules: [{tier: S}]", ["rules[0]", "'name'"]),
            ("rules: [{name: s, tier: S, sticky_s: 99999}]", ["'s'", "'sticky_s'", "ttl_s"]),
            ("default: {tier: C}", ["default.tier"]),
            ("sessions: {max_tracked: 0}", ["sessions.max_tracked"]),
            ("version: 2", ["version"]),
            ("tiers: []", ["'tiers'"]),
            ("rules: {name: x}", ["'rules'", "list"]),
            ("- just a list", ["mapping"]),
            ("rules: [unclosed", ["not valid YAML"]),
        ],
    )
    def test_bad_documents_are_rejected_naming_rule_and_field(self, text, fragments):
        with pytest.raises(RuleError) as error:
            load_rules(text)
        for fragment in fragments:
            assert fragment in str(error.value)


class TestSessionMemory:
    def test_sessions_are_bounded_by_count(self):
        rules = load_rules("sessions: {max_tracked: 3}")
        classifier, clock = make(rules)
        for i in range(10):
            classifier.classify(TagInput(session_id=f"s{i}"))
            clock.advance(1)
        assert classifier.tracked_sessions == 3

    def test_idle_sessions_are_forgotten(self):
        rules = load_rules("sessions: {ttl_s: 100, regenerate_window_s: 50}")
        classifier, clock = make(rules)
        classifier.classify(TagInput(session_id="old"))
        clock.advance(101)
        classifier.classify(TagInput(session_id="new"))
        assert classifier.tracked_sessions == 1

    def test_regenerate_memory_is_bounded_per_session(self):
        classifier, _ = make()
        for _ in range(1000):
            classifier.classify(TagInput(session_id="s", regenerate=True))
        session = classifier._sessions._sessions["s"]
        assert len(session.regenerates) <= 3

"""The scheduler-side bookkeeping of Ballast's vLLM KV connector, and its configuration:
which stored blocks a request loads into which pages, which blocks each step saves, and
when the connector is configured at all. Pure logic: no vLLM, no store."""

from __future__ import annotations

import pytest

from services.cache.types import KVLayout
from services.worker.vllm.checks import EnginePlan, ModelFacts
from services.worker.vllm.connector_config import (
    ConnectorSetup,
    StoreSettings,
    plan_connector,
    session_params,
    session_tenant,
)
from services.worker.vllm.connector_plan import ScheduledCached, ScheduledNew, SchedulerBook
from services.worker.vllm.kv_keys import ConnectorKeys

BLOCK = 4


class Lookups:
    """Answers lookups with a fixed number of stored blocks and records what was asked."""

    def __init__(self, stored: int) -> None:
        self.stored = stored
        self.asked: list[list[bytes]] = []

    def __call__(self, names: list[bytes]) -> int:
        self.asked.append(names)
        return min(self.stored, len(names))


def book(page: int = BLOCK) -> SchedulerBook:
    return SchedulerBook(ConnectorKeys("version-1", BLOCK, page))


def test_a_stored_prefix_is_loaded_into_the_allocated_pages_and_not_saved_again():
    tokens = list(range(100, 114))  # 14 tokens: 3 full blocks, the third holds no last token
    keys = ConnectorKeys("version-1", BLOCK, BLOCK)
    lookups = Lookups(stored=2)
    b = book()
    assert b.matched("r1", "acme", lambda: tokens, 0, lookups) == 2 * BLOCK
    assert lookups.asked == [keys.lookup_names("acme", tokens)]
    # vLLM asks again while it waits for pages: same answer, no second lookup.
    assert b.matched("r1", "acme", lambda: tokens, 0, lookups) == 2 * BLOCK and len(lookups.asked) == 1
    b.allocated("r1", 2 * BLOCK)
    plan = b.plan([ScheduledNew("r1", [9, 4, 6, 1], 2 * BLOCK, 6)], [])
    (load,) = plan.loads
    assert load.first_block == 0 and load.pages == ((9,), (4,)) and load.skip_pages == 0
    assert list(load.names) == keys.block_names("acme", tokens)[:2]
    # The step computes tokens 8..13: block 2 is complete and saved; blocks 0-1 came from the store.
    (save,) = plan.saves
    assert save.first_block == 2 and save.pages == ((6,),) and list(save.names) == [keys.block_names("acme", tokens)[2]]


def test_a_local_prefix_hit_loads_only_the_rest_and_skips_pages_it_already_has():
    tokens = list(range(200, 221))  # 21 tokens, 5 restorable blocks
    b = SchedulerBook(ConnectorKeys("v", 8, 4))  # stored blocks of two pages
    assert b.matched("r", "t", lambda: tokens, 4, Lookups(stored=2)) == 12
    b.allocated("r", 12)
    (load,) = b.plan([ScheduledNew("r", [3, 5, 7, 2, 8, 6], 16, 5)], []).loads
    assert load.first_block == 0 and load.pages == ((3, 5), (7, 2)) and load.skip_pages == 1


def test_a_load_vllm_did_not_allocate_is_not_planned():
    tokens = list(range(30))
    b = book()
    assert b.matched("r", "t", lambda: tokens, 0, Lookups(stored=3)) == 3 * BLOCK
    b.allocated("r", 0)
    assert b.plan([ScheduledNew("r", [1, 2, 3, 4, 5, 6, 7, 8], 0, 30)], []).loads == ()


def test_blocks_are_saved_once_as_decoding_fills_them():
    tokens = list(range(50, 56))  # a 6-token prompt; decoding appends
    keys = ConnectorKeys("version-1", BLOCK, BLOCK)
    b = book()
    assert b.matched("r", "acme", lambda: tokens, 0, Lookups(stored=0)) == 0
    b.allocated("r", 0)
    first = b.plan([ScheduledNew("r", [3, 8], 0, 6)], [])
    assert [s.first_block for s in first.saves] == [0] and first.saves[0].pages == ((3,),)
    tokens.append(90)  # token 6 decoded: computed 6, scheduled 1 -> 7 tokens, block 1 not full
    assert b.plan([], [ScheduledCached("r", None, False, 6, 1)]).saves == ()
    tokens.append(91)
    second = b.plan([], [ScheduledCached("r", None, False, 7, 1)]).saves
    assert [s.first_block for s in second] == [1] and second[0].pages == ((8,),)
    assert list(second[0].names) == [keys.block_names("acme", tokens)[1]]
    tokens.extend([92, 93, 94, 95])
    # A new page arrives with the step that needs it.
    third = b.plan([], [ScheduledCached("r", [11], False, 8, 4)]).saves
    assert [s.first_block for s in third] == [2] and third[0].pages == ((11,),)


def test_a_request_back_from_preemption_gets_its_new_page_table():
    tokens = list(range(12))
    b = book()
    b.matched("r", "t", lambda: tokens, 0, Lookups(stored=0))
    b.plan([ScheduledNew("r", [1, 2], 0, 4)], [])
    (save,) = b.plan([], [ScheduledCached("r", [7, 8, 9], True, 0, 12)]).saves
    assert save.first_block == 1 and save.pages == ((8,), (9,))


def test_requests_that_are_not_sessions_or_finished_are_not_tracked():
    b = book()
    plan = b.plan([ScheduledNew("other", [1, 2], 0, 8)], [ScheduledCached("other", None, False, 8, 1)])
    assert plan.loads == () and plan.saves == ()
    b.matched("r", "t", lambda: list(range(8)), 0, Lookups(stored=0))
    b.finished("r")
    assert not b.tracks("r")


def test_only_requests_the_worker_marked_carry_a_tenant():
    params = session_params("acme")["kv_transfer_params"]
    assert session_tenant(params) == "acme"
    for foreign in (None, {}, {"ballast_session": "acme"}, {"ballast_session": {"tenant": 3}}, "x"):
        assert session_tenant(foreign) is None


FACTS = ModelFacts(2048, 2, 2, 32, "float32", 1 << 20)
PLAN = EnginePlan("float32", "float32", "auto", 2048, 512, None, 1 << 30, 2 << 20, platform="cpu")
STORE = StoreSettings(address="127.0.0.1:7001", block_tokens=32)


def test_the_connector_is_configured_only_where_pages_are_in_a_verified_layout():
    setup, reason = plan_connector(STORE, "v1", FACTS, PLAN, "cpu", lambda *a: "vec")
    assert reason == "" and setup.layout == KVLayout("float32", (2, 2, 2, 32, 32), 2, 32)
    assert ConnectorSetup.from_extra_config(setup.extra_config()) == setup
    cases = [
        ((None, "v1", FACTS, PLAN, "cpu", lambda *a: "vec"), "no_cache"),
        ((STORE, "v1", FACTS, PLAN, "cpu", lambda *a: "amx"), "unverified_page_layout"),
        ((STORE, "v1", FACTS, PLAN, "cuda", None), "unverified_page_layout"),
        (
            (StoreSettings("a:1", block_tokens=16), "v1", FACTS, PLAN, "cpu", lambda *a: "vec"),
            "block_tokens_not_multiple_of_32",
        ),
        (
            (STORE, "v1", ModelFacts(2048, 2, 2, 32, "float32", 1, mla_latent_dim=8), PLAN, "cpu", lambda *a: "vec"),
            "unstorable_model",
        ),
    ]
    for args, expected in cases:
        assert plan_connector(*args) == (None, expected)
    with pytest.raises(ValueError, match="not Ballast's"):
        ConnectorSetup.from_extra_config({"store": {}})


def test_the_connector_dials_the_cache_with_the_worker_certificate():
    from dataclasses import asdict

    from services.common.tls.settings import TLSConfig
    from services.worker.settings import WorkerConfig
    from services.worker.vllm.connector_config import StoreSettings

    worker = WorkerConfig(cache_address="127.0.0.1:50061")
    assert StoreSettings.from_worker_config(worker).tls() is None
    tls = TLSConfig(enabled=True, ca_file="ca.crt", cert_file="worker.crt", key_file="worker.key")
    # The settings reach vLLM's engine processes as plain data (kv_connector_extra_config).
    assert StoreSettings(**asdict(StoreSettings.from_worker_config(worker, tls))).tls() == tls

"""SessionKV without a network: saves never block and drop when the queue is full, a cache
that fails is taken out of use at once, and the restore policy is honoured."""

import asyncio

from services.cache.client import FetchedBlocks, PutResult
from services.cache.types import BlockHeader, KVLayout
from services.common.config import TelemetryConfig
from services.common.errors import Unavailable
from services.common.telemetry import Telemetry
from services.worker.kv import KVMetrics, KVSettings, SessionKV

LAYOUT = KVLayout("float32", (1, 2, 1, 4, 2), 1, 4)


class FakeClient:
    def __init__(self) -> None:
        self.up = True
        self.cached = 0
        self.calls: list[str] = []
        self.put_gate = asyncio.Event()
        self.put_gate.set()
        self.watches = 0
        self.pushed: asyncio.Queue[bool | None] = asyncio.Queue()

    async def healthy(self, timeout_s):
        return self.up

    async def watch_health(self):
        # As the real stream: SERVING or not now, then each change the test pushes (None:
        # the stream ends, as when the service goes away).
        self.watches += 1
        yield self.up
        while (serving := await self.pushed.get()) is not None:
            yield serving

    async def lookup(self, scope, hashes, timeout_s):
        self.calls.append("lookup")
        if not self.up:
            raise Unavailable("down")
        return min(self.cached, len(hashes))

    async def get(self, scope, hashes, layout, timeout_s):
        self.calls.append("get")
        fetched = FetchedBlocks(layout, bytearray(len(hashes) * layout.block_bytes))
        fetched.headers = [BlockHeader(h, i, layout, layout.block_bytes, 0) for i, h in enumerate(hashes)]
        return fetched

    async def put(self, scope, layout, blocks, ttl_s, timeout_s):
        self.calls.append("put")
        await self.put_gate.wait()
        return PutResult(len(blocks), 0, 0)

    async def close(self):
        pass


def metric(telemetry, name, **labels):
    total = 0.0
    for line in telemetry.render().splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def make(policy="always", queue=1, probe_interval_s=60.0):
    telemetry = Telemetry("t", TelemetryConfig(enabled=False))
    client = FakeClient()
    kv = SessionKV(
        client,
        KVSettings(block_tokens=4, policy=policy, save_queue=queue, probe_interval_s=probe_interval_s),
        KVMetrics(telemetry),
        telemetry.dependencies,
    )
    kv.bind("v1", LAYOUT)
    await kv.start()
    return kv, client, telemetry


def encoder(first, end):
    return [(bytes(LAYOUT.block_bytes), 0) for _ in range(first, end)]


async def test_saves_never_wait_and_drop_beyond_the_bound():
    kv, client, telemetry = await make(queue=1)
    try:
        client.put_gate.clear()  # the first save hangs in put
        assert kv.save("t", "s1", list(range(12)), encoder) == "queued"
        await asyncio.sleep(0.05)
        assert kv.save("t", "s2", list(range(12)), encoder) == "queued"  # waits behind s1
        assert kv.save("t", "s2", list(range(13)), encoder) == "superseded"
        assert kv.save("t", "s3", list(range(12)), encoder) == "dropped"
        assert kv.save("t", "s4", [1, 2], encoder) == "skipped"  # no full block
        assert metric(telemetry, "ballast_worker_kv_saves_total", outcome="dropped") == 1
        client.put_gate.set()
        assert await kv.flush(2)
        assert metric(telemetry, "ballast_worker_kv_saves_total", outcome="saved") == 2
        assert metric(telemetry, "ballast_worker_kv_saved_blocks_total") == 6
    finally:
        await kv.stop(1)


async def test_a_failing_cache_is_taken_out_of_use_until_the_probe_sees_it():
    kv, client, telemetry = await make(probe_interval_s=0.01)
    try:
        assert await settled(lambda: client.watches == 1), "the session follows the cache's health stream"
        assert telemetry.dependencies.is_up("kvcache")
        client.up = False
        assert await kv.fetch("t", list(range(20))) is None
        assert not kv.available and not telemetry.dependencies.is_up("kvcache")
        calls = len(client.calls)
        assert await kv.fetch("t", list(range(20))) is None
        assert kv.save("t", "s", list(range(20)), encoder) == "unavailable"
        assert len(client.calls) == calls  # no more calls while it is down
        # Its health stream says nothing new (the service never noticed): the checks bring
        # it back once it answers.
        client.up = True
        assert await settled(lambda: kv.available and client.watches == 2), "back, and a new stream follows it"
        assert telemetry.dependencies.is_up("kvcache")
    finally:
        await kv.stop(1)


async def settled(condition) -> bool:
    """Lets the session's tasks run until `condition()` holds (False if it never does)."""
    for _ in range(1000):
        if condition():
            return True
        await asyncio.sleep(0.005)
    return False


async def test_the_health_stream_takes_the_cache_out_of_use_and_back_and_a_lost_one_until_a_check_sees_it():
    kv, client, telemetry = await make(probe_interval_s=0.01)
    try:
        assert await settled(lambda: client.watches == 1) and kv.available
        client.pushed.put_nowait(False)  # its Redis went away
        assert await settled(lambda: not kv.available)
        assert not telemetry.dependencies.is_up("kvcache")
        client.pushed.put_nowait(True)  # and came back: the same stream says so
        assert await settled(lambda: kv.available)
        assert client.watches == 1 and telemetry.dependencies.is_up("kvcache")

        client.up = False
        client.pushed.put_nowait(None)  # the stream ends: the service is gone
        assert await settled(lambda: not kv.available)
        client.up = True  # back: a check finds it, and a new stream follows it
        assert await settled(lambda: kv.available and client.watches == 2)
    finally:
        await kv.stop(1)


async def test_restore_covers_cached_blocks_but_never_the_last_token():
    kv, client, _telemetry = await make()
    try:
        client.cached = 100
        fetch = await kv.fetch("t", list(range(13)))  # 13 tokens: blocks 0..2 hold 0..11
        assert fetch.blocks.blocks == 3
        fetch = await kv.fetch("t", list(range(12)))  # token 11 must stay fresh: blocks 0..1
        assert fetch.blocks.blocks == 2
        assert await kv.fetch("t", list(range(4))) is None  # nothing before the last token
        client.cached = 0
        assert await kv.fetch("t", list(range(40))) is None
    finally:
        await kv.stop(1)


async def test_policy_never_and_sessions_only():
    kv, _client, _telemetry = await make(policy="never")
    try:
        assert not kv.applies_to("s1")
    finally:
        await kv.stop(1)
    kv, _client, _telemetry = await make(policy="adaptive")
    try:
        assert kv.applies_to("s1") and not kv.applies_to("")
    finally:
        await kv.stop(1)

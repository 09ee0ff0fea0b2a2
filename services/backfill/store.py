"""Better answers in Redis, stored once, pushed once per ticket, kept for a set retention.

No key here carries a Redis TTL. The KV cache shares the Redis, bounded with `volatile-lru`:
under memory pressure Redis evicts only keys with a TTL, and every KV block has one while
nothing here does, so cache traffic can never evict an answer the user was promised, its
index or its delivery mark. How long they are kept (`backfill.answer_retention_s`) is this
store's job: `sweep()` removes what is older, from an index by time, a bounded batch per call.

Keys (prefix `ballast:backfill:` by default):
- `answer:{ticket}`: the BackfilledAnswer, written with SET NX (a replayed duplicate never
  replaces the first answer);
- `state:{ticket}`: `stored<0>tenant<0>session` while the answer is kept, then
  `expired<0>tenant` for another retention period, so GetAnswer tells "not ready yet" from
  "expired" (and from "lost": stored, yet the answer is gone);
- `retained`: sorted set of tickets by when they were stored (or first attempted), swept;
  `expired`: sorted set of swept tickets by when, whose states are swept in turn;
- `delivered:{ticket}`: the delivery mark. A subscription that is about to push an answer
  takes it as a lease (`claim:<subscriber>@<ms>`, until that Redis time, `claim_lease_s`
  on) and, once the push is written, keeps it with the answer (`sent:<subscriber>`). Taking
  it again under the same lease is allowed, so a claim whose reply was lost (a connection
  cut, a cluster client that sends again after a failover) is not mistaken for another
  subscription's; a lease whose subscription died before the push runs out, and the answer
  goes to the next one. An answer is pushed at least once, and more than once only if the
  store stays away for a whole lease right after a push;
- `session:{tenant}:{session}`: sorted set of a session's tickets by original timestamp,
  capped, for Subscribe to catch up;
- `attempts:{ticket}`: failed replays so far (survives restarts, so a request that crashes the
  service is still dead-lettered after N tries).
A notice on one pub/sub channel wakes subscriptions at once. Notices are lost only while the
listener is disconnected, so every subscription re-checks when it (re)connects; a slow timer
re-check is the last safety net.

On one Redis server (or a primary with replicas), storing an answer is one round trip (a
script: SET NX, state, retention index, session index, notice), and so is a session
subscription's wake: a script walks the session's index and takes the delivery mark of every
stored, undelivered answer, returning them.

On a Redis Cluster (`ClusterAnswerStore`) those scripts cannot run: a session's answers and
its index live in different hash slots. There a ticket's keys share one slot (the ticket is
their hash tag: `{prefix}{<ticket>}:answer`, `...:delivered`, `...:attempts`, `...:state`),
each command or script names keys of one slot only, and the two steps above take a few round
trips in an order that keeps their promises: the answer is stored before it is indexed, and
indexed before the notice; a delivery mark is taken by a one-key script, so one subscription
alone pushes each answer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections import defaultdict
from typing import Iterable

from google.protobuf.message import DecodeError
from redis.exceptions import RedisError

from ballast.v1 import backfill_pb2
from services.common.redis_client import UNAVAILABLE_ERRORS, AnyRedis, open_pubsub
from services.common.tasks import stop_task

log = logging.getLogger(__name__)

# Shared by the scripts that read or take a delivery mark. A lease mark is
# 'claim:<subscriber>@<until, Redis time in ms>'; a sent mark is 'sent:<subscriber>'.
_MARKS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function is_mine(holder, lease)
  return holder ~= false and holder ~= nil and string.sub(holder, 1, #lease + 1) == lease .. '@'
end
-- Whether another subscription holds the mark: a sent mark, or a lease not ours still running.
local function held_by_other(holder, lease, now)
  if not holder or is_mine(holder, lease) then return false end
  if string.sub(holder, 1, 6) == 'claim:' then
    local at = string.find(holder, '@', 1, true)
    if at then return tonumber(string.sub(holder, at + 1)) > now end
  end
  return true
end
"""

# KEYS[1]: a delivery mark. ARGV: this subscriber's lease, its length (s). Takes the mark when
# it is free, ours, or a lease that ran out (1), else leaves it (0).
_CLAIM = (
    _MARKS
    + """
local now = now_ms()
if held_by_other(redis.call('GET', KEYS[1]), ARGV[1], now) then return 0 end
redis.call('SET', KEYS[1], ARGV[1] .. '@' .. (now + tonumber(ARGV[2]) * 1000))
return 1
"""
)

# KEYS[1]: a delivery mark. ARGV: this subscriber's lease, its sent mark. The push was written:
# the lease becomes the sent mark, kept as long as the answer (1); 0 if the mark is another's
# (this lease ran out and another subscription took it).
_CONFIRM = (
    _MARKS
    + """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[2] then return 1 end
if not is_mine(holder, ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""
)

# Deletes the delivery mark only if this subscriber's lease holds it (an unclaim after a failed
# write), then announces the answer again (ARGV[2]: channel, ARGV[3]: notice) so a waiting
# subscription takes it now.
_UNCLAIM = (
    _MARKS
    + """
if is_mine(redis.call('GET', KEYS[1]), ARGV[1]) then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  return 1
end
return 0
"""
)


# KEYS: the answer's key, its state, the retention index, and its session's index when it has
# a session. ARGV: the answer, ticket, original timestamp (ms), index size, notice channel,
# notice, state. Stores the answer unless one is (1 when stored; its retention runs from now),
# indexes and announces it either way.
_PUT_ONCE = (
    _MARKS
    + """
local stored = redis.call('SET', KEYS[1], ARGV[1], 'NX')
if stored then
  redis.call('SET', KEYS[2], ARGV[7])
  redis.call('ZADD', KEYS[3], now_ms(), ARGV[2])
end
if KEYS[4] then
  redis.call('ZADD', KEYS[4], ARGV[3], ARGV[2])
  -- Keep only the newest entries: a chatty session cannot grow the index forever.
  redis.call('ZREMRANGEBYRANK', KEYS[4], 0, -tonumber(ARGV[4]) - 1)
end
redis.call('PUBLISH', ARGV[5], ARGV[6])
if stored then return 1 end
return 0
"""
)


# KEYS[1]: a session's index. ARGV: key prefix, this subscriber's lease, lease length (s), most
# answers to take. Returns ticket, answer, ticket, answer, ...: the stored answers of the session
# not delivered yet (no mark, this lease's, or a lease that ran out), oldest original request
# first, each now held by this lease.
_CLAIM_SESSION = (
    _MARKS
    + """
local taken = {}
local limit = tonumber(ARGV[4])
local now = now_ms()
local until_ms = now + tonumber(ARGV[3]) * 1000
for _, ticket in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if #taken >= 2 * limit then break end
  local mark = ARGV[1] .. 'delivered:' .. ticket
  if not held_by_other(redis.call('GET', mark), ARGV[2], now) then
    local answer = redis.call('GET', ARGV[1] .. 'answer:' .. ticket)
    if answer then
      redis.call('SET', mark, ARGV[2] .. '@' .. until_ms)
      taken[#taken + 1] = ticket
      taken[#taken + 1] = answer
    end
  end
end
return taken
"""
)


# Warn at most this often that writes went out without reaching their replicas.
_WARN_EVERY_S = 60.0
# States of a ticket (`state:{ticket}`), with the tenant (and session) after a NUL.
STORED = "stored"
EXPIRED = "expired"


class AnswerState(str, enum.Enum):
    """Why GetAnswer has no answer to give."""

    PENDING = "pending"  # nothing stored yet (or not the caller's): it may still come
    EXPIRED = "expired"  # kept for its retention, then removed
    LOST = "lost"  # stored, and no longer in the store


def _parse_answer(raw: bytes) -> backfill_pb2.BackfilledAnswer:
    answer = backfill_pb2.BackfilledAnswer()
    answer.ParseFromString(raw)
    return answer


def lease_mark(subscriber: str) -> str:
    """The prefix of the delivery mark held while `subscriber` pushes the answer."""
    return f"claim:{subscriber}"


def sent_mark(subscriber: str) -> str:
    """A delivery mark once `subscriber` has written the push."""
    return f"sent:{subscriber}"


def _text(raw: bytes | str | None) -> str | None:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


class AnswerStore:
    def __init__(
        self, client: AnyRedis, prefix: str, retention_s: int, index_max: int = 1000, claim_lease_s: float = 30.0
    ) -> None:
        self.redis = client
        self.prefix = prefix
        self.retention_s = retention_s
        self.index_max = index_max
        # Whole seconds; at least one.
        self.claim_lease_s = max(1, math.ceil(claim_lease_s))
        self.channel = f"{prefix}notify"
        self.retained_key = f"{prefix}retained"
        self.expired_key = f"{prefix}expired"
        self._claim = client.register_script(_CLAIM)
        self._confirm = client.register_script(_CONFIRM)
        self._unclaim = client.register_script(_UNCLAIM)
        self._claim_session = client.register_script(_CLAIM_SESSION)
        self._put_once = client.register_script(_PUT_ONCE)

    def _ticket_key(self, kind: str, ticket: str) -> str:
        # The Lua of _CLAIM_SESSION builds answer and delivered keys the same way.
        return f"{self.prefix}{kind}:{ticket}"

    def _answer(self, ticket: str) -> str:
        return self._ticket_key("answer", ticket)

    def _delivered(self, ticket: str) -> str:
        return self._ticket_key("delivered", ticket)

    def _attempts(self, ticket: str) -> str:
        return self._ticket_key("attempts", ticket)

    def _state(self, ticket: str) -> str:
        return self._ticket_key("state", ticket)

    def _session(self, tenant: str, session_id: str) -> str:
        return f"{self.prefix}session:{tenant}:{session_id}"

    @staticmethod
    def _stored_state(answer: backfill_pb2.BackfilledAnswer) -> str:
        return f"{STORED}\0{answer.tenant}\0{answer.session_id}"

    async def put_once(self, answer: backfill_pb2.BackfilledAnswer) -> bool:
        """Stores the answer unless one is stored already; indexes and announces it either way
        (a retry after a crash must still reach subscribers). True when this call stored it.
        One script: the notice follows the stored answer, in one round trip."""
        keys = [self._answer(answer.ticket), self._state(answer.ticket), self.retained_key]
        if answer.session_id:
            keys.append(self._session(answer.tenant, answer.session_id))
        stored = await self._put_once(
            keys=keys,
            args=[
                answer.SerializeToString(),
                answer.ticket,
                answer.received_at.ToMilliseconds(),
                self.index_max,
                self.channel,
                self._notice(answer),
                self._stored_state(answer),
            ],
        )
        return bool(stored)

    @staticmethod
    def _notice(answer: backfill_pb2.BackfilledAnswer) -> str:
        return f"{answer.tenant}\0{answer.session_id}\0{answer.ticket}"

    async def get(self, ticket: str) -> backfill_pb2.BackfilledAnswer | None:
        raw = await self.redis.get(self._answer(ticket))
        return None if raw is None else _parse_answer(raw)

    async def state(self, ticket: str, tenant: str) -> AnswerState:
        """Why `tenant` finds no answer for the ticket. Another tenant's ticket reads as pending,
        exactly like one that is not ready."""
        state = _text(await self.redis.get(self._state(ticket)))
        kind, _, rest = (state or "").partition("\0")
        if rest.split("\0", 1)[0] != tenant:
            return AnswerState.PENDING
        if kind == EXPIRED:
            return AnswerState.EXPIRED
        if kind == STORED and await self.redis.get(self._answer(ticket)) is None:
            return AnswerState.LOST
        return AnswerState.PENDING

    async def claim_session(
        self, tenant: str, session_id: str, subscriber: str, limit: int
    ) -> list[backfill_pb2.BackfilledAnswer]:
        """Takes the delivery marks of up to `limit` stored, undelivered answers of the session
        (oldest original request first) as leases and returns those answers. The index is per
        tenant, so they are the tenant's own."""
        reply = await self._claim_session(
            keys=[self._session(tenant, session_id)],
            args=[self.prefix, lease_mark(subscriber), self.claim_lease_s, limit],
        )
        answers = []
        for ticket, raw in zip(reply[::2], reply[1::2]):
            try:
                answers.append(_parse_answer(raw))
            except DecodeError:
                # Not written by put_once. Marked for good, so no subscription of the session
                # trips on it again; the rest go out.
                await self.confirm(ticket.decode(errors="replace"), subscriber)
                log.error(
                    "unreadable answer %s in session %s of %s; skipped",
                    ticket.decode(errors="replace"),
                    session_id,
                    tenant,
                )
        return answers

    async def claim(self, ticket: str, subscriber: str) -> bool:
        """Takes the delivery mark as a lease; True for the one caller that may push this ticket
        (again True for the same subscriber while its lease holds)."""
        return bool(
            await self._claim(keys=[self._delivered(ticket)], args=[lease_mark(subscriber), self.claim_lease_s])
        )

    async def confirm(self, ticket: str, subscriber: str) -> bool:
        """The push was written: the mark is kept with the answer, so no one pushes it again.
        False if the lease had run out and another subscription holds the mark."""
        return bool(
            await self._confirm(keys=[self._delivered(ticket)], args=[lease_mark(subscriber), sent_mark(subscriber)])
        )

    async def unclaim(self, answer: backfill_pb2.BackfilledAnswer, subscriber: str) -> None:
        """Gives a claimed answer back (the push did not reach the stream) and announces it again."""
        await self._unclaim(
            keys=[self._delivered(answer.ticket)], args=[lease_mark(subscriber), self.channel, self._notice(answer)]
        )

    async def add_attempt(self, ticket: str) -> int:
        # Indexed for retention from the first attempt, so the count of a request never
        # answered (dead-lettered) is swept too; a stored answer restarts the clock.
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.incr(self._attempts(ticket))
            pipe.zadd(self.retained_key, {ticket: time.time() * 1000}, nx=True)
            count, _ = await pipe.execute()
        return int(count)

    async def attempts(self, ticket: str) -> int:
        return int(await self.redis.get(self._attempts(ticket)) or 0)

    async def sweep(self, now_s: float | None = None, batch: int = 500) -> int:
        """Removes what is past its retention, up to `batch` tickets (call again while it
        returns `batch`): the answer, its delivery mark, attempts and session index entry go,
        its state becomes `expired` for another retention; expired states older than that go.
        Each step may be repeated after a crash. Returns the tickets swept."""
        now_ms = (time.time() if now_s is None else now_s) * 1000
        cutoff = now_ms - self.retention_s * 1000
        tickets = [
            _text(t) for t in await self.redis.zrangebyscore(self.retained_key, "-inf", cutoff, start=0, num=batch)
        ]
        for ticket in tickets:
            state = _text(await self.redis.get(self._state(ticket)))
            kind, _, rest = (state or "").partition("\0")
            if kind == STORED:
                tenant, _, session_id = rest.partition("\0")
                # The tombstone first: a crash after it leaves "expired", never "lost".
                await self._write(
                    self._state(ticket), lambda pipe, t=ticket, n=tenant: pipe.set(self._state(t), f"{EXPIRED}\0{n}")
                )
                await self.redis.zadd(self.expired_key, {ticket: now_ms})
                if session_id:
                    await self.redis.zrem(self._session(tenant, session_id), ticket)
            await self.redis.delete(self._answer(ticket), self._delivered(ticket), self._attempts(ticket))
            await self.redis.zrem(self.retained_key, ticket)
        gone = [_text(t) for t in await self.redis.zrangebyscore(self.expired_key, "-inf", cutoff, start=0, num=batch)]
        for ticket in gone:
            await self.redis.delete(self._state(ticket))
            await self.redis.zrem(self.expired_key, ticket)
        return len(tickets)

    async def _write(self, key: str, write) -> object:
        """Runs `write(pipe)` (commands on `key`); the cluster store also waits for replicas."""
        pipe = self.redis.pipeline(transaction=False)
        write(pipe)
        return (await pipe.execute())[0]


class Notices:
    """One pub/sub connection per process that wakes the subscriptions waiting on it."""

    def __init__(self, client: AnyRedis, channel: str) -> None:
        self.redis = client
        self.channel = channel
        self._waiters: dict[tuple[str, ...], set[asyncio.Event]] = defaultdict(set)
        self._task: asyncio.Task | None = None

    def watch(self, keys: Iterable[tuple[str, ...]]) -> asyncio.Event:
        event = asyncio.Event()
        for key in keys:
            self._waiters[key].add(event)
        return event

    def unwatch(self, keys: Iterable[tuple[str, ...]], event: asyncio.Event) -> None:
        for key in keys:
            waiters = self._waiters.get(key)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[key]

    def _wake_all(self) -> None:
        """Notices published while the listener was away are lost: every subscription reads again."""
        for waiters in self._waiters.values():
            for event in waiters:
                event.set()

    def _wake(self, payload: str) -> None:
        parts = payload.split("\0")
        if len(parts) != 3:
            return
        tenant, session_id, ticket = parts
        for key in (("session", tenant, session_id), ("ticket", ticket)):
            for event in self._waiters.get(key, ()):
                event.set()

    async def _listen_forever(self) -> None:
        backoff = 0.5
        while True:
            pubsub = None
            try:
                pubsub = await open_pubsub(self.redis, ignore_subscribe_messages=True)
                await pubsub.subscribe(self.channel)
                backoff = 0.5
                self._wake_all()
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        data = message["data"]
                        self._wake(data.decode(errors="replace") if isinstance(data, bytes) else str(data))
            except asyncio.CancelledError:
                raise
            except (RedisError, *UNAVAILABLE_ERRORS) as exc:
                log.debug("notice listener lost Redis (%r); subscriptions fall back to polling", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                try:
                    if pubsub is not None:
                        await pubsub.aclose()
                except (RedisError, OSError):
                    pass

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen_forever(), name="backfill-notices")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None


class ClusterAnswerStore(AnswerStore):
    """The same store on a Redis Cluster: every command and script stays in one hash slot.

    With `wait_replicas`, each write that must survive a master failover (the answer, its
    index entry, a delivery mark) goes out in one pipeline with a WAIT on the same master and
    connection, and returns once that many replicas have it (or after `wait_timeout_ms`)."""

    def __init__(
        self,
        client: AnyRedis,
        prefix: str,
        retention_s: int,
        index_max: int = 1000,
        claim_lease_s: float = 30.0,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 500,
    ) -> None:
        if "{" in prefix or "}" in prefix:
            # A brace in the prefix would become the hash tag and put every key in one slot.
            raise ValueError(f"the backfill key prefix {prefix!r} may not contain braces on a Redis Cluster")
        super().__init__(client, prefix, retention_s, index_max, claim_lease_s)
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._warned_at = -_WARN_EVERY_S

    def _ticket_key(self, kind: str, ticket: str) -> str:
        # The ticket is the hash tag: all of one ticket's keys in one slot.
        return f"{self.prefix}{{{ticket}}}:{kind}"

    async def _replicated(self, key: str, write) -> object:
        """Runs `write(pipe)` (commands on `key`) and, with wait_replicas, a WAIT on the master of
        `key` in the same pipeline: one connection to that master, so WAIT covers the write."""
        pipe = self.redis.pipeline(transaction=False)
        write(pipe)
        if not self.wait_replicas:
            return (await pipe.execute())[0]
        await self.redis.initialize()  # the slot map, for the master of `key`
        pipe.execute_command(
            "WAIT", self.wait_replicas, self.wait_timeout_ms, target_nodes=self.redis.get_node_from_key(key)
        )
        *results, acked = await pipe.execute()
        if int(acked) < self.wait_replicas:
            now = time.monotonic()
            if now - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = now
                log.warning(
                    "a backfill write reached %s of %d replicas within %d ms: a failover of "
                    "its master now could lose it",
                    acked,
                    self.wait_replicas,
                    self.wait_timeout_ms,
                )
        return results[0]

    async def _write(self, key: str, write) -> object:
        return await self._replicated(key, write)

    async def put_once(self, answer: backfill_pb2.BackfilledAnswer) -> bool:
        # Stored, then indexed, then announced: whoever the notice wakes finds the answer. A
        # crash between the steps leaves it stored but unindexed until the replay of the same
        # request calls this again (it indexes and announces whether or not it stores).
        key = self._answer(answer.ticket)
        stored = await self._replicated(key, lambda pipe: pipe.set(key, answer.SerializeToString(), nx=True))
        # Its state and retention whether or not this call stored it: a crash right after the
        # answer must not leave it unswept. A stored answer restarts the retention clock.
        state = self._state(answer.ticket)
        await self._replicated(state, lambda pipe: pipe.set(state, self._stored_state(answer)))
        await self._replicated(
            self.retained_key,
            lambda pipe: pipe.zadd(self.retained_key, {answer.ticket: time.time() * 1000}, nx=not stored),
        )
        if answer.session_id:
            index = self._session(answer.tenant, answer.session_id)
            await self._replicated(index, lambda pipe: self._index(pipe, index, answer))
        await self.redis.publish(self.channel, self._notice(answer))
        return bool(stored)

    def _index(self, pipe, index: str, answer: backfill_pb2.BackfilledAnswer) -> None:
        # _PUT_ONCE's index half: one key, so one master and one connection, in this order.
        pipe.zadd(index, {answer.ticket: answer.received_at.ToMilliseconds()})
        # Keep only the newest entries: a chatty session cannot grow the index forever.
        pipe.zremrangebyrank(index, 0, -self.index_max - 1)

    async def claim(self, ticket: str, subscriber: str) -> bool:
        key = self._delivered(ticket)
        return bool(
            await self._replicated(
                key, lambda pipe: pipe.eval(_CLAIM, 1, key, lease_mark(subscriber), self.claim_lease_s)
            )
        )

    async def confirm(self, ticket: str, subscriber: str) -> bool:
        key = self._delivered(ticket)
        return bool(
            await self._replicated(
                key, lambda pipe: pipe.eval(_CONFIRM, 1, key, lease_mark(subscriber), sent_mark(subscriber))
            )
        )

    async def claim_session(
        self, tenant: str, session_id: str, subscriber: str, limit: int
    ) -> list[backfill_pb2.BackfilledAnswer]:
        tickets = [t.decode() for t in await self.redis.zrange(self._session(tenant, session_id), 0, -1)]
        if not tickets:
            return []
        # Which are stored and not yet delivered: one pipeline (a batch per master).
        pipe = self.redis.pipeline(transaction=False)
        for ticket in tickets:
            pipe.get(self._delivered(ticket))
            pipe.get(self._answer(ticket))
        replies = await pipe.execute()
        answers: list[backfill_pb2.BackfilledAnswer] = []
        for ticket, holder, raw in zip(tickets, replies[::2], replies[1::2]):
            if len(answers) >= limit:
                break
            if raw is None or (holder is not None and holder.startswith(b"sent:")):
                continue
            # The mark decides: another subscription may have taken it since the read.
            try:
                taken = await self.claim(ticket, subscriber)
            except (RedisError, *UNAVAILABLE_ERRORS):
                if not answers:
                    raise
                # What is held goes out now; the rest waits for the next read (a lease this
                # claim may have taken expires if no read comes).
                break
            if not taken:
                continue
            try:
                answers.append(_parse_answer(raw))
            except DecodeError:
                await self.confirm(ticket, subscriber)  # marked for good, as on one server
                log.error("unreadable answer %s in session %s of %s; skipped", ticket, session_id, tenant)
        return answers

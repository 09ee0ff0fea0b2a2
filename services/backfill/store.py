"""Better answers in Redis, stored once and pushed once per ticket.

Keys (prefix `ballast:backfill:` by default), all with the answer TTL:
- `answer:{ticket}`: the BackfilledAnswer, written with SET NX (a replayed duplicate never
  replaces the first answer);
- `delivered:{ticket}`: the delivery mark. A subscription that is about to push an answer
  takes it as a lease (`claim:<subscriber>`, for `claim_lease_s`) and, once the push is
  written, keeps it for the answer's TTL (`sent:<subscriber>`). Taking it again under the same
  lease is allowed, so a claim whose reply was lost (a connection cut, a cluster client that
  sends again after a failover) is not mistaken for another subscription's; a lease whose
  subscription died before the push expires, and the answer goes to the next one. An answer
  is pushed at least once, and more than once only if the store stays away for a whole lease
  right after a push;
- `session:{tenant}:{session}`: sorted set of a session's tickets by original timestamp,
  capped, for Subscribe to catch up;
- `attempts:{ticket}`: failed replays so far (survives restarts, so a request that crashes the
  service is still dead-lettered after N tries).
A notice on one pub/sub channel wakes subscriptions at once. Notices are lost only while the
listener is disconnected, so every subscription re-checks when it (re)connects; a slow timer
re-check is the last safety net.

On one Redis server (or a primary with replicas), storing an answer is one round trip (a
script: SET NX, index, notice), and so is a session subscription's wake: a script walks the
session's index and takes the delivery mark of every stored, undelivered answer, returning
them.

On a Redis Cluster (`ClusterAnswerStore`) those scripts cannot run: a session's answers and
its index live in different hash slots. There a ticket's keys share one slot (the ticket is
their hash tag: `{prefix}{<ticket>}:answer`, `...:delivered`, `...:attempts`), each command
or script names keys of one slot only, and the two steps above take a few round trips in an
order that keeps their promises: the answer is stored before it is indexed, and indexed
before the notice; a delivery mark is taken by a one-key script, so one subscription alone
pushes each answer.
"""

from __future__ import annotations

import asyncio
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

# KEYS[1]: a delivery mark. ARGV: this subscriber's lease, its length (s). Takes the mark when
# it is free or already this lease (1), else leaves it (0).
_CLAIM = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
return 1
"""

# KEYS[1]: a delivery mark. ARGV: this subscriber's lease, its sent mark, the answer's TTL (s).
# The push was written: the lease becomes the sent mark, kept as long as the answer (1); 0 if
# the mark is another's (this lease expired and another subscription took it).
_CONFIRM = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[2] then return 1 end
if holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', tonumber(ARGV[3]))
return 1
"""

# Deletes the delivery mark only if this subscriber's lease holds it (an unclaim after a failed
# write), then announces the answer again (ARGV[2]: channel, ARGV[3]: notice) so a waiting
# subscription takes it now.
_UNCLAIM = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  return 1
end
return 0
"""


# KEYS[1]: the answer's key; KEYS[2]: its session's index, when it has a session. ARGV: the
# answer, TTL (s), ticket, original timestamp (ms), index size, notice channel, notice.
# Stores the answer unless one is (1 when stored), indexes and announces it either way.
_PUT_ONCE = """
local stored = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', tonumber(ARGV[2]))
if KEYS[2] then
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
  -- Keep only the newest entries: a chatty session cannot grow the index forever.
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -tonumber(ARGV[5]) - 1)
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
end
redis.call('PUBLISH', ARGV[6], ARGV[7])
if stored then return 1 end
return 0
"""


# KEYS[1]: a session's index. ARGV: key prefix, this subscriber's lease, lease length (s), most
# answers to take. Returns ticket, answer, ticket, answer, ...: the stored answers of the session
# not delivered yet (no mark, or this lease's), oldest original request first, each now held by
# this lease.
_CLAIM_SESSION = """
local taken = {}
local limit = tonumber(ARGV[4])
for _, ticket in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if #taken >= 2 * limit then break end
  local mark = ARGV[1] .. 'delivered:' .. ticket
  local holder = redis.call('GET', mark)
  if not holder or holder == ARGV[2] then
    local answer = redis.call('GET', ARGV[1] .. 'answer:' .. ticket)
    if answer then
      redis.call('SET', mark, ARGV[2], 'EX', tonumber(ARGV[3]))
      taken[#taken + 1] = ticket
      taken[#taken + 1] = answer
    end
  end
end
return taken
"""


# Warn at most this often that writes went out without reaching their replicas.
_WARN_EVERY_S = 60.0


def _parse_answer(raw: bytes) -> backfill_pb2.BackfilledAnswer:
    answer = backfill_pb2.BackfilledAnswer()
    answer.ParseFromString(raw)
    return answer


def lease_mark(subscriber: str) -> str:
    """A delivery mark held while `subscriber` pushes the answer."""
    return f"claim:{subscriber}"


def sent_mark(subscriber: str) -> str:
    """A delivery mark once `subscriber` has written the push."""
    return f"sent:{subscriber}"


class AnswerStore:
    def __init__(self, client: AnyRedis, prefix: str, ttl_s: int, index_max: int = 1000,
                 claim_lease_s: float = 30.0) -> None:
        self.redis = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.index_max = index_max
        # Whole seconds for EX; at least one.
        self.claim_lease_s = max(1, math.ceil(claim_lease_s))
        self.channel = f"{prefix}notify"
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

    def _session(self, tenant: str, session_id: str) -> str:
        return f"{self.prefix}session:{tenant}:{session_id}"

    async def put_once(self, answer: backfill_pb2.BackfilledAnswer) -> bool:
        """Stores the answer unless one is stored already; indexes and announces it either way
        (a retry after a crash must still reach subscribers). True when this call stored it.
        One script: the notice follows the stored answer, in one round trip."""
        keys = [self._answer(answer.ticket)]
        if answer.session_id:
            keys.append(self._session(answer.tenant, answer.session_id))
        stored = await self._put_once(keys=keys, args=[
            answer.SerializeToString(), self.ttl_s, answer.ticket, answer.received_at.ToMilliseconds(),
            self.index_max, self.channel, self._notice(answer)])
        return bool(stored)

    @staticmethod
    def _notice(answer: backfill_pb2.BackfilledAnswer) -> str:
        return f"{answer.tenant}\0{answer.session_id}\0{answer.ticket}"

    async def get(self, ticket: str) -> backfill_pb2.BackfilledAnswer | None:
        raw = await self.redis.get(self._answer(ticket))
        return None if raw is None else _parse_answer(raw)

    async def claim_session(self, tenant: str, session_id: str, subscriber: str,
                            limit: int) -> list[backfill_pb2.BackfilledAnswer]:
        """Takes the delivery marks of up to `limit` stored, undelivered answers of the session
        (oldest original request first) as leases and returns those answers. The index is per
        tenant, so they are the tenant's own."""
        reply = await self._claim_session(keys=[self._session(tenant, session_id)],
                                          args=[self.prefix, lease_mark(subscriber), self.claim_lease_s, limit])
        answers = []
        for ticket, raw in zip(reply[::2], reply[1::2]):
            try:
                answers.append(_parse_answer(raw))
            except DecodeError:
                # Not written by put_once. Marked for good, so no subscription of the session
                # trips on it again; the rest go out.
                await self.confirm(ticket.decode(errors="replace"), subscriber)
                log.error("unreadable answer %s in session %s of %s; skipped",
                          ticket.decode(errors="replace"), session_id, tenant)
        return answers

    async def claim(self, ticket: str, subscriber: str) -> bool:
        """Takes the delivery mark as a lease; True for the one caller that may push this ticket
        (again True for the same subscriber while its lease holds)."""
        return bool(await self._claim(keys=[self._delivered(ticket)],
                                      args=[lease_mark(subscriber), self.claim_lease_s]))

    async def confirm(self, ticket: str, subscriber: str) -> bool:
        """The push was written: the mark is kept for the answer's TTL, so no one pushes it again.
        False if the lease had expired and another subscription holds the mark."""
        return bool(await self._confirm(keys=[self._delivered(ticket)],
                                        args=[lease_mark(subscriber), sent_mark(subscriber), self.ttl_s]))

    async def unclaim(self, answer: backfill_pb2.BackfilledAnswer, subscriber: str) -> None:
        """Gives a claimed answer back (the push did not reach the stream) and announces it again."""
        await self._unclaim(keys=[self._delivered(answer.ticket)],
                            args=[lease_mark(subscriber), self.channel, self._notice(answer)])

    async def add_attempt(self, ticket: str) -> int:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(self._attempts(ticket))
            pipe.expire(self._attempts(ticket), self.ttl_s)
            count, _ = await pipe.execute()
        return int(count)

    async def attempts(self, ticket: str) -> int:
        return int(await self.redis.get(self._attempts(ticket)) or 0)


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

    def __init__(self, client: AnyRedis, prefix: str, ttl_s: int, index_max: int = 1000,
                 claim_lease_s: float = 30.0, wait_replicas: int = 0, wait_timeout_ms: int = 500) -> None:
        if "{" in prefix or "}" in prefix:
            # A brace in the prefix would become the hash tag and put every key in one slot.
            raise ValueError(f"the backfill key prefix {prefix!r} may not contain braces on a Redis Cluster")
        super().__init__(client, prefix, ttl_s, index_max, claim_lease_s)
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
        pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms,
                             target_nodes=self.redis.get_node_from_key(key))
        *results, acked = await pipe.execute()
        if int(acked) < self.wait_replicas:
            now = time.monotonic()
            if now - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = now
                log.warning("a backfill write reached %s of %d replicas within %d ms: a failover of "
                            "its master now could lose it", acked, self.wait_replicas, self.wait_timeout_ms)
        return results[0]

    async def put_once(self, answer: backfill_pb2.BackfilledAnswer) -> bool:
        # Stored, then indexed, then announced: whoever the notice wakes finds the answer. A
        # crash between the steps leaves it stored but unindexed until the replay of the same
        # request calls this again (it indexes and announces whether or not it stores).
        key = self._answer(answer.ticket)
        stored = await self._replicated(key, lambda pipe: pipe.set(
            key, answer.SerializeToString(), nx=True, ex=self.ttl_s))
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
        pipe.expire(index, self.ttl_s)

    async def claim(self, ticket: str, subscriber: str) -> bool:
        key = self._delivered(ticket)
        return bool(await self._replicated(key, lambda pipe: pipe.eval(
            _CLAIM, 1, key, lease_mark(subscriber), self.claim_lease_s)))

    async def confirm(self, ticket: str, subscriber: str) -> bool:
        key = self._delivered(ticket)
        return bool(await self._replicated(key, lambda pipe: pipe.eval(
            _CONFIRM, 1, key, lease_mark(subscriber), sent_mark(subscriber), self.ttl_s)))

    async def claim_session(self, tenant: str, session_id: str, subscriber: str,
                            limit: int) -> list[backfill_pb2.BackfilledAnswer]:
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
            if raw is None or holder not in (None, lease_mark(subscriber).encode()):
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

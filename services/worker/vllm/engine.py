"""VllmEngine: `services.worker.engine.Engine` over vLLM's async engine, on a GPU.

Start: read config.json and the weight sizes, check the configuration against the model and
the GPU (`checks.check_engine_config`, fails fast with the numbers), find what the installed
vLLM provides (`api.detect_vllm_api`, once), and open AsyncLLM with every memory-relevant
setting explicit. With `sleep_on_standby` the engine then goes to sleep at once (weights to
CPU memory, KV freed) and wakes on the first request: a warm standby that holds almost no GPU
memory and skips a cold start.

Requests: the context is sent as token ids (prompt + tokens already generated, so a stream
resumed from another replica continues after them), sampling is mapped explicitly
(`params`), outputs stream as DELTAs and become TokenDeltas. The streamed text is computed
here from the token ids with the same TextStream as the torch engine (UTF-8-safe
incremental detokenization, stop strings held back and cut), primed with the already
generated ids: text stays seamless across a resume and a stop string that straddles the
resume point is still found. vLLM also gets the stop strings, so it stops and frees the KV
by itself. EOS tokens are never emitted (as on the torch engine). Closing or cancelling the
stream aborts the vLLM request (in a finally), and vLLM errors become typed errors
(`errors`).

Guided decoding: vLLM's grammar masks the tokens (its structured outputs for a fresh stream,
Ballast's processor for a resumed one), and the engine follows the same grammar here with a
`services.worker.guided` guide, built before vLLM sees the request (a resumed stream whose
ids leave it is refused) and advanced over every token vLLM returns: the document ends by the
rule every engine follows (`guided.document_end`), and vLLM's request is aborted there
instead of spending a forward pass on the EOS.

Session KV: vLLM's own prefix cache (per tenant, through `cache_salt`), and, with
`worker.cache_address` set, persistence through the cache service by Ballast's KV connector
(`connector`), configured at start when vLLM's page layout here is one Ballast writes
(`connector_config.plan_connector`; otherwise session prefixes are recomputed and every
session request counts the reason in `ballast_worker_kv_decisions`). Session requests carry
their tenant to the connector; its counts come back with vLLM's stats as the KV metrics.

Stats: running, waiting and KV-cache use come from vLLM's scheduler stats (`stats`), and
so does the count of engine steps (`steps`).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from services.common.errors import BallastError, InvalidArgument, ResourceExhausted, Unavailable
from services.worker.detokenizer import TextStream, finished_before_start
from services.worker.engine import (
    EngineRequest,
    EngineStats,
    FinishReason,
    KvAttachable,
    ModelDescription,
    Stepping,
    TokenDelta,
    Wakeable,
)
from services.worker.guided import DocumentEnd, GuideCompiler, GuideMismatch, JsonGuide, document_end
from services.worker.model_files import describe_model
from services.worker.validation import validate_request
from services.worker.vllm.api import VllmApi, detect_vllm_api
from services.worker.vllm.checks import (
    EnginePlan,
    VllmSettings,
    check_cpu_engine_config,
    check_engine_config,
    gpu_memory_bytes,
    read_model_facts,
)
from services.worker.vllm.client import ClientFactory, VllmClient, open_vllm_client
from services.worker.vllm.connector_config import ConnectorSetup, plan_connector, session_params
from services.worker.vllm.errors import map_vllm_error
from services.worker.vllm.params import sampling_plan
from services.worker.vllm.stats import engine_stats, kv_fragmentation

log = logging.getLogger(__name__)


class VllmEngine(KvAttachable, Wakeable, Stepping):
    """`services.worker.engine.Engine` on vLLM, with session KV (`attach_kv`) and a sleeping
    warm standby (`wake_up`)."""

    def __init__(
        self,
        model_dir: Path,
        model_name: str,
        settings: VllmSettings | None = None,
        *,
        eos_token_ids: Sequence[int] | None = None,
        api: VllmApi | None = None,
        client_factory: ClientFactory | None = None,
        gpu_memory: Callable[[], int | None] = gpu_memory_bytes,
    ) -> None:
        """`eos_token_ids` overrides the model's (an empty tuple disables EOS). `api` and
        `client_factory` replace vLLM itself (tests); `gpu_memory` reports the GPU's size."""
        from tokenizers import Tokenizer

        self._dir = Path(model_dir)
        self._settings = settings or VllmSettings()
        self._facts = read_model_facts(self._dir)
        description = describe_model(self._dir, model_name)
        # The model's own EOS ids end a guided document, even with EOS switched off (as on the
        # torch and sim engines, and in Ballast's processor inside vLLM).
        self._model_eos = description.eos_token_ids
        if eos_token_ids is not None:
            description = replace(description, eos_token_ids=tuple(int(i) for i in eos_token_ids))
        # The router enforces the context this worker registers: the configured length.
        max_len = self._settings.max_model_len or self._facts.max_position_embeddings
        self._description = replace(description, max_context=max_len)
        self._eos = frozenset(self._description.eos_token_ids)
        self._tokenizer = Tokenizer.from_str(self._description.tokenizer_json.decode("utf-8"))
        self._vocab_size = self._facts.vocab_size or self._tokenizer.get_vocab_size(with_added_tokens=True)
        concurrency = self._settings.max_concurrency
        waiting = self._settings.max_waiting
        self._max_in_flight = concurrency + (4 * concurrency if waiting is None else waiting)
        self._api = api
        self._factory: ClientFactory = client_factory or open_vllm_client
        self._gpu_memory = gpu_memory
        self._client: VllmClient | None = None
        self._plan: EnginePlan | None = None
        self._kv_capacity = 1
        self._ids = itertools.count(1)
        self._in_flight = 0
        self._generated_total = 0
        self._guided_resumes = 0
        # Tokens each request in flight holds in the KV cache (context + generated so far).
        self._context_tokens: dict[str, int] = {}
        self._guide_compiler: GuideCompiler | None = None
        self._sleeping = False
        self._sleep_lock = asyncio.Lock()
        # Session KV through the cache service: the connector, or why there is none.
        self._connector: ConnectorSetup | None = None
        self._connector_off = "no_cache"
        self._kv_metrics: Any = None

    # --- lifecycle ------------------------------------------------------------------
    @property
    def model(self) -> ModelDescription:
        return self._description

    @property
    def plan(self) -> EnginePlan | None:
        return self._plan

    @property
    def api(self) -> VllmApi | None:
        return self._api

    async def start(self) -> None:
        if self._client is not None:
            return
        api = self._api or detect_vllm_api()
        if api.platform == "cpu":
            plan = check_cpu_engine_config(self._settings, self._facts)
        else:
            gpu = self._gpu_memory()
            plan = check_engine_config(self._settings, self._facts, gpu)
            if gpu is None:
                log.warning("GPU memory unknown (no NVML, no CUDA): KV memory checks skipped")
        log.info(
            "vLLM %s (%s): dtype %s, KV %s (%d bytes/token), max_model_len %d, estimated KV capacity %s tokens",
            api.version,
            api.engine_kind,
            plan.dtype,
            plan.kv_cache_dtype,
            plan.kv_bytes_per_token,
            plan.max_model_len,
            plan.kv_capacity_tokens,
        )
        self._connector, self._connector_off = plan_connector(
            self._settings.store, self._description.version, self._facts, plan, api.platform, api.cpu_attention_isa
        )
        if self._connector is not None:
            plan = replace(plan, connector=self._connector)
            log.info(
                "session KV through the cache service at %s (blocks of %d tokens)",
                self._connector.store.address,
                self._connector.store.block_tokens,
            )
        elif self._settings.store is not None:
            log.warning(
                "session KV persistence is off on vLLM here (%s): session prefixes are recomputed", self._connector_off
            )
        client = self._factory(api, self._dir, self._description.name, self._settings, plan)
        if inspect.isawaitable(client):
            client = await client
        self._api, self._plan, self._client = api, plan, client
        self._kv_capacity = (
            client.kv_capacity_tokens()
            or plan.kv_capacity_tokens
            or self._settings.max_concurrency * plan.max_model_len
        )
        if self._settings.sleep_on_standby and api.supports_sleep_mode:
            await self.sleep()
        elif self._settings.sleep_on_standby:
            log.info("vLLM on %s has no sleep mode: a standby stays loaded (not routable until promoted)", api.platform)

    def attach_kv(self, metrics: Any, session_kv: Any = None) -> bool:
        """Reports session KV through `metrics` (services.worker.kv.KVMetrics); with a
        `session_kv` (services.worker.kv.SessionKV) the session follows the cache's health
        (its health Watch) while the connector moves the blocks. Call after start(). False when sessions are
        not persisted here (the reason was logged at start)."""
        self._kv_metrics = metrics
        watch = getattr(self._client, "watch_connector", None)
        if watch is not None:
            watch(self._record_connector)
        if session_kv is None:
            return True
        if self._connector is None:
            return False
        session_kv.bind(self._description.version, self._connector.layout)
        return True

    def _record_connector(self, counts: dict[str, float]) -> None:
        metrics = self._kv_metrics
        if metrics is None or self._connector is None:
            return
        block = self._connector.store.block_tokens
        for name, value in counts.items():
            kind, _, detail = name.partition(".")
            if not value:
                continue
            if kind == "lookups":
                metrics.lookups.add(value, {"result": detail})
            elif kind == "restore_failures":
                metrics.restore_failures.add(value, {"reason": detail})
            elif kind == "saves":
                metrics.saves.add(value, {"outcome": detail})
            elif kind == "saved_blocks":
                metrics.saved_blocks.add(value)
            elif kind == "restored_blocks":
                metrics.prefix_tokens.add(value * block, {"source": "cache"})
        restores = counts.get("restores", 0)
        if restores:
            metrics.restore_ms.record(counts.get("restore_ms", 0.0) / restores)
        saves = counts.get("saves.saved", 0)
        if saves:
            metrics.save_ms.record(counts.get("save_ms", 0.0) / saves)

    async def stop(self) -> None:
        """Shuts vLLM down; streams still open fail Unavailable and resume elsewhere."""
        client, self._client = self._client, None
        if client is not None:
            client.shutdown()

    # --- warm standby -----------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        return self._sleeping

    async def sleep(self, level: int | None = None) -> None:
        """Frees the GPU for standby: level 1 moves weights to CPU memory and drops the KV
        cache, level 2 drops both. Only an idle engine sleeps (drain first): what vLLM does
        with running requests on sleep differs between releases. A request that arrives
        while asleep wakes the engine."""
        client = self._require_client()
        if not self._settings.sleep_on_standby or (self._api is not None and not self._api.supports_sleep_mode):
            raise RuntimeError(
                "vLLM runs without sleep mode (worker.sleep_on_standby is off, or the platform has none)"
            )
        if self._in_flight:
            raise RuntimeError(f"{self._in_flight} requests are in flight: drain before sleeping")
        async with self._sleep_lock:
            if not self._sleeping:
                await client.sleep(level or self._settings.sleep_level)
                self._sleeping = True

    async def wake_up(self) -> None:
        client = self._require_client()
        async with self._sleep_lock:
            if self._sleeping:
                await client.wake_up()
                self._sleeping = False

    # --- requests -------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` as is: no BOS added (a rendered chat template carries it)."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        """Validate now (bad input raises InvalidArgument before anything starts), then
        stream TokenDeltas; the last one carries the finish reason."""
        validate_request(request, self._vocab_size, self._description.max_context)
        return self._generate(request)

    def _require_client(self) -> VllmClient:
        if self._client is None:
            raise Unavailable("vLLM engine is not running")
        return self._client

    async def _generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        s = request.sampling
        text = TextStream(self._tokenizer, s.stop, initial_ids=request.generated_ids)
        done = finished_before_start(text, s.max_tokens)
        if done is not None:
            yield done
            return
        guide: JsonGuide | None = None
        if request.response_format:
            # Off the loop: the first guided request builds the tokenizer's grammar view (about
            # a second for a large vocabulary), and a schema compiles in milliseconds.
            guide = await asyncio.to_thread(self._request_guide, request)
        client = self._require_client()
        if self._in_flight >= self._max_in_flight:
            raise ResourceExhausted(f"{self._in_flight} requests in the vLLM engine; queue is full", retry_after_s=1.0)
        api = self._api
        assert api is not None
        context = [*request.prompt_ids, *request.generated_ids]
        request_id = f"{request.request_id or 'ballast'}-{next(self._ids)}"
        self._in_flight += 1
        self._context_tokens[request_id] = len(context)
        stream: Any = None
        vllm_done = False
        try:
            try:
                await self._ensure_awake()
            except BallastError:
                raise
            except Exception as exc:
                raise map_vllm_error(exc, api.error_types, lambda: client.errored) from exc
            params = self._sampling_params(api, request)
            prompt = api.tokens_prompt(context, cache_salt=request.tenant)
            stream = client.generate(prompt, params, request_id, priority=request.scheduling_priority)
            emitted, first = 0, True
            while True:
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    raise map_vllm_error(exc, api.error_types, lambda: client.errored) from exc
                completion = out.outputs[0]
                reason = completion.finish_reason
                stop_reason = getattr(completion, "stop_reason", None)
                if reason is not None or getattr(out, "finished", False):
                    vllm_done = True
                if reason == "abort":
                    raise Unavailable(
                        "vLLM aborted the request (engine asleep, paused or stopping); resume it elsewhere"
                    )
                if reason == "error":
                    # vLLM failed this request inside its engine (a grammar that did not compile
                    # there, a KV load that failed): another replica may still serve it.
                    raise Unavailable("vLLM ended the request with an engine-side error; resume it elsewhere")
                ids = [int(t) for t in completion.token_ids]
                eos_hit = reason == "stop" and bool(ids) and ids[-1] in self._eos and not isinstance(stop_reason, str)
                if eos_hit:
                    ids.pop()  # the EOS token ends the stream but is never emitted
                ids = ids[: s.max_tokens - emitted]
                kept: list[int] = []
                chunk, stopped_here, document_done = "", False, False
                for token in ids:
                    end = None
                    if guide is not None:
                        try:
                            guide.advance(token)
                            end = document_end(guide, token)
                        except GuideMismatch as exc:
                            # vLLM's grammar is not Ballast's here (a release whose structured
                            # outputs are not llguidance's compact JSON): vLLM's own end stands.
                            log.warning(
                                "request %s: vLLM's output left Ballast's grammar (%s); "
                                "the document ends where vLLM ends it",
                                request_id,
                                exc,
                            )
                            guide = None
                    if end is DocumentEnd.AT_EOS:  # an EOS vLLM did not stop on (EOS off)
                        document_done = True
                        break
                    kept.append(token)
                    piece, stopped = text.push(token)
                    chunk += piece
                    if stopped:
                        stopped_here = True
                        break
                    if end is DocumentEnd.COMPLETE:
                        document_done = True
                        break
                emitted += len(kept)
                self._generated_total += len(kept)
                self._context_tokens[request_id] = len(context) + emitted

                finish: FinishReason | None = None
                if stopped_here:
                    finish = FinishReason.STOP
                elif document_done:
                    finish = FinishReason.STOP
                    chunk += text.finish()
                elif reason == "stop":
                    finish = FinishReason.STOP
                    # A stop string vLLM matched but we did not: the held-back text may be
                    # the start of it, so it is not released.
                    if not isinstance(stop_reason, str):
                        chunk += text.finish()
                elif reason is not None or emitted >= s.max_tokens:
                    chunk += text.finish()
                    finish = FinishReason.STOP if text.stopped else FinishReason.LENGTH
                if finish is None and not kept and not chunk:
                    continue
                prefill = _prefill_tokens(out, len(context)) if first else None
                first = False
                if finish is not None:
                    if vllm_done:
                        # Let vLLM's generator end by itself: closing it early would send
                        # a (harmless but pointless) abort for a finished request.
                        await _drain(stream)
                        stream = None
                    else:
                        # We stopped first (a stop string across the resume point, max_tokens,
                        # a complete document): free vLLM's KV before the consumer reads the
                        # last delta.
                        vllm_done = True
                        await self._abort(client, request_id)
                yield TokenDelta(kept, chunk, finish, prefill_tokens=prefill)
                if finish is not None:
                    return
            raise Unavailable("the vLLM stream ended without a finish reason")
        finally:
            # Runs on normal end, aclose() and cancellation alike.
            self._in_flight -= 1
            self._context_tokens.pop(request_id, None)
            close = getattr(stream, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:
                    log.debug("closing vLLM stream %s", request_id, exc_info=True)
            if not vllm_done:
                await self._abort(client, request_id)

    def _sampling_params(self, api: VllmApi, request: EngineRequest) -> Any:
        plan = sampling_plan(request, self._description.eos_token_ids, api.delta_output_kind)
        kwargs = dict(plan.kwargs)
        if plan.resumed_guide:
            # The schema and the ids were checked with the processor's grammar (`_request_guide`).
            self._guided_resumes += 1
        if plan.schema:
            if not api.structured_field:
                log.warning(
                    "vLLM %s has no guided decoding: response_format is only validated after generation", api.version
                )
            kwargs.update(api.structured(plan.schema))
        if request.session_id:
            if self._connector is not None:
                kwargs["extra_args"] = {**(kwargs.get("extra_args") or {}), **session_params(request.tenant)}
            elif self._kv_metrics is not None and self._settings.store is not None:
                self._kv_metrics.decisions.add(1, {"choice": "recompute", "reason": self._connector_off})
        try:
            return api.sampling_params(**kwargs)
        except Exception as exc:  # vLLM validates its parameters on construction
            raise map_vllm_error(exc, api.error_types) from exc

    def _request_guide(self, request: EngineRequest) -> JsonGuide | None:
        """The request's guide (worker thread): InvalidArgument for a schema that cannot be
        guided or resumed ids that leave it, before vLLM sees the request. None where nothing
        guides vLLM (a release without guided decoding): there is no grammar to follow."""
        if not self._model_eos:
            raise InvalidArgument("guided decoding needs an EOS token, and this model has none")
        if self._guide_compiler is None:
            self._guide_compiler = GuideCompiler(self._description.tokenizer_json, self._vocab_size, self._model_eos)
        guide = self._guide_compiler.for_request(request.response_format, request.generated_ids)
        api = self._api
        if not request.generated_ids and api is not None and not api.structured_field:
            return None
        return guide

    async def _abort(self, client: VllmClient, request_id: str) -> None:
        try:
            await client.abort(request_id)
        except Exception:  # a dead engine cannot abort; the request is gone with it anyway
            log.warning("aborting vLLM request %s failed", request_id, exc_info=True)

    async def _ensure_awake(self) -> None:
        # A sleep still in progress holds the lock and is not yet marked: wait it out too.
        if self._sleeping or self._sleep_lock.locked():
            log.info("waking vLLM from standby for a request")
            await self.wake_up()

    @property
    def steps(self) -> int:
        """Engine steps vLLM reported to the stat logger (`Stepping`): each step of its
        scheduler reports, whether it prefilled, decoded or both."""
        client = self._client
        return client.engine_steps() if client is not None else 0

    def stats(self) -> EngineStats:
        client = self._client
        snapshot = client.scheduler_stats() if client is not None else None
        extra = {
            "max_concurrency": float(self._settings.max_concurrency),
            "generated_tokens_total": float(self._generated_total),
            "sleeping": 1.0 if self._sleeping else 0.0,
            "guided_resumes_total": float(self._guided_resumes),
        }
        if snapshot is not None:
            extra["kv_cache_usage"] = snapshot.kv_usage
            block = client.kv_block_tokens() if client is not None else None
            fragmentation = kv_fragmentation(
                snapshot.kv_usage, self._kv_capacity, block, sum(self._context_tokens.values())
            )
            if fragmentation is not None:
                extra["kv_fragmentation"] = fragmentation
        return engine_stats(snapshot, self._in_flight, self._settings.max_concurrency, self._kv_capacity, extra)


async def _drain(stream: Any) -> None:
    """Runs a finished vLLM output stream to its end."""
    try:
        await stream.__anext__()
    except StopAsyncIteration:
        return
    except Exception:  # it already delivered its final output; nothing after it matters
        log.debug("vLLM stream failed after its final output", exc_info=True)
        return
    log.debug("vLLM stream yielded after its final output")


def _prefill_tokens(output: Any, context_tokens: int) -> int | None:
    """Context tokens vLLM computed by prefill: all but its prefix-cache hits."""
    cached = getattr(output, "num_cached_tokens", None)
    if not isinstance(cached, int) or isinstance(cached, bool):
        return None
    return max(0, context_tokens - cached)

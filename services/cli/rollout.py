"""`ballast rollout start|status|promote|abort`: reads and writes rollout documents in etcd.

Like the routers, the commands write with a compare-and-swap on the document's revision, so
an operator never overwrites a gate decision made a moment before (or the other way round).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict

from services.cli.etcd_view import list_workers
from services.common.config import EtcdConfig
from services.router.rollout.state import Phase, Rollout, RolloutError, load_rollout, parse_rollout
from services.router.rollout.store import RolloutStore, Stored, with_store


class RolloutCommandError(Exception):
    """The command cannot be done as asked; the message says why and what to do."""


async def _stable_version(
    config: EtcdConfig, store: RolloutStore, model: str, candidate: str, current: Stored | None
) -> str:
    """What serves the model now: the last rollout's outcome, else the one version its workers run."""
    if current is not None:
        rollout = current.rollout
        return rollout.candidate if rollout.state is Phase.PROMOTED else rollout.stable
    versions = {r.model_version for r, _ttl in await list_workers(config) if r.model == model} - {candidate}
    if len(versions) != 1:
        found = ", ".join(sorted(versions)) or "none"
        raise RolloutCommandError(
            f"cannot tell the stable version of {model!r} (worker versions: {found}); pass --stable"
        )
    return versions.pop()


async def start_rollout(
    config: EtcdConfig,
    model: str,
    candidate: str,
    *,
    stable: str | None = None,
    weight: float = 10.0,
    mode: str = "canary",
    mirror_percent: float = 0.0,
    gate: dict | None = None,
) -> Rollout:
    async def action(store: RolloutStore) -> Rollout:
        current = await _read(store, model)
        if current is not None and current.rollout.running:
            raise RolloutCommandError(
                f"a rollout of {model!r} to {current.rollout.candidate} is running; promote or abort it first"
            )
        document = {
            "model": model,
            "stable": stable or await _stable_version(config, store, model, candidate, current),
            "candidate": candidate,
            "weight": weight,
            "mode": mode,
            "mirror_percent": mirror_percent,
            "state": Phase.RUNNING.value,
            "reason": "started",
            "gate": gate or {},
            "updated_at": time.time(),
        }
        try:
            rollout = parse_rollout(document, model)
        except RolloutError as exc:
            raise RolloutCommandError(str(exc)) from None
        await _swap(store, rollout, current)
        return rollout

    return await with_store(config, action)


async def decide_rollout(config: EtcdConfig, model: str, phase: Phase, reason: str) -> Rollout:
    """Promotes or aborts (rolls back) the running rollout of `model`."""

    async def action(store: RolloutStore) -> Rollout:
        current = await _read(store, model)
        if current is None:
            raise RolloutCommandError(f"no rollout of {model!r}; `ballast rollout start` begins one")
        if not current.rollout.running:
            raise RolloutCommandError(
                f"the rollout of {model!r} is already {current.rollout.state.value} ({current.rollout.reason})"
            )
        decided = current.rollout.decided(phase, reason)
        await _swap(store, decided, current)
        return decided

    return await with_store(config, action)


async def rollout_status(config: EtcdConfig, model: str | None = None) -> list[tuple[str, Rollout | str, Counter]]:
    """(model, rollout or the reason its document is invalid, registered workers per version)."""

    async def action(store: RolloutStore):
        documents = await store.read_all()
        workers = [record for record, _ttl in await list_workers(config)]
        rows = []
        for name in sorted(documents):
            if model is not None and name != model:
                continue
            try:
                shown: Rollout | str = load_rollout(documents[name], name)
            except RolloutError as exc:
                shown = f"invalid: {exc}"
            rows.append((name, shown, Counter(w.model_version for w in workers if w.model == name)))
        return rows

    return await with_store(config, action)


async def _read(store: RolloutStore, model: str) -> Stored | None:
    try:
        return await store.read(model)
    except RolloutError as exc:
        raise RolloutCommandError(
            f"the stored rollout of {model!r} is invalid ({exc}); fix or delete it with etcdctl"
        ) from None


async def _swap(store: RolloutStore, rollout: Rollout, current: Stored | None) -> None:
    if not await store.swap(rollout, current.mod_revision if current is not None else 0):
        raise RolloutCommandError(
            f"the rollout of {rollout.model!r} changed meanwhile; look at `ballast rollout status` and try again"
        )


def describe(rollout: Rollout, workers: Counter) -> list[str]:
    """Lines of `ballast rollout status` for one rollout."""

    def version(label: str, value: str) -> str:
        return f"  {label:<10} {value}  ({workers.get(value, 0)} workers)"

    gate = ", ".join(f"{k}={v:g}" for k, v in asdict(rollout.gate).items())
    updated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rollout.updated_at)) if rollout.updated_at else "-"
    return [
        f"{rollout.model}: {rollout.state.value} ({rollout.mode.value}), candidate weight {rollout.weight:g}%, "
        f"mirror {rollout.mirror_percent:g}%",
        version("stable", rollout.stable),
        version("candidate", rollout.candidate),
        f"  gate       {gate}",
        f"  reason     {rollout.reason or '-'}  (updated {updated})",
    ]

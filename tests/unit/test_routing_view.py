"""The routing view the router's gauges read: published on the loop, read-only elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.router.routing_view import RoutingView, RoutingViewPublisher


class Members:
    def __init__(self, workers: dict) -> None:
        self.current = workers

    def workers(self) -> dict:
        return self.current


class Health:
    """Records what it was fed; a snapshot names the workers it was given."""

    def __init__(self) -> None:
        self.updates: list[set] = []

    def update(self, workers) -> None:
        self.updates.append(set(workers))

    def snapshot(self, workers) -> dict:
        return {wid: SimpleNamespace(breaker=("closed" if wid != "w-new" else None)) for wid in workers}


def test_publish_feeds_the_health_view_then_freezes_a_snapshot():
    members, health = Members({"w-1": object(), "w-new": object()}), Health()
    publisher = RoutingViewPublisher(members, health, lambda: {"tiny": "queues"})
    view = publisher.publish()
    assert health.updates == [{"w-1", "w-new"}]
    assert publisher.current is view and set(view.workers) == {"w-1", "w-new"}
    assert dict(view.queues) == {"tiny": "queues"}
    # Workers without a breaker yet are left out of the breaker gauge.
    assert view.breakers() == {"w-1": "closed"}
    # A scrape thread holds a view that later routing cannot change under it.
    with pytest.raises(TypeError):
        view.workers["w-2"] = object()
    members.current = {}
    assert set(view.workers) == {"w-1", "w-new"} and publisher.publish().workers == {}


def test_an_empty_view_before_the_first_publish():
    assert RoutingView().workers == {} and RoutingView().breakers() == {}

"""Fixtures shared by the integration tests that run over a module's `mesh`."""

from __future__ import annotations

import pytest_asyncio

from services.router.degrade.handoff import HandOff, HandOffSettings


@pytest_asyncio.fixture(loop_scope="session")
async def handoff(mesh, tmp_path):
    """Hands records to the mesh's broker the way a router does."""
    handoff = HandOff(
        HandOffSettings(outbox_path=tmp_path / "outbox.sqlite", bootstrap=mesh.kafka.bootstrap, delivery_timeout_s=5)
    )
    await handoff.start()
    yield handoff
    await handoff.stop()

"""Warm standby roles in etcd: which workers should serve and which should wait warm.

The autoscaler's executor writes a worker's wanted role to `<prefix>roles/<worker_id>`
(`serving` or `standby`); the worker watches that key and switches at once, so promoting a
warm standby costs two etcd round trips, not a process start. The key is attached to the
worker's own membership lease: it disappears with the worker and never outlives it.
"""

from __future__ import annotations

from services.common.config import EtcdConfig
from services.common.etcd_session import EtcdSession

SERVING = "serving"
STANDBY = "standby"
ROLES = (SERVING, STANDBY)


def role_key(config: EtcdConfig, worker_id: str) -> str:
    return f"{config.prefix}roles/{worker_id}"


def parse_role(value: bytes | None) -> str | None:
    """The role a key value asks for; None for a deleted key or a value that is no role."""
    if value is None:
        return None
    role = value.decode(errors="replace").strip()
    return role if role in ROLES else None


async def request_role(client: EtcdSession, config: EtcdConfig, worker_id: str, role: str, lease_id: int) -> None:
    """Asks `worker_id` to switch to `role`; `lease_id` is the worker's membership lease."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    await client.put(role_key(config, worker_id).encode(), role.encode(), lease=lease_id or None)

"""The supervisor's state file: written atomically (a temporary file renamed over it), so a
reader never sees half of it."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_state(path: Path, state: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)


def read_state(path: Path) -> dict | None:
    """The last state written, or None when there is none (or it cannot be parsed)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None

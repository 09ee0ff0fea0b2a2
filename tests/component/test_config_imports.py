"""What loading the configuration imports, checked in a fresh interpreter (the test process
has imported everything already)."""

from __future__ import annotations


def test_loading_config_imports_no_kafka_client_nor_outbox():
    """A worker or the cache loads the root config without the router's hand-off machinery."""
    import subprocess
    import sys

    probe = (
        "import sys; from services.config import load_config; load_config(environ={}); "
        "print(sorted(m for m in sys.modules if 'kafka' in m or m.endswith(('outbox', 'handoff', 'degrader'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

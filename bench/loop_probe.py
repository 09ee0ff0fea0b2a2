"""How long a router's event loop was held, measured from outside: a separate process asks the
router something trivial (a grpc.health.v1 Check, or GET /v1/models) every few ms and writes
when each question went out and how long its answer took. The slowest answer in a window
bounds the longest the router's loop was held in it (plus the probe's own scheduling).

A process of its own, so the one sending the hostile request (serializing megabytes, parsing
answers) never delays the probe and reads as a router stall.

    with LoopProbe.grpc("127.0.0.1:50051") as probe:
        t0 = time.monotonic(); ...; t1 = time.monotonic()
        worst_s = probe.worst(t0, t1)

Run as a program it is the probe itself: `python -m bench.loop_probe grpc|http TARGET OUT`.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

INTERVAL_S = 0.005


class LoopProbe:
    """A running probe process and the file it writes."""

    def __init__(self, mode: str, target: str, headers: str = "") -> None:
        self.mode, self.target, self.headers = mode, target, headers
        self._dir = tempfile.TemporaryDirectory(prefix="loop-probe-")
        self.path = Path(self._dir.name) / "samples"
        self._process: subprocess.Popen | None = None

    @classmethod
    def grpc(cls, address: str) -> "LoopProbe":
        return cls("grpc", address)

    @classmethod
    def http(cls, models_url: str, api_key: str) -> "LoopProbe":
        return cls("http", models_url, api_key)

    def __enter__(self) -> "LoopProbe":
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.loop_probe", self.mode, self.target, str(self.path), self.headers],
            cwd=Path(__file__).resolve().parent.parent,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while len(self._samples()) < 3:  # connected and answering before anything is measured
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the loop probe did not start (exit {self._process.poll()})")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)
        self._dir.cleanup()

    def _samples(self) -> list[tuple[float, float]]:
        try:
            text = self.path.read_text()
        except OSError:
            return []
        samples = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2:
                samples.append((float(parts[0]), float(parts[1])))
        return samples

    def worst(self, start: float, end: float) -> float:
        """The slowest answer (s) to a question asked in [start, end] (time.monotonic), and to
        the first one asked after `end`, which a stall at the very end delays; waits for it."""
        deadline = time.monotonic() + 30
        while True:
            samples = self._samples()
            after = [latency for sent, latency in samples if sent > end]
            if after or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        during = [latency for sent, latency in samples if start <= sent <= end]
        # A question still unanswered when the window opened was held by the same stall.
        pending = [sent + latency - start for sent, latency in samples if sent < start < sent + latency]
        return max([*during, *after[:1], *pending, 0.0])


def _probe_grpc(address: str, out) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            sent = time.monotonic()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            out.write(f"{sent:.6f} {time.monotonic() - sent:.6f}\n")
            out.flush()
            time.sleep(INTERVAL_S)


def _probe_http(url: str, api_key: str, out) -> None:
    import httpx

    with httpx.Client(headers={"x-api-key": api_key}, timeout=30) as client:
        while True:
            sent = time.monotonic()
            client.get(url).raise_for_status()
            out.write(f"{sent:.6f} {time.monotonic() - sent:.6f}\n")
            out.flush()
            time.sleep(INTERVAL_S)


def main(argv: list[str]) -> int:
    mode, target, path = argv[:3]
    headers = argv[3] if len(argv) > 3 else ""
    with open(path, "w") as out:
        try:
            if mode == "grpc":
                _probe_grpc(target, out)
            else:
                _probe_http(target, headers, out)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

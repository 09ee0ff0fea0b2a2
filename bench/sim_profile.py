"""A timing profile for the simulated engine, fitted to a `bench/engines.py` result.

    python -m bench.sim_profile OUT.json [--result bench/results/engines.json] [--engine vllm]

The decode step is a line through the step times at 1, 4 and 16 streams; prefill is the time
to first token of one stream less one step. The profile records the result it came from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.worker.sim.profile import from_engines_result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--result", type=Path, default=Path("bench/results/engines.json"))
    parser.add_argument("--engine", default="vllm", choices=["vllm", "torch"])
    args = parser.parse_args(argv)
    profile = from_engines_result(json.loads(args.result.read_text()), args.engine)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    print(f"wrote {args.out}: {profile.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

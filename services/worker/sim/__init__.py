"""The simulated engine (`worker.engine: sim`): the engine protocol with a timing model
instead of a model, so a worker costs almost no CPU and many fit on one machine.

Modules:
  profile  the timing model (prefill per uncached token, decode step by batch and KV fill,
           slots, KV capacity, jitter), read from a JSON profile; `from_engines_result` makes
           one from a `bench/engines.py` result
  tokens   token ids drawn from (seed, prompt, absolute position): reproducible, resumable
  prefix   a per-tenant prefix cache of whole blocks, which shortens prefill
  engine   SimEngine itself
"""

from services.worker.sim.engine import SimEngine
from services.worker.sim.profile import SimProfile

__all__ = ["SimEngine", "SimProfile"]

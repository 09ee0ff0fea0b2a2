"""The simulated engine (`worker.engine: sim`): the engine protocol with a timing model
instead of a model, so a worker costs almost no CPU and many fit on one machine.

Modules:
  profile  the timing model (prefill per uncached token, decode step by batch and KV fill,
           slots, KV capacity, jitter), read from a JSON profile; `from_engines_result` makes
           one from a `bench/engines.py` result
  tokens   token ids drawn from (seed, prompt, absolute position): reproducible, resumable
  prefix   a per-tenant prefix cache of whole blocks, which shortens prefill
  engine   SimEngine itself
  faults   the fault knobs (fail after k tokens, hang, slow down, temperature, failing
           health, crash, slow start), set at start or through an etcd key
  control  applies the knobs to a running worker (engine, temperature, health, crash)
  host     several sim workers in one process, each its own gRPC server and etcd record
"""

from services.worker.sim.engine import SimEngine
from services.worker.sim.faults import SimFaults, SimFaultsError, faults_key
from services.worker.sim.profile import SimProfile

__all__ = ["SimEngine", "SimFaults", "SimFaultsError", "SimProfile", "faults_key"]

"""A process supervisor for the local mesh: starts child processes in order, restarts any that
dies (exponential backoff with a cap), and records each child's PID, restarts and last exit
reason in a state file.

Generic: it knows child specs (argv, environment, log file, readiness probe, restart policy),
not Ballast's services; `services/cli` builds the specs. It may import `services.common`, and
only `services/cli` imports it.
"""

from services.supervisor.exits import ExitReason
from services.supervisor.probes import GrpcHealthProbe
from services.supervisor.spec import ChildSpec, RestartPolicy
from services.supervisor.state import read_state, write_state
from services.supervisor.supervisor import Supervisor

__all__ = ["ChildSpec", "ExitReason", "GrpcHealthProbe", "RestartPolicy", "Supervisor", "read_state", "write_state"]

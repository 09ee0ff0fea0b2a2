"""What a caller may ask for better answers by: a ticket, or a session of its own tenant.

Checked the same way by the backfill service and by the router in front of it, so bad input
gets the same INVALID_ARGUMENT whichever is asked, even while the backfill is away.
"""

from __future__ import annotations

from ballast.v1 import backfill_pb2
from services.common.degraded.codec import valid_ticket
from services.common.errors import InvalidArgument

MAX_SESSION_CHARS = 128


def check_ticket(ticket: str) -> str:
    if not valid_ticket(ticket):
        raise InvalidArgument("ticket is not a backfill ticket (from Finished.backfill_ticket)")
    return ticket


def check_session(session_id: str) -> str:
    if len(session_id) > MAX_SESSION_CHARS or any(ord(c) < 32 for c in session_id):
        raise InvalidArgument(f"session_id must be at most {MAX_SESSION_CHARS} printable characters")
    return session_id


def subscription_target(request: backfill_pb2.SubscribeRequest) -> tuple[str, str]:
    """("ticket", ticket) or ("session_id", session id); InvalidArgument for anything else."""
    which = request.WhichOneof("target")
    if which == "ticket":
        return which, check_ticket(request.ticket)
    if which == "session_id" and request.session_id:
        return which, check_session(request.session_id)
    raise InvalidArgument("set session_id or ticket")

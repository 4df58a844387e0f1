"""A reply that a grid layer beneath the exchange refuses: handed on with its reason, never dropped.

A layer between the exchange and the SuperLink that cannot hand a reply on as the site sent it
(bulk_grid.py: references that do not resolve) marks it with `refuse` and returns it with the
others. The exchange records a marked reply as its site's failure (`<reason>: <detail>`) and counts
the reason run-wide, as it does for the refusals of its own checks. The mark is kept beside the
Python object, never in the message: nothing a site sends can carry one.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from flwr.app import Message

from federation.protocol.pipeline import UpdateRejected

_REFUSED: WeakKeyDictionary[Message, UpdateRejected] = WeakKeyDictionary()


def refuse(reply: Message, err: UpdateRejected) -> None:
    """Mark `reply` as refused beneath the exchange, for `err.reason` (a stable code)."""
    _REFUSED[reply] = err


def refusal(reply: Message) -> UpdateRejected | None:
    """Why a layer beneath the exchange refused `reply`, or None."""
    return _REFUSED.get(reply)

"""Flower's Grid with each message's small records packed into one object, both ways.

The ServerApp hands the Coordinator Flower's Grid inside this layer (server_app.py), so it lies
beneath everything the coordinator stacks on its grid (the SuperLink's retries, retry_grid.py; the
data path, bulk_grid.py): what is pushed leaves with its small records as one PACKED record
(protocol/record_pack.py), what is pulled comes back unpacked, and nothing above sees a pack. A push
packs the messages for as long as it takes and then gives each caller its own content back, so the
caller counts the bytes of the records it built (a retried push packs them again, to the same
content-addressed objects). A reply whose pack does not decode is handed on marked refused
(refused_reply.py, `pack_unreadable`): its site's failure, counted, the round goes on. Grids that
stand in for the SuperLink and its sites in one process (ops/inprocess.py, tests) move no Flower
objects and are used without it; a site answers a message that came unpacked unpacked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Message

from federation.coordinator.refused_reply import refuse
from federation.protocol.record_pack import PackError, pack, unpack


class PackGrid:
    """A Grid whose messages carry their small records as one Flower object, both ways."""

    def __init__(self, grid: Any):
        self.inner = grid

    def __getattr__(self, name: str) -> Any:  # get_node_ids, run, create_message, ...: as the inner Grid has them
        return getattr(self.inner, name)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Grid.push_messages, each message packed while it is pushed."""
        msgs = list(messages)
        own = [m.content if m.has_content() else None for m in msgs]
        for m, rd in zip(msgs, own):
            if rd is not None:
                m.content = pack(rd)
        try:
            return list(self.inner.push_messages(msgs))
        finally:
            for m, rd in zip(msgs, own):
                if rd is not None:
                    m.content = rd

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        """Grid.pull_messages, each reply unpacked (or marked refused when its pack does not decode)."""
        replies = list(self.inner.pull_messages(message_ids))
        for reply in replies:
            if reply.has_content():
                try:
                    reply.content = unpack(reply.content)
                except PackError as err:
                    refuse(reply, err)
        return replies

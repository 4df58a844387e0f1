"""Flower's Grid with the bulk data path beneath it: large Arrays leave on push, come back on pull.

The exchange and the round strategies build and read messages with their Arrays in place; this
layer between them and the SuperLink does the data path's part (bulk_path.py):
- push: each message to a site on the data path has its large Arrays replaced by references to a
  blob the data path's server offers (`BulkPath.outgoing`); the message's content is replaced in
  place, as Flower's Grid stamps the metadata of what it pushes, so the caller counts the bytes of
  what actually went out (`payload_records.sent_bytes`).
- pull: each reply's references are resolved from what its site uploaded (`BulkPath.incoming`). A
  reply whose references cannot be resolved is handed on marked refused (refused_reply.py) with
  its `bulk_<code>`: the exchange records it as that site's failure and counts the code.
- `stage_over` (the exchange: a stage's messages are answered or expired): the stage's offers are
  withdrawn; `replies_folded` (the exchange: the stage's replies are aggregated): the uploads'
  files are released.

It sits above the retrying grid (retry_grid.py): a message is offloaded and a reply resolved once,
whatever the SuperLink calls cost in retries, and a retried push sends the very messages of the
first attempt (the same references, so the same content-addressed ids).

`site_name(node)`: the name a node goes by (node-<id> before discovery: its uploads match no
site); `known_name(node)`: that name, None before discovery (a message to it stays whole).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Message

from federation.coordinator.bulk_path import BulkPath
from federation.coordinator.refused_reply import refuse
from federation.protocol.bulk import BulkRefused


class BulkGrid:
    """A Grid whose messages carry their large Arrays on the data path, both ways."""

    def __init__(self, grid: Any, path: BulkPath, site_name: Callable[[int], str],
                 known_name: Callable[[int], str | None]):
        self.inner, self.path = grid, path
        self.site_name, self.known_name = site_name, known_name

    def __getattr__(self, name: str) -> Any:  # get_node_ids, run, create_message, ...: as the inner Grid has them
        return getattr(self.inner, name)

    def outgoing(self, message: Message) -> None:
        """`message` as it goes to its site: its large Arrays as references if the site is direct."""
        if message.has_content():
            message.content = self.path.outgoing(self.known_name(message.metadata.dst_node_id), message.content)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Grid.push_messages, each message's large Arrays offloaded first (`outgoing`)."""
        msgs = list(messages)
        for m in msgs:
            self.outgoing(m)
        return list(self.inner.push_messages(msgs))

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        """Grid.pull_messages, each reply's references resolved (or the reply marked refused)."""
        replies = list(self.inner.pull_messages(message_ids))
        for reply in replies:
            try:
                self.path.incoming(self.site_name(reply.metadata.src_node_id), reply)
            except BulkRefused as err:
                refuse(reply, err)
        return replies

    def stage_over(self) -> None:
        """A stage's messages are answered or expired: stop serving their model."""
        self.path.stage_over()

    def replies_folded(self) -> None:
        """A stage's replies are folded into its aggregate: their uploads' files go."""
        self.path.server.release_all()

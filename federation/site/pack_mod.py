"""The outermost mod: a message's PACKED record unpacked before any mod reads it, the reply packed
after every mod wrote it (protocol/record_pack.py: its small records as one Flower object on
their way back through the SuperNode and the SuperLink).

The reply is packed when its message came packed: a coordinator that packs unpacks
(coordinator/pack_grid.py), and one that sent its records as they are (an in-process grid, a
test) reads the reply's the same way. A message whose pack does not decode is answered with the
site's failure (`pack_unreadable` and why), which the coordinator logs and counts; the handler and
its mods never see it.
"""

from __future__ import annotations

from flwr.app import Context, Message

from federation.protocol import message_keys as keys
from federation.protocol.record_pack import PackError, pack, unpack
from federation.site.replies import fail


def pack_mod(msg: Message, context: Context, call_next) -> Message:
    """Unpack `msg`, handle it, pack the reply if `msg` came packed."""
    packed = msg.has_content() and keys.PACKED in msg.content
    if packed:
        try:
            msg.content = unpack(msg.content)
        except PackError as err:
            return fail(msg, str(context.node_config.get("site-id", "?")), str(err))
    reply = call_next(msg, context)
    if packed and reply.has_content():
        cost = reply.content.metric_records.get(keys.MSG_COST)
        if cost is not None:
            cost["packed"] = 1.0  # the coordinator's split says which messages came packed
        reply.content = pack(reply.content)
    return reply

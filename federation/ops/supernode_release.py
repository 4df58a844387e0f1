"""Free a SIGKILLed SuperNode's key at the SuperLink, so that its restart is admitted at once.

A SuperNode that dies without deactivating stays "online" at the SuperLink until its heartbeat
expires (flwr 1.41: 2 x 30 s), and until then the SuperLink refuses to activate the same key again.
The site still holds that key, so it can say what the dead process could not: a signed
DeactivateNode for the node id the SuperNode logged when it connected. Through Flower's own Fleet
client and node-auth signing; nothing of Flower is changed.
"""

from __future__ import annotations

import re
from pathlib import Path

NODE_ID = re.compile(r"SuperNode ID: (\d+)")


def logged_node_id(log: Path, since: int = 0) -> int | None:
    """The node id the SuperNode's last connection logged at or after byte `since` of `log` (where
    one process's output starts, when restarts append to the same file), if any."""
    try:
        with open(log, "rb") as f:
            f.seek(since)
            ids = NODE_ID.findall(f.read().decode(errors="replace"))
    except OSError:
        return None
    return int(ids[-1]) if ids else None


def release(superlink: str, bundle: Path, node_id: int) -> str | None:
    """Deactivate `node_id` at `superlink` signed with the bundle's SuperNode key; None on success,
    else why not (the caller then waits for the heartbeat to expire)."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.proto.fleet_pb2 import DeactivateNodeRequest  # pylint: disable=E0611
    from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
    from flwr.supernode.fleet_http_client import FleetHttpClient
    from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

    try:
        key = load_ssh_private_key((bundle / "supernode_auth.key").read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            return "the bundle's SuperNode key is not an EC key"
        interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperNode"),
                        NodeAuthHttpInterceptor(key, key.public_key())]
        with FleetHttpClient.from_server_address(superlink, False, str(bundle / "ca.crt"), interceptors) as client:
            client.DeactivateNode(DeactivateNodeRequest(node_id=node_id))  # the client's own 30 s deadline
    except Exception as err:  # noqa: BLE001 - any failure means: wait for the heartbeat to expire
        return f"{type(err).__name__}: {err}"
    return None

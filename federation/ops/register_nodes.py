"""Admit the sites' SuperNode keys at the SuperLink, every site in one process.

`flwr supernode register KEY CONNECTION` admits one key per process, and the process's start-up
(Flower's CLI imports), not the SuperLink, is most of its cost: N sites would pay it N times, on
the cores where their trainers are loading. `python -m federation.ops.register_nodes CONNECTION
SITE=KEY...` makes the same Control API request for every site, from one process over one client:
the key is read and checked by the CLI's own `try_load_public_key`, the connection (address, TLS,
account auth) by its own `read_superlink_connection` and `init_http_client_from_connection`, from
FLWR_HOME as `flwr` reads it, and a refusal is worded by its `flwr_cli_exc_handler`.

It prints one line per site: `ok SITE NODE_ID`, `known SITE` (the key is registered already: a
restarted SuperLink keeps its database, and the keys in it) or `failed SITE: why`; the exit code is
1 when any site failed. The flwr CLI internals it uses are imported here only; a flwr that moved
one fails at once with a message naming it.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

try:
    from flwr.cli.flower_config import read_superlink_connection
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.cli.utils import flwr_cli_exc_handler, init_http_client_from_connection
    from flwr.proto.control_pb2 import RegisterNodeRequest
except ImportError as _err:
    raise SystemExit(f"register_nodes: flwr {version('flwr')} no longer has a CLI internal this module uses "
                     f"({_err}); federation/ops/register_nodes.py must be adapted to it") from _err

KNOWN = "already in use"  # the SuperLink's answer for a key it has registered


def parse_sites(args: list[str]) -> dict[str, Path]:
    """SITE=KEY arguments -> {site: key path}."""
    sites = {}
    for arg in args:
        site, sep, key = arg.partition("=")
        if not sep or not site or not key:
            raise SystemExit(f"register_nodes: expected SITE=KEY_PATH, got {arg!r}")
        sites[site] = Path(key)
    return sites


def register_all(client, keys: dict[str, bytes]) -> list[str]:
    """One `RegisterNode` per site over `client`; one result line per site (module docstring)."""
    lines = []
    for site, key in keys.items():
        try:
            with flwr_cli_exc_handler():  # the SuperLink's refusal as the CLI words it
                reply = client.RegisterNode(request=RegisterNodeRequest(public_key=key, name=site))
        except Exception as err:  # noqa: BLE001 - a refusal or a transport error, per site
            detail = getattr(err, "message", None) or str(err)
            lines.append(f"known {site}" if KNOWN in detail else f"failed {site}: {detail}")
            continue
        lines.append(f"ok {site} {reply.node_id}" if reply.node_id else f"failed {site}: the SuperLink gave no node id")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Register every SITE=KEY at the CONNECTION's SuperLink; 1 if any site failed, 2 on bad usage."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m federation.ops.register_nodes CONNECTION SITE=KEY_PATH...", file=sys.stderr)
        return 2
    connection, sites = args[0], parse_sites(args[1:])
    keys, lines = {}, []
    for site, path in sites.items():
        try:
            keys[site] = try_load_public_key(path.expanduser())
        except (Exception, SystemExit) as err:  # noqa: BLE001 - the CLI exits on a key it cannot use
            lines.append(f"failed {site}: {path} is not a usable SuperNode public key ({err})")
    client = init_http_client_from_connection(read_superlink_connection(connection))
    try:
        lines += register_all(client, keys)
    finally:
        client.close()
    print("\n".join(lines), flush=True)
    return 1 if any(line.startswith("failed ") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The trainer's local endpoint: gRPC over a Unix domain socket, JSON messages, no torch.

Rank 0 serves it; the Flower relay (one short-lived process per message) calls it. Only small
JSON headers cross the socket; tensors travel through `handoff` files. Generic handlers keep this
free of generated protobuf code. Every call has a deadline.
"""

from __future__ import annotations

import json
import os
import socket
from concurrent import futures
from typing import Any, Callable

import grpc

SERVICE = "sovfl.SiteTrainer"
METHODS = ("Info", "Train", "Evaluate", "Export", "Stop")
MAX_SOCKET_PATH = 107  # sun_path limit on Linux, less the terminating NUL


class TrainerUnavailable(RuntimeError):
    """The trainer service cannot be reached or did not answer in time."""


class TrainerError(RuntimeError):
    """The trainer service answered with an error."""


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _decode(data: bytes) -> Any:
    return json.loads(data.decode())


def check_socket_path(path: str) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"trainer socket path is {len(os.fsencode(path))} bytes, over the {MAX_SOCKET_PATH}-byte "
            f"Unix socket limit: {path!r}; choose a shorter workdir"
        )


def serve(socket_path: str, handler: Callable[[str, dict], dict], workers: int = 4) -> grpc.Server:
    """Start serving `handler(method, request) -> reply` on `socket_path`; returns the server."""
    check_socket_path(socket_path)
    if os.path.exists(socket_path):
        os.unlink(socket_path)  # a stale socket from a killed run

    def bind(method: str):
        def call(request: dict, context: grpc.ServicerContext) -> dict:
            return handler(method, request)
        return grpc.unary_unary_rpc_method_handler(call, request_deserializer=_decode, response_serializer=_encode)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {m: bind(m) for m in METHODS})])
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    os.chmod(socket_path, 0o600)
    return server


def _diagnose(socket_path: str) -> str:
    """Why a call could not be made, in the operator's terms: gRPC says UNAVAILABLE both when no
    trainer listens and when a stopped or wedged one accepts the connection but never completes
    the handshake (after its 20 s connect timeout); a plain connect tells the two apart."""
    if not os.path.exists(socket_path):
        return "no socket there: is the site trainer service running?"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(socket_path)
    except OSError as err:
        return f"nothing accepts connections there ({err.strerror or err}): the trainer exited; is it being restarted?"
    finally:
        probe.close()
    return ("the trainer accepted the connection but did not answer (stopped, hung or overloaded); "
            "check the site's trainer log")


def call(socket_path: str, method: str, request: dict, timeout_s: float) -> dict:
    """One request to the trainer; raises TrainerUnavailable / TrainerError with the site's words."""
    if method not in METHODS:
        raise ValueError(f"unknown trainer method {method!r}; one of {METHODS}")
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        stub = channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=_encode, response_deserializer=_decode)
        try:
            reply = stub(request, timeout=timeout_s, wait_for_ready=False)
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TrainerUnavailable(f"trainer at {socket_path} did not answer {method} within {timeout_s:.0f}s") from None
            raise TrainerUnavailable(
                f"trainer at {socket_path} unreachable for {method} ({code.name if code else err}): "
                f"{_diagnose(socket_path)}"
            ) from None
    if not reply.get("ok", False):
        raise TrainerError(reply.get("error", "trainer reported an unspecified error"))
    return reply

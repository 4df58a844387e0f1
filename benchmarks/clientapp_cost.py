"""Per-message cost of our ClientApp process against a minimal flwr + NumPy ClientApp.

A SuperNode starts one `flwr-clientapp` process per message; what that process spends before,
in and after the ClientApp's handler is paid on every round trip. This script runs, per message,
a fresh Python process that does what Flower's `flwr-clientapp` does with the message (it imports
flwr's ClientApp runtime, loads the app through Flower's own loader from its `module:attr`
reference, deserializes the message and context from protobuf, calls the app, serializes the
reply and the context), for two apps side by side in one run:

- ours: `federation.site.client_app:app` (the reference the FAB names), every protection on: a
  real `Coordinator` with SecAgg+ (ring auto-chosen), attested admission (dev issuer), evaluation
  at the start of train and a provisioned PKI drives 3 sites whose messages each go through such
  a process; the site's trainer is the real endpoint (gRPC over a Unix socket, tensors in
  hand-off files) answered by NumPy in this process, so the trainer's compute is not counted;
- Flower: benchmarks/flower_fedavg_app's NumPy ClientApp, on train and evaluate messages with the
  same model shapes (what Flower's FedAvg sends).

Per process: wall from spawn to exit and CPU (user + sys, from the child's rusage), and inside it
the time to import flwr's runtime, to load the app, and the handler's wall and CPU. Rounds 2
onwards are kept (round 1 also carries site discovery). `--profile DIR` writes a cProfile of each
of our handlers there.

    .venv/bin/python benchmarks/clientapp_cost.py [--rounds 4] [--sites 3] [--hidden 64]

Last line: `RESULT ours_msg_wall_s=<median> flower_msg_wall_s=<median> wall_ratio=<ours/flower>
ours_msg_cpu_s=<median> flower_msg_cpu_s=<median> cpu_ratio=<ours/flower>`
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = "federation.site.client_app:app"
FLOWER = "benchmarks.flower_fedavg_app.fedavg_anchor:client"


def worker(job: Path, app_ref: str, profile: str) -> None:
    """One ClientApp process: the message in `job`/msg.pb, the context in `job`/ctx.pb."""
    t0 = time.perf_counter()
    import flwr.supernode.runtime.run_clientapp  # noqa: F401  (Flower's ClientApp process module)
    from flwr.clientapp.utils import get_load_client_app_fn
    from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
    from flwr.proto.message_pb2 import Context as ProtoContext
    from flwr.proto.message_pb2 import Message as ProtoMessage

    t1 = time.perf_counter()
    app = get_load_client_app_fn(default_app_ref=app_ref, app_path=None, multi_app=False)("", "", "")
    t2 = time.perf_counter()
    msg = message_from_proto(ProtoMessage.FromString((job / "msg.pb").read_bytes()))
    ctx = context_from_proto(ProtoContext.FromString((job / "ctx.pb").read_bytes()))
    w0, c0 = time.perf_counter(), time.process_time()
    if profile:
        import cProfile

        prof = cProfile.Profile()
        reply = prof.runcall(app, msg, ctx)
        prof.dump_stats(profile)
    else:
        reply = app(msg, ctx)
    w1, c1 = time.perf_counter(), time.process_time()
    (job / "reply.pb").write_bytes(message_to_proto(reply).SerializeToString())
    (job / "ctx.pb").write_bytes(context_to_proto(ctx).SerializeToString())
    (job / "timing.json").write_text(json.dumps({"flwr_import_s": t1 - t0, "app_load_s": t2 - t1,
                                                 "handler_s": w1 - w0, "handler_cpu_s": c1 - c0}))


class ProcessRunner:
    """Runs each message through a fresh worker process; keeps what each one cost."""

    def __init__(self, app_ref: str, workdir: Path, profile_dir: Path | None = None):
        self.app_ref, self.dir, self.profile_dir = app_ref, workdir, profile_dir
        self.records: list[dict] = []
        self.round = 0

    def handle(self, msg, ctx_proto):
        """(reply, new context proto) for `msg`, handled in a fresh process."""
        from flwr.common.serde import message_from_proto, message_to_proto
        from flwr.proto.message_pb2 import Context as ProtoContext
        from flwr.proto.message_pb2 import Message as ProtoMessage

        job = Path(tempfile.mkdtemp(dir=self.dir))
        (job / "msg.pb").write_bytes(message_to_proto(msg).SerializeToString())
        (job / "ctx.pb").write_bytes(ctx_proto.SerializeToString())
        n = len(self.records)
        profile = str(self.profile_dir / f"{n:03d}-{msg.metadata.message_type}.prof") if self.profile_dir else ""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--worker", str(job), self.app_ref, profile], env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed for {msg.metadata.message_type}: {proc.stderr[-3000:]}")
        rec = json.loads((job / "timing.json").read_text())
        rec.update(kind=msg.metadata.message_type, round=self.round, wall_s=wall,
                   cpu_s=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        self.records.append(rec)
        reply = message_from_proto(ProtoMessage.FromString((job / "reply.pb").read_bytes()))
        return reply, ProtoContext.FromString((job / "ctx.pb").read_bytes())


def numpy_service(workdir: Path, socket: str, shapes: dict):
    """The site trainer service's endpoint, answered by NumPy (the trainer's compute is not ours)."""
    import numpy as np

    from site_trainer import endpoint, handoff

    rng = np.random.default_rng(abs(hash(socket)) % 2**32)

    def handle(method: str, req: dict) -> dict:
        if method == "Info":
            return {"ok": True, "num_examples": 100, "ranks": 1, "workdir": str(workdir)}
        if method == "Train":
            upd = {k: (rng.normal(size=s) * 0.01).astype(np.float32) for k, s in shapes.items()}
            h = handoff.write_arrays(upd, tag="update", directory=workdir)
            return {"ok": True, "update": h.to_json(), "num_examples": 100, "metrics": {"train_loss": 1.0},
                    "rank_digests": ["0" * 64]}
        if method == "Evaluate":
            return {"ok": True, "num_examples": 50, "metrics": {"eval_loss": 1.0, "eval_accuracy": 0.5, "num_val_examples": 50},
                    "rank_digests": ["0" * 64]}
        return {"ok": False, "error": f"unexpected method {method}"}

    workdir.mkdir(parents=True, exist_ok=True)
    return endpoint.serve(socket, handle)


def run_ours(tmp: Path, sites: int, rounds: int, shapes: dict, profile_dir: Path | None) -> list[dict]:
    """A real Coordinator with every protection on; each message handled by a fresh process."""
    import numpy as np

    from crypto.pki import CoordinatorBundle, provision
    from federation.config import resolve
    from federation.config.schema import parse_config
    from federation.coordinator.driver import Coordinator
    from federation.ops.inprocess import InProcessGrid, InProcessSite, task_identity

    names = [f"site{i}" for i in range(sites)]
    cfg = parse_config({
        "federation": {"name": "clientapp-cost", "rounds": rounds, "quorum": max(2, sites - 1),
                       "update_kind": "delta", "evaluate": True,
                       "deadlines": {"connect_s": 60, "round_s": 120, "evaluate_s": 120, "secagg_stage_s": 60},
                       "secagg": {"enabled": True, "threshold": 2, "clip": 0.5},
                       "attestation": {"enabled": True, "dev_issuer": True}},
        "sites": [{"id": s, "partition": i} for i, s in enumerate(names)],
    })
    pki = tmp / "pki"
    provision(pki, names)
    att = resolve(cfg.federation.attestation, pki / "dev-attestation-issuer", create=True)
    cfg = cfg.model_copy(update={"federation": cfg.federation.model_copy(update={"attestation": att})})
    runner = ProcessRunner(OURS, tmp / "jobs", profile_dir)
    servers, site_objs = [], []
    for i, name in enumerate(names):
        socket = str(tmp / f"{name}.sock")
        servers.append(numpy_service(tmp / "sites" / name / "work", socket, shapes))
        att_path = tmp / "sites" / name / "attestation.json"
        att_path.write_text(att.for_site(name).model_dump_json())
        site = InProcessSite(name, 1000 + i, None, {"trainer-socket": socket, "bundle-dir": str(pki / "sites" / name),
                                                    "attestation-config": str(att_path)}, run_id=RUN_ID)

        def handle(msg, site=site):
            reply, site.context = runner.handle(msg, site.context)
            return reply

        site.handle = handle
        site_objs.append(site)
    (tmp / "jobs").mkdir()
    initial = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    try:
        with task_identity(RUN_ID):
            coord = Coordinator(InProcessGrid(site_objs, RUN_ID), cfg, tmp / "coord", RUN_ID, initial,
                                lambda line: None, CoordinatorBundle.load(pki / "coordinator"))
            coord.wait_for_sites()
            for rnd in range(1, rounds + 1):
                runner.round = rnd
                line = coord.train_round(rnd)
                if line["status"] != "aggregated":
                    raise RuntimeError(f"round {rnd} of ours did not aggregate: {json.dumps(line)[:2000]}")
    finally:
        for s in servers:
            s.stop(0)
    return runner.records


def run_flower(tmp: Path, sites: int, rounds: int, shapes: dict) -> list[dict]:
    """Flower's minimal NumPy ClientApp on FedAvg's train and evaluate messages, same shapes."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.common.serde import context_to_proto

    from federation.ops.inprocess import task_identity, wire

    runner = ProcessRunner(FLOWER, tmp / "jobs-flower")
    (tmp / "jobs-flower").mkdir(parents=True)
    contexts = [context_to_proto(Context(run_id=RUN_ID, node_id=1000 + i, node_config={}, state=RecordDict(),
                                         run_config={})) for i in range(sites)]
    arrays = ArrayRecord({k: Array(np.zeros(s, np.float32)) for k, s in shapes.items()})
    with task_identity(RUN_ID):
        for rnd in range(1, rounds + 1):
            runner.round = rnd
            for kind in ("train", "evaluate"):
                for i in range(sites):
                    msg = Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": rnd})}),
                                  dst_node_id=1000 + i, message_type=kind, ttl=60)
                    msg.metadata.__dict__["_message_id"] = f"{kind}-{rnd}-{i}"
                    _, contexts[i] = runner.handle(wire(msg), contexts[i])
    return runner.records


RUN_ID = 77
FIELDS = ("wall_s", "cpu_s", "flwr_import_s", "app_load_s", "handler_s", "handler_cpu_s")


def summary(records: list[dict]) -> dict[str, float]:
    """Medians of each field over the messages of rounds 2 onwards."""
    kept = [r for r in records if r["round"] >= 2] or records
    return {f: statistics.median(r[f] for r in kept) for f in FIELDS} | {"messages": len(kept)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--profile", type=Path, default=None, help="write a cProfile of each of our handlers here")
    args = ap.parse_args()
    shapes = {"fc1.weight": (args.hidden, 64), "fc1.bias": (args.hidden,), "fc2.weight": (10, args.hidden),
              "fc2.bias": (10,)}
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    from federation.ops.bytecode import ensure_compiled

    ensure_compiled()  # as the launcher does before it starts a federation's processes
    print(f"load: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="sovfl-cac-") as tmp:
        ours = run_ours(Path(tmp) / "ours", args.sites, args.rounds, shapes, args.profile)
        flower = run_flower(Path(tmp) / "flower", args.sites, args.rounds, shapes)
    for name, recs in (("ours", ours), ("flower", flower)):
        kinds = sorted({r["kind"] for r in recs})
        for kind in [None, *kinds]:
            s = summary([r for r in recs if kind is None or r["kind"] == kind])
            print(f"{name:7s} {kind or 'all':9s} " + " ".join(f"{k}={v:.3f}" for k, v in s.items() if k != "messages")
                  + f" messages={s['messages']}", flush=True)
    o, f = summary(ours), summary(flower)
    print(f"load: {os.getloadavg()}")
    print(f"RESULT ours_msg_wall_s={o['wall_s']:.3f} flower_msg_wall_s={f['wall_s']:.3f} "
          f"wall_ratio={o['wall_s'] / f['wall_s']:.2f} ours_msg_cpu_s={o['cpu_s']:.3f} "
          f"flower_msg_cpu_s={f['cpu_s']:.3f} cpu_ratio={o['cpu_s'] / f['cpu_s']:.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(ROOT))
        worker(Path(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        sys.path.insert(0, str(ROOT))
        main()

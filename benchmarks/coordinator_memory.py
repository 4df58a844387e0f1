"""The coordinator's peak memory for one round at size, on its real code paths, without the rest of
a federation (target: coordinator_peak_ratio <= 1.5).

Sealed round: two sites' updates of P float32 parameters are sealed with really provisioned keys
and written as the data path stores an upload (the .npy bytes of the envelope body,
WORKDIR/bulk-like files). Then, in a fresh process per measurement, the coordinator builds the
round's train message to two sites on the data path (Coordinator.model_message, then the grid's
push, bulk_grid.py: the model written into the offer file tensor by tensor), and its code takes the updates as a reply
resolved from the data path does (a read-only map of the file: bulk_server.take, bulk.resolve),
and runs PlainRound.receive_update for each, PlainRound.finish and ServerOptimizer.step (FedAvg,
delta, consume, in place) on a P-parameter global model: what the ServerApp's driver calls. The
process's peak RSS (VmHWM) above what it held before the model was made, over P x 4 bytes, is the
ratio.

`--path inmemory` measures the previous path for comparison (the model serialized whole, then
offloaded and spilled; open_envelope into memory, the float64 WeightedMean, the dense step), from
the same files.

`--secagg` also measures a SecAgg+ round's coordinator side (`measure_secagg`: the crypto
server's ring with two real clients masking into it, the sum decoded into the ring, FedAvg's
step), with the model on disk while the ring exists (model_spill.py) and, for comparison, in
memory beside it.

    python benchmarks/coordinator_memory.py --params 101000000 --secagg
Last line: RESULT params=<P> coordinator_peak_ratio=<..> inmemory_ratio=<..> secagg_peak_ratio=<..> secagg_inmemory_ratio=<..>
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


def spec_of(params: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A transformer-like layout: one large embedding, a few blocks of matrices, small vectors."""
    emb = params // 4 // 1024 * 1024
    rest = params - emb
    spec = {"embed": ("<f4", (emb // 1024, 1024))}
    for i in range(6):
        n = rest // 6 // 1024 * 1024
        spec[f"block{i}.w"] = ("<f4", (n // 1024, 1024))
    spec["final.b"] = ("<f4", (params - sum(int(np.prod(s)) for _, s in spec.values()),))
    return spec


def vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def make_update(work: Path, site: str, params: int, seed: int) -> None:
    """A site's sealed update, stored as the data path stores an upload."""
    from crypto.pki import SiteBundle
    from federation.protocol.envelope_layout import as_payload
    from federation.protocol.payload_records import to_array
    from federation.protocol.pipeline import Payload, RoundContext
    from federation.site.protection_mod import SiteProtection

    rng = np.random.default_rng(seed)
    arrays = {k: rng.standard_normal(s, dtype=np.float32) * 1e-3 for k, (_, s) in spec_of(params).items()}
    fed = json.loads((work / "ctx.json").read_text())["federation"]
    wire = SiteProtection(SiteBundle.load(work / "pki" / "sites" / site), True).encode(
        Payload(arrays, {}), RoundContext(fed, 1, 1, site))
    del arrays
    arr = to_array(wire.arrays["envelope"])
    (work / f"{site}.npy").write_bytes(arr.data)
    (work / f"{site}.meta").write_bytes(json.dumps({k: v.hex() for k, v in wire.meta.items()}).encode())


def measure(work: Path, params: int, path: str) -> dict:
    """One coordinator round over the stored uploads; peak RSS figures."""
    import mmap

    from crypto.envelope import ReplayGuard
    from crypto.pki import CoordinatorBundle
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

    from federation.config.schema import FederationConfig
    from federation.coordinator.aggregate import ServerOptimizer, WeightedMean
    from federation.coordinator.envelope_opener import CoordinatorProtection
    from federation.coordinator.plain_round import PlainRound
    from federation.coordinator.strategy import Reply, RoundInput
    from federation.ops.inprocess import task_identity
    from federation.protocol import message_keys as keys
    from federation.protocol.malloc_policy import return_freed_tensors
    from federation.protocol.payload_records import from_records
    from federation.protocol.pipeline import RoundContext

    import federation.coordinator.driver  # noqa: F401 (the ServerApp's imports, before the baseline)

    return_freed_tensors()  # as the ServerApp does
    spec = spec_of(params)
    coord = CoordinatorBundle.load(work / "pki" / "coordinator")
    fed_cfg = FederationConfig.model_validate({"name": "m", "seal": True})
    ctx = RoundContext(coord.federation_id, 1, 1, "")
    base = vm("VmRSS")
    model = {k: np.full(s, 0.5, np.float32) for k, (_, s) in spec.items()}

    def reply(site: str, node: int) -> Reply:
        f = open(work / f"{site}.npy", "rb")
        data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        f.close()
        meta = {k: bytes.fromhex(v) for k, v in json.loads((work / f"{site}.meta").read_text()).items()}
        n = len(data) - 128  # the .npy header to_array writes is 128 bytes here
        with task_identity(1):
            rd = RecordDict({keys.UPDATE: ArrayRecord({"envelope": Array(np.zeros(0, np.uint8))}),
                             keys.UPDATE_META: ConfigRecord(meta),
                             keys.STATUS: ConfigRecord({"site": site, "ok": True, "num_examples": 10 + node})})
            arr = Array(dtype="uint8", shape=(int(n),), stype="numpy.ndarray", data=b"")
            arr.data = data  # as bulk.resolve puts a resolved reference back: a view of the map
            rd.array_records[keys.UPDATE]["envelope"] = arr
            return Reply(site, node, Message(rd, dst_node_id=node, message_type="train"))

    t0 = time.monotonic()
    model_message(work, model, streamed=path == "streamed")
    print(f"model message {time.monotonic() - t0:.1f} s, peak so far {(vm('VmHWM') - base) / (params * 4):.2f} x",
          file=sys.stderr)
    t0 = time.monotonic()
    opt = ServerOptimizer("fedavg", "delta", 1.0)
    if path == "streamed":
        rnd = PlainRound(fed_cfg, coord, ReplayGuard(), spill_dir=work / "spill")
        inp = RoundInput(ctx, [1, 2], {}, model, spec, lambda d: (lambda node: RecordDict()), print)
        st = rnd.begin(inp)
        for i, site in enumerate(("site0", "site1")):
            r = reply(site, i + 1)
            rnd.receive_update(st, r)
            del r
        out = rnd.finish(st)
        assert out.count == 2 and not out.rejections, out.failed
        t1 = time.monotonic()
        model = opt.step(model, out.mean, consume=True, in_place=True)  # as the driver does
        print(f"receive {t1 - t0:.1f} s, fold and step {time.monotonic() - t1:.1f} s", file=sys.stderr)
    else:  # the previous path: whole plaintext in memory, float64 sum, dense step
        prot = CoordinatorProtection(coord, True, ReplayGuard())
        mean = WeightedMean()
        for i, site in enumerate(("site0", "site1")):
            r = reply(site, i + 1)
            payload = prot.decode(from_records(r.message.content, keys.UPDATE, keys.UPDATE_META, copy=False),
                                  ctx.for_site(site))
            mean.add(payload.arrays, 10 + i + 1)
            del payload, r
        model = opt.step(model, mean.result(), consume=True)
    seconds = time.monotonic() - t0
    peak = vm("VmHWM")
    return {"path": path, "params": params, "base_rss": base, "peak_rss": peak, "seconds": round(seconds, 1),
            "ratio": (peak - base) / (params * 4), "checksum": float(sum(float(v.reshape(-1)[:1000].sum()) for v in model.values()))}


def model_message(work: Path, model: dict, streamed: bool) -> None:
    """The round's train message to two sites on the data path, as the driver builds and offloads
    it (Coordinator.model_message, the exchange's message, then the grid's push: bulk_grid.py).
    `streamed`: the model written into the offer file tensor by tensor (bulk_path.offer_arrays);
    else the previous path: serialized whole (what a site reached through Flower gets), then
    offloaded and spilled."""
    import socket

    from crypto.pki import CoordinatorBundle
    from flwr.app import ConfigRecord

    from federation.config.schema import ExperimentConfig
    from federation.coordinator.bulk_grid import BulkGrid
    from federation.coordinator.bulk_server import BulkServer
    from federation.coordinator.driver import Coordinator
    from federation.coordinator.strategy import Site
    from federation.ops.inprocess import task_identity

    bundle = CoordinatorBundle.load(work / "pki" / "coordinator")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = BulkServer(bundle, work / "coord", f"127.0.0.1:{port}")
    cfg = ExperimentConfig.model_validate({"federation": {"name": "m", "rounds": 1, "quorum": 1, "evaluate": False},
                                           "sites": [{"id": "site0", "partition": 0}, {"id": "site1", "partition": 1}]})
    coord = Coordinator(None, cfg, work / "coord", 1, model, lambda line: None, bundle, bulk=server)
    for node, site in ((1, "site0"), (2, "site1")):
        coord.sites[node] = Site(node, site, 10)
        coord.bulk.heard(site, ConfigRecord({"data_path": "direct" if streamed else "flower: the previous path"}))
    with task_identity(1):
        message = coord.model_message(1, 30.0)
        built = [message(node) for node in (1, 2)]
        if not streamed:  # the sites are direct: the whole records are offloaded as the previous driver did
            for site in ("site0", "site1"):
                coord.bulk.paths[site] = "direct"
        sent = [coord.messaging.message(node, rd, "train", 30.0, [])[0] for node, rd in zip((1, 2), built)]
        for m in sent:  # as the grid pushes them (bulk_grid.py): large Arrays offloaded
            BulkGrid(None, coord.bulk, coord.site_name, coord.known_name).outgoing(m)
    del built, sent, message
    coord.downlink.forget_stage()
    coord.bulk.stage_over()
    server.stop()


def measure_secagg(work: Path, params: int, spill: bool) -> dict:
    """A SecAgg+ round's coordinator side at size, on its real code paths: the crypto server's ring
    (SecAggServer, two real clients masking their updates chunk by chunk into it), the unmasked
    sum decoded into the ring's own words (secagg_round.in_ring_mean) and FedAvg's step. `spill`:
    the model goes to disk before the first masked chunk is added, as SecAggRound does once the train
    messages are built, and the
    step writes the new model into the ring (model_spill.py); else the model stays in memory
    beside the ring (the previous path). The sites' updates are read from files whose pages are
    dropped as the clients read them, so the process's peak is the coordinator's."""
    import mmap

    from crypto.secagg import SecAggClient, SecAggConfig, SecAggServer, new_context
    from crypto.secagg.simulation import make_plan

    from federation.coordinator.aggregate import ServerOptimizer
    from federation.coordinator.model_spill import spill_model
    from federation.coordinator.secagg_round import in_ring_mean
    from federation.protocol.codecs import UpdateSpec
    from federation.protocol.malloc_policy import return_freed_tensors

    return_freed_tensors()
    spec = spec_of(params)
    base = vm("VmRSS")
    model = {k: np.full(s, 0.5, np.float32) for k, (_, s) in spec.items()}
    t0 = time.monotonic()
    cfg = SecAggConfig(threshold=2, clip=0.5)
    plan, channel = make_plan(cfg, new_context("coordinator-memory", 1), [1, 2])
    server = SecAggServer(cfg, plan, vector_len=params)
    clients = {}
    for i in (1, 2):
        clients[i], setup = SecAggClient.setup(cfg, plan, i, channel[i])
        server.receive_setup(i, setup)
    live = server.close_setup(weight_bound=100)
    if spill:  # SecAggRound, once the train messages are built (before any reply)
        spill_model(model, work / "spill")
    for i in live:
        x = np.memmap(work / f"secagg{i}.f32", np.float32, "r")
        for offset, words in clients[i].masked_input(server.masked_input_request(i), x, 10 + i,
                                                    rng=np.random.default_rng(i)):
            server.add_masked_chunk(i, offset, words)
            x._mmap.madvise(mmap.MADV_DONTNEED)  # the site's pages: not the coordinator's memory
        del x
    for i in server.close_masked_input():
        server.receive_unmask(i, clients[i].unmask(server.unmask_request(i)))
    result = server.finish()
    mean = in_ring_mean(result, UpdateSpec.of(model))
    del result
    model = ServerOptimizer("fedavg", "delta", 1.0).step(model, mean, consume=True, in_place=True)
    seconds = time.monotonic() - t0
    peak = vm("VmHWM")
    return {"path": "secagg" if spill else "secagg-inmemory", "params": params, "base_rss": base, "peak_rss": peak,
            "seconds": round(seconds, 1), "ratio": (peak - base) / (params * 4),
            "checksum": float(sum(float(v.reshape(-1)[:1000].sum()) + float(v.reshape(-1)[-1000:].sum())
                                  for v in model.values()))}


def make_secagg_inputs(work: Path, params: int) -> None:
    """The two SecAgg+ sites' float32 updates, as files (written a slice at a time)."""
    for i in (1, 2):
        rng = np.random.default_rng(100 + i)
        with open(work / f"secagg{i}.f32", "wb") as f:
            for lo in range(0, params, 1 << 22):
                f.write((rng.standard_normal(min(1 << 22, params - lo), dtype=np.float32) * 1e-2).tobytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=101_000_000)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--skip-inmemory", action="store_true", help="measure only the streamed path")
    ap.add_argument("--secagg", action="store_true", help="also measure a SecAgg+ round's coordinator side")
    ap.add_argument("--skip-plain", action="store_true", help="skip the sealed round (with --secagg)")
    ap.add_argument("--_make", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_measure", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._make:
        make_update(a.workdir, a._make[0], a.params, int(a._make[1]))
        return
    if a._measure:
        if a._measure.startswith("secagg"):
            print(json.dumps(measure_secagg(a.workdir, a.params, a._measure == "secagg")))
        else:
            print(json.dumps(measure(a.workdir, a.params, a._measure)))
        return
    from crypto.pki import CoordinatorBundle, provision

    with tempfile.TemporaryDirectory(prefix="sovfl-coordmem-", dir=a.workdir) as tmp:
        work = Path(tmp)
        provision(work / "pki", ["site0", "site1"])
        (work / "ctx.json").write_text(json.dumps({"federation": CoordinatorBundle.load(work / "pki" / "coordinator").federation_id}))
        me = [sys.executable, __file__, "--params", str(a.params), "--workdir", str(work)]
        paths: tuple[str, ...] = ()
        if not a.skip_plain:
            for i, site in enumerate(("site0", "site1")):
                subprocess.run(me + ["--_make", site, str(i)], check=True)
            paths += ("streamed",) + (() if a.skip_inmemory else ("inmemory",))
        if a.secagg:
            make_secagg_inputs(work, a.params)
            paths += ("secagg",) + (() if a.skip_inmemory else ("secagg-inmemory",))
        results = {}
        for path in paths:
            line = subprocess.run(me + ["--_measure", path], check=True, stdout=subprocess.PIPE, text=True).stdout
            results[path] = json.loads(line.strip().splitlines()[-1])
            r = results[path]
            print(f"{path}: peak RSS {r['peak_rss'] / 1e9:.2f} GB, before the model {r['base_rss'] / 1e9:.2f} GB, "
                  f"(peak - before) / (P x 4 B) = {r['ratio']:.2f}, {r['seconds']} s", flush=True)
        for ours, old in (("streamed", "inmemory"), ("secagg", "secagg-inmemory")):
            if ours in results and old in results:
                assert results[ours]["checksum"] == results[old]["checksum"], f"{ours} and {old} disagree"

    def ratio(path: str) -> str:
        return f"{results[path]['ratio']:.2f}" if path in results else "n/a"
    print(f"RESULT params={a.params} coordinator_peak_ratio={ratio('streamed')} inmemory_ratio={ratio('inmemory')} "
          f"secagg_peak_ratio={ratio('secagg')} secagg_inmemory_ratio={ratio('secagg-inmemory')}")


if __name__ == "__main__":
    main()

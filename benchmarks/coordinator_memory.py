"""The coordinator's peak memory for one plain sealed round at size, on its real code paths, without
the rest of a federation (issue 19: coordinator_peak_ratio <= 1.5).

Two sites' updates of P float32 parameters are sealed with really provisioned keys and written as
the data path stores an upload (the .npy bytes of the envelope body, WORKDIR/bulk-like files).
Then, in a fresh process per measurement, the coordinator's code takes them as a reply resolved
from the data path does (a read-only map of the file: bulk_server.take, bulk.resolve), and runs
PlainRound.receive_update for each, PlainRound.finish and ServerOptimizer.step (FedAvg, delta,
consume) on a P-parameter global model: what the ServerApp's driver calls. The process's peak RSS
(VmHWM) above what it held before the model was made, over P x 4 bytes, is the ratio.

`--path inmemory` measures the previous path for comparison (open_envelope into memory, the
float64 WeightedMean, the dense step), from the same files.

    python benchmarks/coordinator_memory.py --params 101000000
Last line: RESULT params=<P> coordinator_peak_ratio=<..> inmemory_ratio=<..>
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
        model = opt.step(model, out.mean, consume=True)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=101_000_000)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--skip-inmemory", action="store_true", help="measure only the streamed path")
    ap.add_argument("--_make", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_measure", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._make:
        make_update(a.workdir, a._make[0], a.params, int(a._make[1]))
        return
    if a._measure:
        print(json.dumps(measure(a.workdir, a.params, a._measure)))
        return
    from crypto.pki import CoordinatorBundle, provision

    with tempfile.TemporaryDirectory(prefix="sovfl-coordmem-", dir=a.workdir) as tmp:
        work = Path(tmp)
        provision(work / "pki", ["site0", "site1"])
        (work / "ctx.json").write_text(json.dumps({"federation": CoordinatorBundle.load(work / "pki" / "coordinator").federation_id}))
        me = [sys.executable, __file__, "--params", str(a.params), "--workdir", str(work)]
        for i, site in enumerate(("site0", "site1")):
            subprocess.run(me + ["--_make", site, str(i)], check=True)
        results = {}
        for path in ("streamed",) + (() if a.skip_inmemory else ("inmemory",)):
            line = subprocess.run(me + ["--_measure", path], check=True, stdout=subprocess.PIPE, text=True).stdout
            results[path] = json.loads(line.strip().splitlines()[-1])
            r = results[path]
            print(f"{path}: peak RSS {r['peak_rss'] / 1e9:.2f} GB, before the model {r['base_rss'] / 1e9:.2f} GB, "
                  f"(peak - before) / (P x 4 B) = {r['ratio']:.2f}, {r['seconds']} s", flush=True)
        if "inmemory" in results:
            assert results["inmemory"]["checksum"] == results["streamed"]["checksum"], "the two paths disagree"
    inm = results.get("inmemory", {}).get("ratio")
    print(f"RESULT params={a.params} coordinator_peak_ratio={results['streamed']['ratio']:.2f} "
          f"inmemory_ratio={'n/a' if inm is None else f'{inm:.2f}'}")


if __name__ == "__main__":
    main()

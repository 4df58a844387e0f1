"""SecAgg+ of crypto.secagg against Flower 1.41's own SecAgg+, same inputs, one process.

Flower side (the anchor): the client functions of flwr/client/mod/secure_aggregation/
secaggplus_mod.py (`_setup`, `_share_keys`, `_collect_masked_vectors`, `_unmask`) called as the
mod calls them, with the stage routing of flwr/server/workflow/secure_aggregation/
secaggplus_workflow.py (shuffled ring of `num_shares` neighbours, ciphertext forwarding), and its
server arithmetic: masked vectors summed as `collect_masked_vectors_stage` does, then
`unmask_stage`'s share combination, mask regeneration, subtraction and dequantisation, using
Flower's own utilities. Ours: crypto.secagg's SecAggClient / SecAggServer.

Measured, per scenario (no dropout; one client dropping after the share-keys stage):
Timings are the best of --repeat runs (default 5), Flower's and ours interleaved run by run:
the machine's cores are shared with other work, the minimum is the least disturbed run, and
interleaving exposes both sides to the same load.
- per-client masking seconds: Flower `_collect_masked_vectors` (decrypt shares, quantise, mask,
  serialise); ours `masked_input` (decrypt shares, encode, mask) plus `tobytes()` of every chunk
  (the one copy our site makes too, into the Flower Array of each chunk: the library writes all
  chunks into one reused buffer).
- what our signatures add (not in the ratio: Flower signs nothing): the site's stage-3 signature
  (SHA-256 manifest of the chunks + Ed25519) and the coordinator's check of it, per client.
- server unmask seconds: from the summed masked vector and the collected shares to the float
  average (Flower: the arithmetic of `unmask_stage`; ours: `finish()` + `decode()`).
- server accumulate seconds: adding the uploads (reported, not part of the unmask ratio).
- upload bytes per parameter of the masked vector.
- coordinator peak memory: tracemalloc peak (numpy reports its buffers to tracemalloc) over
  accumulate + unmask + decode, in a separate pass from the timing. Client uploads are built
  beforehand and not counted (ours are read zero-copy with np.frombuffer; Flower deserialises
  them with np.load, which is counted because that is its server code path).

Usage: python benchmarks/secagg_vs_flower.py [--params N] [--sites 10] [--shares 5] [--threshold 3]
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import random
import resource
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from crypto.pki import CoordinatorBundle, SiteBundle, provision  # noqa: E402
from crypto.secagg import ChunkManifest, SecAggClient, SecAggConfig, SecAggServer, new_context  # noqa: E402
from crypto.secagg.simulation import make_plan  # noqa: E402
from crypto.secagg.signing import sign, verify  # noqa: E402

CLIP = 8.0  # Flower's default clipping_range
MAX_WEIGHT = 1000  # Flower's default max_weight
Q_RANGE = 1 << 22  # Flower's default quantization_range
MOD_RANGE = 1 << 32  # Flower's default modulus_range


def peak_bytes(fn: Callable[[], Any]) -> int:
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    out = fn()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    del out
    gc.collect()
    return peak


# ---- Flower --------------------------------------------------------------------------------


class FlowerRun:
    """Flower 1.41 SecAgg+ clients and the workflow's routing, stage by stage."""

    def __init__(self, ids: list[int], shares: int, threshold: int) -> None:
        import importlib

        from flwr.app import ConfigRecord

        # the package re-exports the function under the module's name: import the module itself
        mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
        from flwr.common.secure_aggregation.secaggplus_constants import Key

        self.mod, self.Key, self.ConfigRecord = mod, Key, ConfigRecord
        self.ids, self.threshold = ids, threshold
        self.states = {i: mod.SecAggPlusState() for i in ids}
        setup = {
            Key.SAMPLE_NUMBER: len(ids),
            Key.SHARE_NUMBER: shares,
            Key.THRESHOLD: threshold,
            Key.CLIPPING_RANGE: CLIP,
            Key.TARGET_RANGE: Q_RANGE,
            Key.MOD_RANGE: MOD_RANGE,
            Key.MAX_WEIGHT: float(MAX_WEIGHT),
        }
        self.pks: dict[int, tuple[bytes, bytes]] = {}
        for i in ids:  # stage 0 "setup"
            self.states[i].nid = i
            res = mod._setup(self.states[i], ConfigRecord(dict(setup)))
            self.pks[i] = (res[Key.PUBLIC_KEY_1], res[Key.PUBLIC_KEY_2])
        order = list(ids)  # the workflow's neighbour ring over shuffled ids
        random.Random(7).shuffle(order)
        half = shares >> 1
        self.neighbours = {
            nid: {order[(idx + d) % len(order)] for d in range(-half, half + 1)} for idx, nid in enumerate(order)
        }
        self.fwd: dict[int, list[tuple[int, bytes]]] = {i: [] for i in ids}
        for i in ids:  # stage 1 "share keys", then forward ciphertexts to their destinations
            cfg = ConfigRecord({str(n): list(self.pks[n]) for n in self.neighbours[i]})
            res = mod._share_keys(self.states[i], cfg)
            for dst, ct in zip(res[Key.DESTINATION_LIST], res[Key.CIPHERTEXT_LIST], strict=True):
                self.fwd[dst].append((i, ct))

    def collect(self, i: int, params: Any, weight: int) -> list[bytes]:
        """Stage 2 on client i: returns the masked vector as Flower serialises it."""
        srcs = [s for s, _ in self.fwd[i]]
        cts = [c for _, c in self.fwd[i]]
        cfg = self.ConfigRecord({self.Key.CIPHERTEXT_LIST: cts, self.Key.SOURCE_LIST: srcs})
        res = self.mod._collect_masked_vectors(self.states[i], cfg, weight, params)
        return list(res[self.Key.MASKED_PARAMETERS])

    def unmask_replies(self, active: set[int], dead: set[int]) -> list[tuple[list[int], list[bytes]]]:
        out = []
        for i in sorted(active):
            nb = self.neighbours[i]
            cfg = self.ConfigRecord(
                {self.Key.ACTIVE_NODE_ID_LIST: sorted(nb & active), self.Key.DEAD_NODE_ID_LIST: sorted(nb & dead)}
            )
            res = self.mod._unmask(self.states[i], cfg)
            out.append((list(res[self.Key.NODE_ID_LIST]), list(res[self.Key.SHARE_LIST])))
        return out

    def accumulate(self, uploads: dict[int, list[bytes]]) -> list[np.ndarray]:
        from flwr.common import bytes_to_ndarray
        from flwr.common.secure_aggregation.ndarrays_arithmetic import parameters_addition, parameters_mod

        total = None
        for i in sorted(uploads):
            vec = [bytes_to_ndarray(b) for b in uploads[i]]
            total = vec if total is None else parameters_addition(total, vec)
        assert total is not None
        return parameters_mod(total, MOD_RANGE)

    def unmask(self, masked: list[np.ndarray], replies: Any, active: set[int]) -> list[np.ndarray]:
        """The arithmetic of SecAggPlusWorkflow.unmask_stage."""
        from flwr.common.secure_aggregation.crypto.shamir import combine_shares
        from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
        from flwr.common.secure_aggregation.ndarrays_arithmetic import (
            factor_extract,
            get_parameters_shape,
            parameters_addition,
            parameters_mod,
            parameters_subtraction,
        )
        from flwr.common.secure_aggregation.quantization import dequantize
        from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
        from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

        collected: dict[int, list[bytes]] = {i: [] for i in self.ids}
        for nids, shares in replies:
            for owner, share in zip(nids, shares, strict=True):
                collected[owner].append(share)
        vec = masked
        for nid, share_list in collected.items():
            if len(share_list) < self.threshold:
                raise RuntimeError("Flower: not enough shares")
            secret = combine_shares(share_list)
            if nid in active:
                vec = parameters_subtraction(vec, pseudo_rand_gen(secret, MOD_RANGE, get_parameters_shape(vec)))
            else:
                for nb in sorted(self.neighbours[nid] - {nid}):
                    key = generate_shared_key(bytes_to_private_key(secret), bytes_to_public_key(self.pks[nb][0]))
                    mask = pseudo_rand_gen(key, MOD_RANGE, get_parameters_shape(vec))
                    vec = parameters_addition(vec, mask) if nid > nb else parameters_subtraction(vec, mask)
        recon = parameters_mod(vec, MOD_RANGE)
        q_total, recon = factor_extract(recon)
        inv = Q_RANGE / q_total
        agg = dequantize(recon, CLIP, Q_RANGE)
        offset = -(len(active) - 1) * CLIP
        for v in agg:
            v += offset
            v *= inv
        return agg


# ---- ours ----------------------------------------------------------------------------------


class OursRun:
    def __init__(self, ids: list[int], shares: int, threshold: int, chunk_mib: float, p: int) -> None:
        self.cfg = SecAggConfig(
            threshold=threshold, neighbours=shares - 1, clip=CLIP, bits=32, max_weight=MAX_WEIGHT,
            chunk_bytes=int(chunk_mib * (1 << 20)) // 16 * 16,
        )
        self.ctx = new_context("bench", 1)
        plan, channel = make_plan(self.cfg, self.ctx, ids)  # channel keys: provisioned in a deployment
        srv = SecAggServer(self.cfg, plan, vector_len=p)
        self.msg_bytes = 0
        self.clients = {}
        for i in ids:  # setup: Bonawitz et al.'s stages 1 and 2 in one message (crypto/secagg/README.md)
            self.clients[i], m = SecAggClient.setup(self.cfg, plan, i, channel[i])
            self.msg_bytes += len(m) + len(self.clients[i].advert())
            srv.receive_setup(i, m)
        srv.close_setup(weight_bound=MAX_WEIGHT)
        self.server_after_stage2 = srv
        self.requests = {i: srv.masked_input_request(i) for i in ids}
        self.before_masking = {i: self.clients[i].to_state() for i in ids}
        self.snapshots: dict[int, bytes] = {}

    def collect(self, i: int, x: np.ndarray, weight: int) -> tuple[float, list[tuple[int, bytes]]]:
        """Stage 3 on client i (restored from its state after stage 2, not timed): seconds, chunks."""
        client = SecAggClient.from_state(self.cfg, self.before_masking[i])
        t = time.perf_counter()
        out = [(off, w.tobytes()) for off, w in client.masked_input(self.requests[i], x, weight)]
        dt = time.perf_counter() - t
        self.snapshots[i] = client.to_state()
        return dt, out

    def signature_seconds(self, pki: Path, chunks: list[tuple[int, bytes]]) -> tuple[float, float]:
        """Seconds to sign one client's masked input as our site does, and to verify it as our
        coordinator does (provisioned keys, a fresh replay guard so that it can be repeated)."""
        from crypto.envelope import ReplayGuard

        site, coord = SiteBundle.load(pki / "sites" / "s0"), CoordinatorBundle.load(pki / "coordinator")
        trust = coord.trust()

        def manifest() -> bytes:
            m = ChunkManifest()
            for off, b in chunks:
                m.add(off, len(b) // 4, b)  # 32-bit ring: the packed bytes are the words
            return m.encode()

        t = time.perf_counter()
        sig = sign(site.sign_key, site.federation_id, site.name, self.ctx, 3, manifest())
        signed = time.perf_counter() - t
        t = time.perf_counter()
        verify(sig, manifest(), trust=trust, federation_id=coord.federation_id, ctx=self.ctx, stage=3,
               site=site.name, replay=ReplayGuard())
        return signed, time.perf_counter() - t

    def server_phase(self, uploads: dict[int, list[tuple[int, bytes]]], timings: dict[str, float]) -> np.ndarray:
        srv = copy.deepcopy(self.server_after_stage2)
        t = time.perf_counter()
        for i in sorted(uploads):
            for off, b in uploads[i]:
                srv.add_masked_chunk(i, off, np.frombuffer(b, dtype=np.uint32))
        survivors = srv.close_masked_input()
        timings["accumulate"] = time.perf_counter() - t
        replies = {}
        for i in survivors:  # client-side work, not timed as server work
            c = SecAggClient.from_state(self.cfg, self.snapshots[i])
            replies[i] = c.unmask(srv.unmask_request(i))
        t = time.perf_counter()
        for i, r in replies.items():
            srv.receive_unmask(i, r)
        res = srv.finish()
        mean = res.decode()
        timings["unmask"] = time.perf_counter() - t
        timings["bound"] = res.error_bound()
        return mean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--shares", type=int, default=5, help="shares per secret = neighbours + 1 (odd, Flower)")
    ap.add_argument("--threshold", type=int, default=3)
    ap.add_argument("--chunk-mib", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=5, help="timings are the best of this many runs (shared CPU)")
    args = ap.parse_args()
    p, n = args.params, args.sites

    from flwr.common import Parameters, ndarray_to_bytes

    rng = np.random.default_rng(2024)
    ids = sorted(int(v) for v in rng.choice(1 << 62, size=n, replace=False))
    xs = {i: rng.normal(0.0, 0.5, p).astype(np.float32) for i in ids}
    ws = {i: int(rng.integers(100, MAX_WEIGHT + 1)) for i in ids}
    dropped = ids[n // 2]
    print(f"# {n} sites x {p:,} float32 parameters (timings: best of {args.repeat}), {args.shares} shares, threshold {args.threshold}, "
          f"clip {CLIP}, weights in [100, {MAX_WEIGHT}]; dropout scenario: site {dropped} drops after share keys")

    def truth(active: list[int]) -> np.ndarray:
        tot = np.zeros(p)
        for i in active:
            tot += ws[i] * np.clip(xs[i].astype(np.float64), -CLIP, CLIP)
        return tot / sum(ws[i] for i in active)

    # -- stages 1-2 on both sides
    t = time.perf_counter()
    fl = FlowerRun(ids, args.shares, args.threshold)
    fl_setup = time.perf_counter() - t
    t = time.perf_counter()
    ours = OursRun(ids, args.shares, args.threshold, args.chunk_mib, p)
    our_setup = time.perf_counter() - t

    # -- stage 3 (masking), Flower and ours interleaved so that both see the same machine load
    params = {i: Parameters(tensors=[ndarray_to_bytes(xs[i])], tensor_type="numpy.ndarray") for i in ids}
    fl_uploads: dict[int, list[bytes]] = {}
    our_uploads: dict[int, list[tuple[int, bytes]]] = {}
    fl_best = {i: float("inf") for i in ids}
    our_best = {i: float("inf") for i in ids}
    for _ in range(args.repeat):
        for i in ids:
            fl_uploads.pop(i, None)
            t = time.perf_counter()
            fl_uploads[i] = fl.collect(i, params[i], ws[i])
            fl_best[i] = min(fl_best[i], time.perf_counter() - t)
            our_uploads.pop(i, None)
            dt, our_uploads[i] = ours.collect(i, xs[i], ws[i])
            our_best[i] = min(our_best[i], dt)
    del params
    fl_mask, our_mask = [fl_best[i] for i in ids], [our_best[i] for i in ids]
    fl_bpp = sum(len(b) for b in fl_uploads[ids[0]]) / p
    our_bpp = sum(len(b) for _, b in our_uploads[ids[0]]) / p
    our_chunk = max(len(b) for _, b in our_uploads[ids[0]])

    print(f"stages 1-2 (all sites, keys + shares): flower {fl_setup:.3f} s, ours {our_setup:.3f} s "
          f"(ours: {ours.msg_bytes} bytes of stage-1/2 messages in all)")
    print(f"per-client masking seconds: flower mean {np.mean(fl_mask):.3f} (min {min(fl_mask):.3f}, max {max(fl_mask):.3f}); "
          f"ours mean {np.mean(our_mask):.3f} (min {min(our_mask):.3f}, max {max(our_mask):.3f})")
    print(f"upload bytes per parameter: flower {fl_bpp:.6f} (int64, one blob); ours {our_bpp:.6f} "
          f"(uint32 + one weight word, chunks of {our_chunk} bytes)")
    with tempfile.TemporaryDirectory() as tmp:
        provision(tmp, ["s0"])
        sig_s = [ours.signature_seconds(Path(tmp), our_uploads[ids[0]]) for _ in range(args.repeat)]
    print(f"our signatures (not in the ratio; Flower signs nothing): site signs its masked input in "
          f"{min(s for s, _ in sig_s):.3f} s, coordinator verifies it in {min(v for _, v in sig_s):.3f} s; "
          f"ours masked and signed {np.mean(our_mask) + min(s for s, _ in sig_s):.3f} s per client")

    unmask_ratios, mem_ratios = [], []
    for label, active in [("no dropout", ids), ("1 dropout", [i for i in ids if i != dropped])]:
        aset, dead = set(active), set(ids) - set(active)
        want = truth(active)
        fl_up = {i: fl_uploads[i] for i in active}
        our_up = {i: our_uploads[i] for i in active}
        replies = fl.unmask_replies(aset, dead)
        fl_acc_s = fl_unmask_s = float("inf")
        tim: dict[str, float] = {"accumulate": float("inf"), "unmask": float("inf")}
        for _ in range(args.repeat):  # Flower then ours, interleaved
            fl_masked = fl_mean = None
            t = time.perf_counter()
            fl_masked = fl.accumulate(fl_up)
            fl_acc_s = min(fl_acc_s, time.perf_counter() - t)
            t = time.perf_counter()
            fl_mean = fl.unmask(fl_masked, replies, aset)[0]
            fl_unmask_s = min(fl_unmask_s, time.perf_counter() - t)
            fl_masked = None
            our_mean, one = None, {}
            our_mean = ours.server_phase(our_up, one)
            tim = {k: min(tim.get(k, v), v) for k, v in one.items()}
        fl_err = float(np.max(np.abs(fl_mean - want)))
        our_err = float(np.max(np.abs(our_mean - want)))
        del fl_masked, fl_mean, our_mean
        fl_peak = peak_bytes(lambda: fl.unmask(fl.accumulate(fl_up), replies, aset))
        our_peak = peak_bytes(lambda: ours.server_phase(our_up, {}))
        print(f"[{label}] server accumulate seconds: flower {fl_acc_s:.3f}, ours {tim['accumulate']:.3f}")
        print(f"[{label}] server unmask seconds: flower {fl_unmask_s:.3f}, ours {tim['unmask']:.3f} "
              f"(speedup {fl_unmask_s / tim['unmask']:.1f}x)")
        print(f"[{label}] coordinator peak memory (tracemalloc, accumulate+unmask+decode): "
              f"flower {fl_peak / 2**20:.1f} MiB = {fl_peak / (4 * p):.2f} x P*4B; "
              f"ours {our_peak / 2**20:.1f} MiB = {our_peak / (4 * p):.2f} x P*4B")
        print(f"[{label}] max |mean - plaintext weighted mean|: flower {fl_err:.3g}, ours {our_err:.3g} "
              f"(our stated bound {tim['bound']:.3g})")
        if our_err > tim["bound"]:
            print("ERROR: our decoded mean exceeds the stated quantization bound")
            sys.exit(1)
        unmask_ratios.append(fl_unmask_s / tim["unmask"])
        mem_ratios.append(our_peak / (4 * p))

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"# process max RSS {rss:.2f} GiB (all simulated sites and both protocols: not the coordinator alone)")
    print("# mask_speedup: mean per-client time; unmask_speedup: the smaller of the two scenarios; "
          "peak_mem_ratio: the larger")
    print(f"RESULT mask_speedup={np.mean(fl_mask) / np.mean(our_mask):.2f} unmask_speedup={min(unmask_ratios):.2f} "
          f"bytes_per_param={our_bpp:.6f} peak_mem_ratio={max(mem_ratios):.3f}")


if __name__ == "__main__":
    main()

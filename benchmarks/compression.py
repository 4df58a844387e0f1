"""Update-compression benchmark: wire bytes and encode/decode time per codec, plus accuracy.

1. A synthetic 10M-parameter update (heavy-tailed, Student-t with 3 dof, like real deltas) goes
   through every codec with error feedback on: wire payload bytes, ratio vs dense float32,
   encode and decode seconds (single process; numpy only).
2. Under secure aggregation: one real SecAgg+ round of the same update through the federation's
   own code (benchmarks/_fedsim.py `secagg_upload`: the sites' ClientApp mods encode and mask it,
   the coordinator unmasks the sum, all in one process through the in-process Grid); the ratio is
   dense float32 bytes over the masked chunks' bytes each site actually sent.
3. Downlink: the coordinator's real model messages (federation/coordinator/downlink_sender.py) for the same 10M
   model: bytes a site receives for one model step, ratio vs the dense model, coordinator encode
   and site reconstruct seconds.
4. In-process FedAvg on sklearn digits (benchmarks/_fedsim.py: the federation's own coordinator
   and site code, SecAgg+ included) gives the accuracy table, uplink codecs then downlink codecs.

The RESULT line covers the uplink codecs (the issue's targets); the downlink rows print their own
worst drop. Last line: ``RESULT secagg_bytes_ratio=... sealed_bytes_ratio=... max_accuracy_drop_pts=...``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from flwr.app import RecordDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._fedsim import run_fedavg, secagg_upload  # noqa: E402
from federation.coordinator.downlink_sender import DownlinkSender  # noqa: E402
from federation.protocol.codecs import CodecRound, UpdateSpec, parse_codec, shared_indices  # noqa: E402
from federation.protocol.downlink_steps import reconstruct  # noqa: E402
from federation.protocol.message_keys import DOWNLINK, GLOBAL, MODEL_DIGEST  # noqa: E402
from federation.protocol.payload_records import from_records  # noqa: E402

CODECS = [
    "identity",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "int8:clip=0.01",
    "topk:0.01:index=int32",
    "topk:0.01",
    "topk:0.01+int8",
    "topk:0.01+int4",
    "topk:0.005+int4",
    "randk:0.1",
    "randk:0.1+int8:clip=0.01",
    "randk:0.1+int4:clip=0.01",
]
SECAGG_CODEC = "randk:0.1+int8:clip=0.01"  # clip here matches the synthetic update's scale
SEALED_CODEC = "topk:0.01+int4"

# (label, codec, fedsim options) for the digits FedAvg run; the clip is config-given and matches
# the scale of that model's deltas.
ACCURACY_RUNS = [
    ("int8 + EF", "int8", {}),
    ("top-k 1% + EF", "topk:0.01", {}),
    ("random-k 10% + int8 clip (under SecAgg+)", "randk:0.1+int8:clip=0.5", {"secagg": True}),
    ("top-k 1% + int4 + EF (sealed headline)", SEALED_CODEC, {}),
]
DOWNLINK_CODECS = ["identity", "fp16", "int8", "int4", "topk:0.1+int8"]
DOWNLINK_RUNS = [  # (label, uplink codec or None, fedsim options)
    ("downlink int8", None, {"downlink": "int8"}),
    ("downlink int4", None, {"downlink": "int4"}),
    ("downlink top-k 10% + int8", None, {"downlink": "topk:0.1+int8"}),
    ("downlink int8, uplink top-k 1% + int4", SEALED_CODEC, {"downlink": "int8"}),
    ("downlink int4, uplink random-k + int8 under SecAgg+", "randk:0.1+int8:clip=0.5",
     {"downlink": "int4", "secagg": True}),
]


def synthetic_update(numel: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    big = int(numel * 0.8)
    rest = numel - big
    return {
        "block.weight": (rng.standard_t(3, big) * 1e-3).astype(np.float32).reshape(-1, 1000 if big % 1000 == 0 else 1),
        "head.weight": (rng.standard_t(3, rest) * 1e-3).astype(np.float32),
    }


def bytes_table(numel: int, seed: int) -> dict[str, dict]:
    update = synthetic_update(numel, seed)
    layout = UpdateSpec.of(update)
    rows = {}
    print(f"== bytes and speed: {numel:,} parameters, dense float32 = {4 * numel / 2**20:.1f} MiB ==")
    print(f"{'codec':42s} {'wire bytes':>12s} {'ratio':>8s} {'encode s':>9s} {'decode s':>9s}  with secagg")
    for spec in CODECS:
        codec = parse_codec(spec, error_feedback=True)
        _, state = codec.encode(update, None, CodecRound(1, 11, site_seed=1))  # realistic residual
        ctx = CodecRound(2, 22, site_seed=1)
        shared_indices.cache_clear()
        t0 = time.perf_counter()
        enc, state = codec.encode(update, state, ctx)
        t1 = time.perf_counter()
        shared_indices.cache_clear()  # the coordinator regenerates the shared indices itself
        codec.decode(enc, layout, ctx)
        t2 = time.perf_counter()
        secagg = "allowed (masked values)" if codec.linear_under_masks else "not linear (sealed/none only)"
        rows[spec] = {"nbytes": enc.nbytes, "ratio": enc.compression_ratio, "codec": codec}
        print(
            f"{codec.spec:42s} {enc.nbytes:12,d} {enc.compression_ratio:8.1f} "
            f"{t1 - t0:9.3f} {t2 - t1:9.3f}  {secagg}"
        )
        del state
    return rows


def downlink_table(numel: int, seed: int) -> None:
    """One model step through the real downlink messages: the site holds the previous model."""
    model = {k: v * 50 for k, v in synthetic_update(numel, seed).items()}
    moved = {k: v + d for (k, v), d in zip(model.items(), synthetic_update(numel, seed + 1).values())}
    print(f"== downlink: one global-model step to a site, {numel:,} parameters ==")
    print(f"{'downlink codec':42s} {'bytes down':>12s} {'ratio':>8s} {'encode s':>9s} {'site s':>9s}  mode")
    for spec in DOWNLINK_CODECS:
        sender = DownlinkSender(spec, seed)
        first = RecordDict(sender.stage(model, str)(1))
        held = None
        if DOWNLINK in first.config_records:  # the site keeps what it rebuilt
            arrays, digest = reconstruct(from_records(first, GLOBAL, DOWNLINK), None)
            held = (digest, arrays)
            sender.heard(1, {MODEL_DIGEST: digest})
        sender.round_metrics()
        t0 = time.perf_counter()
        rd = RecordDict(sender.stage(moved, str)(1))
        t1 = time.perf_counter()
        payload = from_records(rd, GLOBAL, DOWNLINK)
        if held is not None:
            reconstruct(payload, held)
        t2 = time.perf_counter()
        line = sender.round_metrics()
        print(f"{sender.spec:42s} {line['bytes']['1']:12,d} {line['ratio']:8.1f} {t1 - t0:9.3f} {t2 - t1:9.3f}  "
              f"{next(iter(line['modes']))}")
        del sender, first, rd, payload, held


def accuracy_table(seed: int) -> float:
    print("== accuracy: FedAvg on sklearn digits, 4 sites, Dirichlet alpha=0.5, 300 rounds ==")
    base = run_fedavg(None, seed=seed)
    print(f"{'uncompressed float32':56s} acc={100 * base.accuracy:6.2f}%  bytes/site/round={base.mean_site_bytes:8.1f}")
    worst = 0.0
    for label, spec, options in ACCURACY_RUNS:
        r = run_fedavg(spec, error_feedback=True, seed=seed, **options)
        drop = 100 * (base.accuracy - r.accuracy)
        worst = max(worst, drop)
        wire = r.mean_site_bytes  # under SecAgg: the masked chunks' bytes, from the real messages
        note = " masked" if options.get("secagg") else ""
        print(
            f"{label:56s} acc={100 * r.accuracy:6.2f}%  drop={drop:+5.2f} pts  "
            f"bytes/site/round={wire:8.1f} (x{r.dense_bytes / wire:.1f}){note}"
        )
    print(f"-- downlink (bytes down per site per round, all array bytes incl. headers; "
          f"dense: {base.mean_down_bytes:.1f}) --")
    worst_down = 0.0
    for label, spec, options in DOWNLINK_RUNS:
        r = run_fedavg(spec, error_feedback=True, seed=seed, **options)
        drop = 100 * (base.accuracy - r.accuracy)
        worst_down = max(worst_down, drop)
        print(f"{label:56s} acc={100 * r.accuracy:6.2f}%  drop={drop:+5.2f} pts  "
              f"down/site/round={r.mean_down_bytes:8.1f} (x{r.down_ratio:.2f} vs dense float32 data)")
    print(f"downlink: worst drop {worst_down:.2f} pts")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--secagg-sites", type=int, default=4, help="sites of the measured SecAgg round")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rows = bytes_table(args.params, args.seed)
    t0 = time.perf_counter()
    measured = secagg_upload(synthetic_update(args.params, args.seed), SECAGG_CODEC, args.secagg_sites, args.seed)
    secagg_ratio = measured["dense_bytes"] / measured["masked_bytes"]
    sealed_ratio = rows[SEALED_CODEC]["ratio"]
    print(
        f"SecAgg: {rows[SECAGG_CODEC]['codec'].spec}, one real SecAgg+ round of {measured['sites']} sites in process "
        f"({time.perf_counter() - t0:.1f}s): {measured['masked_bytes']:,.0f} masked bytes per site "
        f"({measured['record_bytes']:,.0f} with array headers) for {measured['dense_bytes']:,} dense -> x{secagg_ratio:.1f}"
    )
    print(f"Sealed: {rows[SEALED_CODEC]['codec'].spec} (Rice delta-coded indices) -> x{sealed_ratio:.1f}")
    downlink_table(args.params, args.seed)
    worst_drop = accuracy_table(args.seed)
    print(
        f"RESULT secagg_bytes_ratio={secagg_ratio:.1f} sealed_bytes_ratio={sealed_ratio:.1f} "
        f"max_accuracy_drop_pts={worst_drop:.2f}"
    )


if __name__ == "__main__":
    main()

"""Sign+seal throughput of crypto.envelope against raw AES-256-GCM on the same buffer.

Ours: tree SHA-256 digest + Ed25519 signature + ephemeral X25519/HKDF + chunked AES-256-GCM into a
fresh output buffer (what a site does per update). Anchors, same buffer, same run:
  raw_oneshot  AESGCM.encrypt(nonce, buf, aad): one call, returns a fresh bytes object
  raw_chunked  AESGCM.encrypt_into per chunk into a fresh numpy buffer, one thread
Runs are interleaved and repeated; each figure is the median. The last line is
    RESULT seal_gbps=<ours> ratio_to_aesgcm=<ours / raw_oneshot>

    python benchmarks/seal_throughput.py            # 400 MB
    python benchmarks/seal_throughput.py --mb 16    # quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from crypto.envelope import DEFAULT_CHUNK, DEFAULT_WORKERS, make_envelope, open_envelope  # noqa: E402


class _Trust:
    def __init__(self, key: ed25519.Ed25519PublicKey):
        self.rec = type("R", (), {"sign_public": key, "revoked": False})()

    def lookup(self, name: str):
        return self.rec if name == "site-0" else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=400.0, help="update size in MB (10^6 bytes)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=DEFAULT_WORKERS)
    ap.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK / 2**20)
    args = ap.parse_args()

    n = int(args.mb * 1e6) // 4 * 4
    chunk = int(args.chunk_mib * 2**20)
    payload = np.random.default_rng(0).standard_normal(n // 4, dtype=np.float32)  # an fp32 update
    buf = memoryview(payload).cast("B")
    site_key, coord_key = ed25519.Ed25519PrivateKey.generate(), x25519.X25519PrivateKey.generate()
    aes = AESGCM(AESGCM.generate_key(bit_length=256))
    nonce = os.urandom(12)

    def ours() -> None:
        make_envelope(payload, signing_key=site_key, federation_id="bench", run_id=1, round=1, site="site-0",
                      seal_to=coord_key.public_key(), chunk_size=chunk, workers=args.workers)

    def raw_oneshot() -> None:
        aes.encrypt(nonce, buf, b"aad")

    def raw_chunked() -> None:
        k = max(1, -(-n // chunk))
        out = memoryview(np.empty(n + 16 * k, np.uint8))
        for i in range(k):
            lo, hi = i * chunk, min(n, (i + 1) * chunk)
            aes.encrypt_into(nonce, buf[lo:hi], b"aad", out[lo + 16 * i:hi + 16 * (i + 1)])

    # Warm-up: fault in memory of this size once (first touch of fresh VM memory is slow).
    for fn in (raw_chunked, ours, raw_oneshot):
        fn()
    times: dict[str, list[float]] = {"ours": [], "raw_oneshot": [], "raw_chunked": []}
    for _ in range(args.repeats):
        for name, fn in (("ours", ours), ("raw_oneshot", raw_oneshot), ("raw_chunked", raw_chunked)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

    env = make_envelope(payload, signing_key=site_key, federation_id="bench", run_id=1, round=1, site="site-0",
                        seal_to=coord_key.public_key(), chunk_size=chunk, workers=args.workers)
    t0 = time.perf_counter()
    opened = open_envelope(env, trust=_Trust(site_key.public_key()), federation_id="bench",
                           recipient_key=coord_key, workers=args.workers)
    t_open = time.perf_counter() - t0
    assert np.array_equal(opened.payload.view(np.float32), payload)

    gbps = {k: n / statistics.median(v) / 1e9 for k, v in times.items()}
    print(f"payload {n / 1e6:.1f} MB fp32, chunk {chunk / 2**20:g} MiB, workers {args.workers}, "
          f"cpus {os.cpu_count()}, repeats {args.repeats} (median)")
    for name, v in times.items():
        print(f"  {name:12s} {gbps[name]:6.2f} GB/s   runs(ms)={[round(x * 1e3) for x in v]}")
    print(f"  open+verify  {n / t_open / 1e9:6.2f} GB/s   (single run)")
    print(f"  ratio ours/raw_chunked = {gbps['ours'] / gbps['raw_chunked']:.2f}")
    print(f"RESULT seal_gbps={gbps['ours']:.2f} ratio_to_aesgcm={gbps['ours'] / gbps['raw_oneshot']:.2f}")


if __name__ == "__main__":
    main()

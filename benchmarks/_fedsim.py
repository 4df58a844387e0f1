"""In-process FedAvg on sklearn digits through the federation's own code (no processes, no torch).

Four sites get a non-IID Dirichlet(alpha) split of the training set and train a numpy softmax
regression for a few local epochs. Everything else is the code a deployment runs: the real
`Coordinator` drives the real round strategy (PlainRound, or SecAggRound under secure
aggregation) over federation/ops/inprocess.py's `InProcessGrid`, which hands every message,
through Flower's protobuf serialization, to each site's real ClientApp and its mods (downlink,
codec with the residual in the site store, SecAgg masking); the coordinator decodes, checks,
averages or unmasks, applies the server optimizer and writes its metrics line as in a deployment.
What differs from a deployment: no SuperLink, SuperNode or ClientApp process (messages are
handed over in memory); the trainer is a numpy function instead of the trainer service; updates
are not signed or sealed (there is no PKI; that does not change their values); and stochastic
rounding is seeded per site (node config `codec-site-seed`) so that runs are reproducible.
Used by tests/test_codecs_convergence.py and benchmarks/compression.py.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from threadpoolctl import threadpool_limits

from federation.config.schema import ExperimentConfig
from federation.coordinator.driver import Coordinator
from federation.ops.inprocess import FunctionTrainer, InProcessGrid, InProcessSite, task_identity
from federation.protocol.codecs import parse_codec
from federation.protocol.round_config import RoundConfig

RUN_ID = 1


@dataclass(frozen=True)
class FedResult:
    codec: str
    accuracy: float  # final test accuracy, in [0, 1]
    mean_site_bytes: float  # average wire payload bytes per site per round (uplink)
    dense_bytes: int  # float32 bytes of one update
    history: tuple[tuple[int, float], ...] = ()  # (round, test accuracy) every ``eval_every`` rounds
    mean_down_bytes: float = 0.0  # average bytes of the model message's arrays per site per round
    down_ratio: float = 1.0  # dense float32 bytes / downlink bytes, over the run


def dirichlet_split(labels: np.ndarray, n_sites: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Per class, share its samples among sites by Dirichlet(alpha) proportions (non-IID)."""
    parts: list[list[int]] = [[] for _ in range(n_sites)]
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        cuts = (np.cumsum(rng.dirichlet(np.full(n_sites, alpha))) * idx.size).astype(int)[:-1]
        for site, chunk in enumerate(np.split(idx, cuts)):
            parts[site].extend(chunk.tolist())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)


def _softmax_grad(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray, l2: float):
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(y.size), y] -= 1.0
    p /= y.size
    return x.T @ p + l2 * w, p.sum(axis=0)


def _local_train(model, x, y, epochs, lr, batch, l2, rng):
    w, b = model["w"].copy(), model["b"].copy()
    for _ in range(epochs):
        order = rng.permutation(y.size)
        for start in range(0, y.size, batch):
            sel = order[start : start + batch]
            gw, gb = _softmax_grad(w, b, x[sel], y[sel], l2)
            w -= lr * gw
            b -= lr * gb
    return {"w": w, "b": b}


def accuracy(model, x, y) -> float:
    return float(((x @ model["w"] + model["b"]).argmax(axis=1) == y).mean())


def run_fedavg(codec: str | None, **kwargs) -> FedResult:
    """FedAvg with every site's delta sent through ``codec``; see :func:`_run_fedavg` for options.

    BLAS is held to one thread: the matrices are tiny, and tests share a small machine. Site
    stores and checkpoints go to a temporary directory in memory (/dev/shm) where there is one.
    """
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with threadpool_limits(limits=1), tempfile.TemporaryDirectory(prefix="fedsim-", dir=shm) as workdir:
        return _run_fedavg(codec, workdir=Path(workdir), **kwargs)


def simulated_sites(trainers: list[FunctionTrainer], seed: int) -> list[InProcessSite]:
    """In-process sites site0, site1, ... (node ids 1, 2, ...) with reproducible codec rounding."""
    return [InProcessSite(f"site{s}", s + 1, t, {"codec-site-seed": str(seed * 1000 + s + 1)}, RUN_ID)
            for s, t in enumerate(trainers)]


def coordinator(workdir: Path, model: dict, sites: list[InProcessSite], manifest: dict | None = None,
                **federation) -> Coordinator:
    """The real coordinator of an in-process federation of `sites`, after site discovery (sites are
    checked against `manifest` when given). Call it (and its rounds) inside `task_identity(RUN_ID)`."""
    cfg = ExperimentConfig.model_validate({
        "federation": {"name": "fedsim", "evaluate": False, "quorum": 1, **federation},
        "sites": [{"id": s.name, "partition": i} for i, s in enumerate(sites)],
    })
    coord = Coordinator(InProcessGrid(sites, RUN_ID), cfg, workdir / "coordinator", RUN_ID, model, lambda line: None,
                        manifest=manifest)
    coord.wait_for_sites()
    return coord


def _run_fedavg(
    codec: str | None,
    *,
    workdir: Path,
    error_feedback: bool = True,
    secagg: bool = False,
    downlink: str = "identity",
    rounds: int = 300,
    local_epochs: int = 1,
    lr: float = 0.5,
    batch: int = 16,
    l2: float = 1e-4,
    n_sites: int = 4,
    alpha: float = 0.5,
    seed: int = 0,
    eval_every: int = 0,
    federation: dict | None = None,
) -> FedResult:
    """FedAvg with every site's delta sent through ``codec`` (``None``: uncompressed float32).

    ``secagg`` runs the secure-aggregation round (its clip is the codec's, or 1.0 for identity);
    ``downlink`` is the coordinator's ``downlink_codec``; ``federation`` adds other federation
    fields (e.g. ``{"strategy": "diloco"}``). Defaults (300 rounds of one local epoch,
    lr 0.5, batch 16) bring uncompressed FedAvg to ~97% test accuracy; one local epoch keeps
    client drift small, which is what top-k + error feedback is sensitive to.
    """
    x_train, x_test, y_train, y_test = load_data(seed)
    rng = np.random.default_rng(seed)
    parts = dirichlet_split(y_train, n_sites, alpha, rng)
    model = {"w": np.zeros((x_train.shape[1], 10), np.float32), "b": np.zeros(10, np.float32)}
    spec = codec or "identity"
    clip = float(spec.rsplit("clip=", 1)[1]) if "clip=" in spec else 1.0

    def site_trainer(s: int, idx: np.ndarray) -> FunctionTrainer:
        site_rng = np.random.default_rng([seed, s])

        def train(glob: dict, config: RoundConfig) -> tuple[dict, dict]:
            local = _local_train(glob, x_train[idx], y_train[idx], local_epochs, lr, batch, l2, site_rng)
            return {k: (local[k] - glob[k]).astype(np.float32) for k in glob}, {}

        return FunctionTrainer(train, idx.size, workdir / f"site{s}")

    sites = simulated_sites([site_trainer(s, idx) for s, idx in enumerate(parts)], seed)
    sent = down = down_dense = 0
    history = []
    with task_identity(RUN_ID):
        coord = coordinator(workdir, model, sites, codec=spec, error_feedback=error_feedback, seed=seed,
                            downlink_codec=downlink, rounds=rounds,
                            secagg={"enabled": secagg, "clip": clip}, **(federation or {}))
        for rnd in range(1, rounds + 1):
            line = coord.run_round(rnd)
            assert line["status"] == "aggregated", line["failed"]
            sent += sum(s["upload_bytes"] for s in line["sites"].values())
            down += sum(line["downlink"]["bytes"].values())
            down_dense += line["downlink"]["dense_bytes"]
            if eval_every and rnd % eval_every == 0:
                history.append((rnd, accuracy(coord.model, x_test, y_test)))
    return FedResult(
        codec=parse_codec(codec).spec if codec else "uncompressed",
        accuracy=accuracy(coord.model, x_test, y_test),
        mean_site_bytes=sent / (rounds * n_sites),
        dense_bytes=4 * sum(v.size for v in model.values()),
        history=tuple(history),
        mean_down_bytes=down / (rounds * n_sites),
        down_ratio=down_dense / down,
    )


def secagg_upload(update: dict[str, np.ndarray], codec: str, n_sites: int = 4, seed: int = 0) -> dict:
    """One real SecAgg+ round in process: `n_sites` sites each return (a scaled copy of) `update`
    from their trainer; their ClientApp mods encode it with `codec` and mask it, and the coordinator
    unmasks the sum. Returns what the wire carried per site: the masked chunks' data bytes (as the
    coordinator counts them) and all array bytes of the reply records (.npy headers included)."""
    clip = float(codec.rsplit("clip=", 1)[1]) if "clip=" in codec else 1.0
    model = {k: np.zeros_like(v, dtype=np.float32) for k, v in update.items()}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="secagg-bytes-", dir=shm) as tmp:
        workdir = Path(tmp)

        def trainer(s: int) -> FunctionTrainer:
            return FunctionTrainer(lambda glob, config: ({k: v * np.float32(1 + 0.1 * s) for k, v in update.items()}, {}),
                                   100 + s, workdir / f"site{s}")

        sites = simulated_sites([trainer(s) for s in range(n_sites)], seed)
        with task_identity(RUN_ID):
            coord = coordinator(workdir, model, sites, codec=codec, rounds=1, seed=seed,
                                secagg={"enabled": True, "clip": clip})
            line = coord.run_round(1)
    assert line["status"] == "aggregated", line["failed"]
    masked = [s["upload_bytes"] for s in line["sites"].values()]
    return {"masked_bytes": float(np.mean(masked)), "record_bytes": line["bytes_up"] / len(masked),
            "dense_bytes": 4 * sum(int(v.size) for v in update.values()), "sites": len(masked)}

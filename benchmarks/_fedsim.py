"""In-process FedAvg on sklearn digits through the federation's own code (no processes, no torch).

Four sites get a non-IID Dirichlet(alpha) split of the training set and train a numpy softmax
regression for a few local epochs. Everything between local training and the next global model is
the code the deployed federation runs, called in the same order:
- coordinator: a `Coordinator` built from an `ExperimentConfig` (no Grid): `model_message` builds
  each round's records (round config; the global model, or the downlink steps of
  `downlink_codec`), `update_pipeline()` decodes each update (`CodecStage`), then `check_update`,
  `WeightedMean` over the sites' sample counts (as `PlainRound.train`) and `coord.opt.step`, the
  `ServerOptimizer` (as `Coordinator.train_round`);
- site: `downlink.reconstruct` of the parsed model message (the relay's `receive_global` minus the
  reference file), then `client_app.encode_update` with the round's config record and the
  error-feedback state carried over, as the relay and the trainer service do;
- under secure aggregation: `secagg_site.values_vector` on the site, the crypto library's SecAgg+
  client and server for masking, unmasking and the weighted sum (`crypto.secagg.simulation.run_round`,
  the same `SecAggClient`/`SecAggServer` calls `SecAggRound` makes), `secagg_round.round_weights`,
  and `SecAggRound._layout` to put the mean back onto the round's shared random-k support.
What differs from a deployment: records are handed over in memory (no SuperLink, SuperNode or
ClientApp process); SecAgg stages are driven by `run_round` rather than by `SecAggRound` over
Flower messages; updates are not signed or sealed (that does not change their values); and
stochastic rounding is seeded per site so that runs are reproducible.
Used by tests/test_codecs_convergence.py and benchmarks/compression.py.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from threadpoolctl import threadpool_limits

from crypto.secagg import SecAggConfig, new_context
from crypto.secagg.simulation import run_round
from federation.coordinator.aggregate import WeightedMean
from federation.protocol.codecs import parse_codec
from federation.site.client_app import encode_update
from federation.config.schema import ExperimentConfig
from federation.coordinator.driver import Coordinator, Site
from federation.protocol.downlink_steps import DIGEST_KEY, RECORD, reconstruct
from federation.protocol.pipeline import RoundContext, check_update
from federation.coordinator.secagg_round import context_run_id, round_weights
from federation.site.secagg_mod import values_vector
from federation.protocol.payload_records import from_records, to_records


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

    BLAS is held to one thread: the matrices are tiny, and tests share a small machine.
    """
    with threadpool_limits(limits=1), tempfile.TemporaryDirectory(prefix="fedsim-") as workdir:
        return _run_fedavg(codec, workdir=workdir, **kwargs)


def _coordinator(workdir: str, model: dict, parts: list[np.ndarray], **federation) -> Coordinator:
    cfg = ExperimentConfig.model_validate({
        "federation": {"name": "fedsim", "evaluate": False, "quorum": 1, **federation},
        "sites": [{"id": f"site{s}", "partition": s} for s in range(len(parts))],
    })
    coord = Coordinator(None, cfg, workdir, 1, model)
    coord.sites = {s + 1: Site(s + 1, f"site{s}", int(p.size)) for s, p in enumerate(parts)}
    return coord


def _run_fedavg(
    codec: str | None,
    *,
    workdir: str,
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
) -> FedResult:
    """FedAvg with every site's delta sent through ``codec`` (``None``: uncompressed float32).

    ``secagg`` runs the secure-aggregation path (its clip is the codec's, or 1.0 for identity);
    ``downlink`` is the coordinator's ``downlink_codec``. Defaults (300 rounds of one local epoch,
    lr 0.5, batch 16) bring uncompressed FedAvg to ~97% test accuracy; one local epoch keeps
    client drift small, which is what top-k + error feedback is sensitive to.
    """
    x_train, x_test, y_train, y_test = load_data(seed)
    rng = np.random.default_rng(seed)
    parts = dirichlet_split(y_train, n_sites, alpha, rng)
    model = {"w": np.zeros((x_train.shape[1], 10), np.float32), "b": np.zeros(10, np.float32)}
    spec = codec or "identity"
    clip = float(spec.rsplit("clip=", 1)[1]) if "clip=" in spec else 1.0
    coord = _coordinator(workdir, model, parts, codec=spec, error_feedback=error_feedback, seed=seed,
                         downlink_codec=downlink, secagg=SecAggConfig(enabled=secagg, clip=clip))
    nodes = sorted(coord.sites)
    held: dict[int, tuple | None] = {n: None for n in nodes}
    states: dict[int, dict] = {n: {} for n in nodes}
    site_rngs = {n: np.random.default_rng([seed, n - 1]) for n in nodes}
    sent = down = down_dense = 0
    history = []
    for rnd in range(1, rounds + 1):
        content = coord.model_message(rnd, coord.fed.deadlines.round_s)
        updates = {}
        for node in nodes:  # the site: its relay, then local training, then the codec stage
            rd = content(node)
            glob = from_records(rd, "global", RECORD)
            if RECORD in rd.config_records:
                glob.arrays, digest = reconstruct(glob, held[node])
                held[node] = (digest, glob.arrays)
                coord.downlink.heard(node, {DIGEST_KEY: digest})  # as the reply's status reports it
            cfg = rd.config_records["config"]
            idx = parts[node - 1]
            local = _local_train(glob.arrays, x_train[idx], y_train[idx], local_epochs, lr, batch, l2, site_rngs[node])
            delta = {k: (local[k] - glob.arrays[k]).astype(np.float32) for k in model}
            ctx = RoundContext(coord.fed.name, coord.run_id, rnd, coord.sites[node].name, int(cfg["seed"]))
            payload, new_state, _ = encode_update(delta, states[node], cfg, ctx, site_seed=seed * 1000 + node)
            states[node] = new_state if new_state is not None else states[node]
            sent += payload.nbytes
            updates[node] = from_records(to_records(payload, "update", "update_meta"), "update", "update_meta")
        mean = _secagg_mean(coord, rnd, updates) if secagg else _plain_mean(coord, rnd, updates)
        coord.model = coord.opt.step(coord.model, mean)
        line = coord.downlink.round_metrics()
        down += sum(line["bytes"].values())
        down_dense += line["dense_bytes"]
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


def _plain_mean(coord: Coordinator, rnd: int, updates: dict) -> dict:
    """As `PlainRound.train`: decode through the coordinator's pipeline, check, weighted mean."""
    pipeline, mean = coord.update_pipeline(), WeightedMean()
    for node, payload in updates.items():
        site = coord.sites[node]
        payload = pipeline.decode(payload, RoundContext(coord.fed.name, coord.run_id, rnd, site.name,
                                                        coord.round_seed(rnd)))
        check_update(payload.arrays, coord.spec)
        mean.add(payload.arrays, site.num_examples)
    return mean.result()


def _secagg_mean(coord: Coordinator, rnd: int, updates: dict) -> dict:
    """As `SecAggRound`: mask each site's codec values, unmask the weighted sum, lay it out densely."""
    m, dense = coord.protocol._layout(coord, rnd)
    weights = round_weights({n: coord.sites[n].num_examples for n in updates}, coord.fed.secagg.max_weight)
    values = {n: values_vector(p) for n, p in updates.items()}
    assert all(v.shape == (m,) for v in values.values())
    ctx = new_context(context_run_id(coord.fed.name, coord.run_id), rnd)
    result = run_round(coord.fed.secagg, ctx, values, weights, seeds={n: 7919 * rnd + n for n in updates}).result
    mean = dense(result.decode())
    check_update(mean, coord.spec)
    return mean

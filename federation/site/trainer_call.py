"""The bare trainer call the ClientApp's mods wrap: the site's trainer as the ClientApp sees it.

In a deployment the trainer is the site trainer service (site_trainer/service.py): rank 0 serves
a local endpoint (gRPC over a Unix socket) and tensors travel through shared-memory hand-off files,
so this process never imports torch. Simulations and tests plug in any object with the same four
methods (`Trainer`), e.g. an in-process numpy trainer (federation/ops/inprocess.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from federation.protocol.codecs import Arrays
from federation.protocol.round_config import RoundConfig
from site_trainer import endpoint, handoff

NODE_CONFIG_HINT = "--node-config 'site-id=\"NAME\" trainer-socket=\"/path/to/trainer.sock\"'"


class TrainerFailed(RuntimeError):
    """The trainer could not be reached or refused the request; the text says which and why."""


@dataclass
class GlobalModel:
    """The round's global model as a hand-off file for the trainer, and what the reply's status
    reports about it (the downlink's model digest)."""

    handle: handoff.Handle
    temporary: bool  # a shared-memory copy to unlink after the trainer call
    status: dict = field(default_factory=dict)

    def arrays(self) -> Arrays:
        """The model, mapped in place (for trainers in this process)."""
        return handoff.map_arrays(self.handle)

    def release(self) -> None:
        """Unlink the file if it was a temporary copy (a downlink reference stays)."""
        if self.temporary:
            handoff.release(self.handle.path)


@dataclass
class TrainResult:
    """What local training returns: the update (weights or delta, per the round config), either as
    arrays (`update`, in-process trainers) or as the trainer's hand-off file (`source`, open after its
    unlink: the ClientApp streams it instead of holding it; then `update` is empty)."""

    update: Arrays
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    rank_digests: list[str] = field(default_factory=list)  # every rank's digest of its weights
    source: handoff.Reader | None = None
    # the trainer's data snapshot (site_trainer/data_digest.py), in its first answer after it
    # started: for the site's audit log only, never in the reply
    data_snapshot: dict | None = None

    def arrays(self) -> Arrays:
        """The update as arrays (read from `source` when the trainer gave a file: one copy)."""
        return self.update if self.source is None else {name: self.source[name] for name in self.source}

    def dense_bytes(self) -> int:
        """The update's size in bytes, without reading it."""
        if self.source is not None:
            return sum(e.nbytes for e in self.source.handle.entries)
        return sum(a.nbytes for a in self.update.values())

    def close(self) -> None:
        """Let go of the trainer's file (its memory goes back once nothing holds it open)."""
        if self.source is not None:
            self.source.close()


@dataclass
class EvalResult:
    """What an evaluation returns (metrics carry eval_loss, num_val_examples, maybe eval_accuracy)."""

    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    rank_digests: list[str] = field(default_factory=list)


class Trainer(Protocol):
    """The site's trainer: who it is, where its store lives, train and evaluate on a global model."""

    def info(self) -> dict:
        """At least `num_examples` and `ranks` (site discovery)."""

    def workdir(self) -> Path:
        """The site's workdir: its store (site_store.py) lives there."""

    def train(self, model: GlobalModel, config: RoundConfig) -> TrainResult:
        """Local training from `model`; raise TrainerFailed with a reason on failure."""

    def evaluate(self, model: GlobalModel, config: RoundConfig) -> EvalResult:
        """Evaluation of `model` on the site's held-out data."""

    # Optional: `export(timeout_s) -> handoff.Handle | None`, the exchanged tensors the trainer holds
    # now, as they travel, in a hand-off file the caller unlinks (None: it has none to show). At
    # discovery a site that already holds the coordinator's starting model is sent none in round 1
    # (downlink_mod.offer_held); a trainer without it gets the model.


class ServiceTrainer:
    """`Trainer` over the site trainer service's Unix-socket endpoint."""

    def __init__(self, socket: str):
        self.socket = socket

    @classmethod
    def from_node_config(cls, node_config) -> "ServiceTrainer":
        """The trainer named by the SuperNode's `trainer-socket` node config."""
        try:
            return cls(str(node_config["trainer-socket"]))
        except KeyError as err:
            raise RuntimeError(f"SuperNode started without node config {err}; start it with {NODE_CONFIG_HINT}") from None

    def _call(self, method: str, request: dict, timeout_s: float) -> dict:
        try:
            return endpoint.call(self.socket, method, request, timeout_s=timeout_s)
        except (endpoint.TrainerUnavailable, endpoint.TrainerError) as err:
            raise TrainerFailed(str(err)) from None

    def info(self) -> dict:
        """The service's Info answer."""
        return self._call("Info", {}, 30)

    def workdir(self) -> Path:
        """The workdir the service reports."""
        try:
            info = self.info()
        except TrainerFailed as err:
            raise TrainerFailed(f"cannot find the site's workdir for its store (downlink reference, codec "
                                f"residual): {err}") from None
        if not info.get("workdir"):
            raise TrainerFailed("the site trainer does not report its workdir; run the same sovereign-fl version on "
                                "the site as on the coordinator")
        return Path(info["workdir"])

    def export(self, timeout_s: float) -> handoff.Handle:
        """The exchanged tensors the trainer holds now (`Export`), in a hand-off file the caller
        reads and unlinks."""
        reply = self._call("Export", {"timeout_s": timeout_s}, timeout_s)
        try:
            return handoff.Handle.from_json(reply["model"])
        except (KeyError, TypeError, ValueError) as err:
            raise TrainerFailed(f"the trainer's export hand-off is unusable: {err}") from None

    def _request(self, model: GlobalModel, config: RoundConfig) -> dict:
        return {"round": config.round, "global": model.handle.to_json(), "config": config.model_dump(exclude_none=True),
                "timeout_s": config.deadline_s}

    def train(self, model: GlobalModel, config: RoundConfig) -> TrainResult:
        """Train; the update comes back as a hand-off file, held open here (and unlinked, unless the
        trainer owns it: then the open Reader's lock keeps the trainer from reusing it until the
        result is closed): it is read from the file a piece at a time (never mapped whole: its
        pages would count in this process's resident set)."""
        reply = self._call("Train", self._request(model, config), config.deadline_s)
        try:
            upd = handoff.Handle.from_json(reply["update"])
        except (KeyError, TypeError, ValueError) as err:
            raise TrainerFailed(f"the trainer's update hand-off is unusable: {err}") from None
        try:
            source = handoff.Reader(upd)  # stays readable after the unlink below
        except (OSError, ValueError) as err:
            raise TrainerFailed(f"cannot read the trainer's update hand-off: {err}") from None
        finally:
            if not upd.owned:  # a one-off file; the trainer's own files stay (the Reader locks it meanwhile)
                handoff.release(upd.path)
        return TrainResult({}, int(reply["num_examples"]), {k: float(v) for k, v in reply.get("metrics", {}).items()},
                           [str(d) for d in reply.get("rank_digests", [])], source=source,
                           data_snapshot=reply.get("data_snapshot"))

    def evaluate(self, model: GlobalModel, config: RoundConfig) -> EvalResult:
        """Evaluate on the site's held-out data."""
        reply = self._call("Evaluate", self._request(model, config), config.deadline_s)
        return EvalResult(int(reply["num_examples"]), {k: float(v) for k, v in reply.get("metrics", {}).items()},
                          [str(d) for d in reply.get("rank_digests", [])])

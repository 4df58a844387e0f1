"""How one round's updates reach the coordinator: the pluggable round protocol.

`PlainRound` collects each site's update, decodes it through the coordinator's pipeline (codec,
and later unsealing), checks it and folds it into a running weighted mean. A secure-aggregation
protocol implements the same `train` signature with its own stages and returns the same outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from federation.coordinator.aggregate import WeightedMean
from federation.protocol.pipeline import RoundContext, UpdateRejected, check_update
from federation.protocol.payload_records import from_records

if TYPE_CHECKING:
    from federation.coordinator.driver import Coordinator

Arrays = dict[str, np.ndarray]


@dataclass
class RoundOutcome:
    mean: Arrays | None  # the sample-weighted mean update of the usable sites
    count: int  # how many sites' updates are in it
    per_site: dict[str, dict] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # site -> reason
    bytes_up: int = 0
    bytes_down: int = 0
    extra: dict = field(default_factory=dict)  # protocol-specific metrics


class RoundProtocol(Protocol):
    def train(self, coord: "Coordinator", rnd: int, nodes: list[int]) -> RoundOutcome: ...


def site_metrics(reply) -> dict:
    """The per-site part of the round's metrics line, from a train reply."""
    st = reply.content.config_records["status"]
    m = dict(reply.content.metric_records.get("metrics", {}))
    out = {"loss": m.get("loss"), "samples": int(st["num_examples"]), "seconds": m.get("train_s"),
           "relay_s": m.get("relay_s"), "rank_digests": list(st.get("rank_digests", []))}
    for key in ("upload_bytes", "dense_bytes", "encode_s", "state_arrays_in"):
        if key in m:
            out[key] = m[key]
    return out


class PlainRound:
    """Updates travel decodable by the coordinator (compressed, signed; not masked)."""

    def train(self, coord: "Coordinator", rnd: int, nodes: list[int]) -> RoundOutcome:
        deadline = coord.fed.deadlines.round_s
        res = coord.exchange(nodes, "train", coord.model_message(rnd, deadline), deadline)
        out = RoundOutcome(None, 0, failed=dict(res.failed), bytes_down=res.bytes_down)
        mean = WeightedMean()
        pipeline = coord.update_pipeline()
        for name, reply in res.ok.items():
            out.bytes_up += coord.record_bytes(reply.content)
            try:
                payload = from_records(reply.content, "update", "update_meta")
                payload = pipeline.decode(payload, RoundContext(coord.fed.name, coord.run_id, rnd, name,
                                                                coord.round_seed(rnd)))
                check_update(payload.arrays, coord.spec)
                n = int(reply.content.config_records["status"]["num_examples"])
                if n <= 0:
                    raise UpdateRejected("bad_num_examples", f"num_examples is {n}")
                mean.add(payload.arrays, n)
            except UpdateRejected as err:
                coord.count_rejection(err.reason)
                out.failed[name] = f"rejected {err}"
                continue
            out.per_site[name] = site_metrics(reply)
        out.count = mean.count
        out.mean = mean.result() if mean.count else None
        out.extra["decode_s"] = sum(getattr(s, "decode_s", 0.0) for s in pipeline.stages)
        return out

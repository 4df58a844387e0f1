"""Payload ↔ Flower records. Arrays go into an ArrayRecord (Flower chunks them); metadata into a
ConfigRecord. numpy + flwr only: the ClientApp imports this."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from federation.protocol.pipeline import Payload


def to_records(payload: Payload, arrays_key: str = "arrays", meta_key: str = "meta") -> RecordDict:
    return RecordDict({
        arrays_key: ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in payload.arrays.items()}),
        meta_key: ConfigRecord(dict(payload.meta)),
    })


def from_records(rd: RecordDict, arrays_key: str = "arrays", meta_key: str = "meta") -> Payload:
    arrays = {k: v.numpy() for k, v in rd.array_records[arrays_key].items()} if arrays_key in rd.array_records else {}
    meta = dict(rd.config_records[meta_key]) if meta_key in rd.config_records else {}
    return Payload(arrays, meta)

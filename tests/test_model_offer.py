"""The round's model message for a site on the data path (the coordinator's memory at scale): the model's
.npy bytes are written into the offer file tensor by tensor (bulk_path.offer_arrays), and the message
and the blob are exactly those of serializing the model whole and offloading it, which is what a
site reached through Flower still gets."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from crypto.pki import CoordinatorBundle, provision
from federation.config.schema import ExperimentConfig
from federation.coordinator.bulk_grid import BulkGrid
from federation.coordinator.bulk_server import BulkServer
from federation.coordinator.driver import Coordinator
from federation.coordinator.strategy import Site
from federation.ops.inprocess import task_identity
from federation.ops.supervisor import free_port
from federation.protocol import message_keys as keys
from federation.protocol.bulk import REF_STYPE, Blob, BlobWriter, offload, refs
from federation.protocol.codecs.floats import bf16_bits
from federation.protocol.payload_records import to_records

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    provision(root, ["s0", "s1"], hosts=("127.0.0.1", "localhost"))
    return root


def _coordinator(tmp_path: Path, pki: Path, initial: dict[str, np.ndarray], direct: set[str]) -> Coordinator:
    cfg = ExperimentConfig.model_validate({
        "federation": {"name": "offer", "rounds": 1, "quorum": 1, "evaluate": False, "seed": 5},
        "sites": [{"id": "s0", "partition": 0}, {"id": "s1", "partition": 1}]})
    bundle = CoordinatorBundle.load(pki / "coordinator")
    server = BulkServer(bundle, tmp_path / "coord", f"127.0.0.1:{free_port()}")
    coord = Coordinator(None, cfg, tmp_path / "coord", 1, initial, lambda line: None, bundle, bulk=server)
    for node, name in ((1, "s0"), (2, "s1")):
        coord.sites[node] = Site(node, name, 10)
        coord.bulk.heard(name, ConfigRecord({"data_path": "direct" if name in direct else "flower: test"}))
    return coord


def _sent(coord: Coordinator, node: int, rd: RecordDict):
    """The train message to `node` as the grid pushes it (bulk_grid.py: large Arrays as references)."""
    message, _ = coord.messaging.message(node, rd, "train", 30.0, [])
    BulkGrid(None, coord.bulk, coord.site_name, coord.known_name).outgoing(message)
    return message


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"emb": rng.standard_normal((700, 600)).astype(np.float32),  # over the inline limit
            "half": bf16_bits(rng.standard_normal((900, 1000)).astype(np.float32)),  # bf16 words: rounded on the way
            "b": rng.standard_normal(50).astype(np.float32),  # stays inline
            "odd": rng.standard_normal((513, 517)).astype(np.float32)}  # chunks straddle tensors


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "flower"])
def test_the_message_is_the_one_serializing_the_model_whole_makes(tmp_path, pki, direct):
    coord = _coordinator(tmp_path, pki, _initial(), {"s0"} if direct else set())
    with task_identity(1):  # a Message is made only inside a Flower app's task
        sent = _sent(coord, 1, coord.model_message(1, 30.0)(1))
    # what the previous path sent: the whole serialized model, its large Arrays offloaded to one blob
    whole = to_records(coord.downlink.payload(1)[1], keys.GLOBAL, keys.DOWNLINK)
    expected = offload(RecordDict({keys.GLOBAL: whole.array_records[keys.GLOBAL]}))[1] if direct else whole
    got, want = sent.content.array_records[keys.GLOBAL], expected.array_records[keys.GLOBAL]
    assert list(got) == list(want) == list(_initial())
    for name in want:
        a, b = got[name], want[name]
        assert (a.dtype, tuple(a.shape), a.stype, bytes(a.data)) == (b.dtype, tuple(b.shape), b.stype, bytes(b.data)), name
    assert (sum(a.stype == REF_STYPE for a in got.values()) == 3) is direct
    assert (keys.BULK in sent.content.config_records) is direct  # the data path's settings, to a direct site
    if direct:
        (root, entries), = refs(sent.content).items()
        blob = coord.bulk.server.offered[root]
        old = Blob([whole.array_records[keys.GLOBAL][k].data for k in ("emb", "half", "odd")])
        assert (blob.root, blob.size, blob.digests) == (old.root, old.size, old.digests)
        assert Path(blob.path).read_bytes() == b"".join(bytes(old.piece(i)) for i in range(old.count))
        assert coord.downlink.round_metrics()["bytes"] == {"s0": sum(len(a.data) for a in whole.array_records[keys.GLOBAL].values())}
        path = Path(blob.path)
        coord.bulk.stage_over()
        assert not path.exists() and not coord.bulk.server.offered
    coord.bulk.server.stop()


def test_sites_on_both_paths_in_one_stage(tmp_path, pki):
    """s0 on the data path gets references, s1 through Flower the serialized model; the model's
    file is written once per stage and content."""
    coord = _coordinator(tmp_path, pki, _initial(), {"s0"})
    message = coord.model_message(1, 30.0)
    with task_identity(1):
        to_s0 = _sent(coord, 1, message(1)).content
        again = _sent(coord, 1, message(1)).content
        to_s1 = _sent(coord, 2, message(2)).content
    assert all(a.stype == REF_STYPE for k, a in to_s0.array_records[keys.GLOBAL].items() if k != "b")
    assert all(a.stype == "numpy.ndarray" for a in to_s1.array_records[keys.GLOBAL].values())
    assert refs(to_s0).keys() == refs(again).keys() and len(coord.bulk.server.offered) == 1
    assert len(list((tmp_path / "coord" / "bulk").iterdir())) == 1
    coord.bulk.server.stop()


def test_a_writer_that_cannot_write_leaves_nothing(tmp_path):
    with pytest.raises(OSError):
        BlobWriter(str(tmp_path / "missing" / "blob"))
    w = BlobWriter(str(tmp_path / "blob"), chunk=1 << 16)
    w.write(b"x" * 100_000)
    w.abort()
    assert not list(tmp_path.iterdir())


PROBE = """
import json, resource, socket, sys, tempfile
from pathlib import Path
import numpy as np
from flwr.app import ConfigRecord
from crypto.pki import CoordinatorBundle, provision
from federation.config.schema import ExperimentConfig
from federation.coordinator.bulk_grid import BulkGrid
from federation.coordinator.bulk_server import BulkServer
from federation.coordinator.driver import Coordinator
from federation.coordinator.strategy import Site
from federation.ops.inprocess import task_identity
from federation.protocol.malloc_policy import return_freed_tensors

def vm(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

return_freed_tensors()  # as the ServerApp does
tmp = Path(tempfile.mkdtemp(dir=sys.argv[1]))
provision(tmp / "pki", ["s0"], hosts=("127.0.0.1",))
bundle = CoordinatorBundle.load(tmp / "pki" / "coordinator")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
server = BulkServer(bundle, tmp / "coord", f"127.0.0.1:{port}")
cfg = ExperimentConfig.model_validate({"federation": {"name": "m", "rounds": 1, "quorum": 1, "evaluate": False},
                                       "sites": [{"id": "s0", "partition": 0}]})
rng = np.random.default_rng(0)
small = {"w": rng.standard_normal((300, 1000)).astype(np.float32)}
coord = Coordinator(None, cfg, tmp / "coord", 1, small, lambda line: None, bundle, bulk=server)
coord.sites[1] = Site(1, "s0", 10)
coord.bulk.heard("s0", ConfigRecord({"data_path": "direct"}))
identity = task_identity(1)  # a Message is made only inside a Flower app's task (kept: its exit restores)
identity.__enter__()
def sent(rd):  # the train message as the grid pushes it (bulk_grid.py)
    m, _ = coord.messaging.message(1, rd, "train", 30.0, [])
    BulkGrid(None, coord.bulk, coord.site_name, coord.known_name).outgoing(m)
    return m

sent(coord.model_message(1, 30.0)(1))  # imports and pools warm
coord.bulk.stage_over(); coord.downlink.forget_stage()
shapes = [(2048, 4096)] * 3 + [(1024, 1024)] * 6 + [(4096,)] * 4  # ~31M parameters
model = {f"t{i}": rng.standard_normal(s, dtype=np.float32) for i, s in enumerate(shapes)}
coord.model = model
base = vm("VmRSS")
m = sent(coord.model_message(1, 30.0)(1))
coord.downlink.forget_stage()
peak = vm("VmHWM")
print(json.dumps({"model": sum(a.nbytes for a in model.values()), "above": peak - base,
                  "offered": len(coord.bulk.server.offered)}))
coord.bulk.stage_over()
"""


def test_building_a_direct_sites_model_message_does_not_serialize_the_model():
    """Peak RSS of a fresh process while the round's model message for a direct site is built and
    offloaded, above the process holding its ~125 MB model: a window of chunks, not the model's
    serialized copy (the previous path: 1 x the model)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", PROBE, tmp], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["offered"] == 1 and got["model"] > 100e6
    assert got["above"] < 0.35 * got["model"], got

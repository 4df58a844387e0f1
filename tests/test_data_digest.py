"""A site's data snapshot digest (site_trainer/data_digest.py): the same bytes give the same digest,
any change of an example, a split or a file changes it, and what cannot be digested is said so."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from site_trainer import data_digest
from site_trainer.tasks.digits import Digits, DigitsOptions
from site_trainer.workload import Task, TaskContext, TaskData, TensorRows


def _ctx(partition: int, tmp_path: Path, seed: int = 0) -> TaskContext:
    return TaskContext(role="site", seed=seed, site="s", partition=partition, num_partitions=3, rank=0, world_size=1,
                       device=torch.device("cpu"), workdir=tmp_path, log=logging.getLogger("t"))


def _digits(partition: int, tmp_path: Path, seed: int = 0) -> tuple[Task, TaskData]:
    task = Digits(DigitsOptions(hidden=4), _ctx(partition, tmp_path, seed))
    return task, task.build_data()


def test_in_memory_examples_are_digested_by_their_bytes(tmp_path):
    task, data = _digits(0, tmp_path)
    digest, method = data_digest.task_digest(task, data)
    assert method == "tensors" and len(digest) == 64
    again = data_digest.task_digest(*_digits(0, tmp_path))
    assert again == (digest, "tensors")  # rebuilt from the same source: the same snapshot
    assert data_digest.task_digest(*_digits(1, tmp_path))[0] != digest  # another partition
    assert data_digest.task_digest(*_digits(0, tmp_path, seed=1))[0] != digest  # another deal of the images
    x, y = data.train.tensors
    x = x.clone()
    x[3, 5] += 1e-3  # one pixel of one example
    assert data_digest.task_digest(task, TaskData(TensorRows(x, y), data.val))[0] != digest
    # an example moved from training to validation is another snapshot, though the bytes are the same
    moved = TaskData(TensorRows(x[1:], y[1:]), TensorRows(torch.cat([x[:1], data.val.tensors[0]]),
                                                         torch.cat([y[:1], data.val.tensors[1]])))
    assert data_digest.task_digest(task, moved)[0] != data_digest.task_digest(
        task, TaskData(TensorRows(x, y), data.val))[0]
    # dtype and shape count: the same bytes read as other values are other examples
    flat = data_digest.tensors_digest([("train", [x.reshape(-1)])])
    assert flat != data_digest.tensors_digest([("train", [x])])


class TextTask(Task):
    reads_text = True

    @classmethod
    def text_files(cls, options, ctx):
        return [(p, "train") for p in sorted(Path(ctx.workdir).glob("*.txt"))]

    def build_model(self):
        return torch.nn.Linear(1, 1)

    def build_data(self):
        return TaskData(TensorRows(torch.zeros(1)))

    def loss(self, model, batch):
        return model.weight.sum()


def test_a_text_task_is_digested_by_its_files_wherever_they_are(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "one.txt").write_text("Bonjour, je m'appelle Claire.\n")
        (d / "two.txt").write_text("Guten Tag.\n")
    digest, method = data_digest.task_digest(TextTask(None, _ctx(0, a)), None)
    assert method == "text files"
    assert data_digest.task_digest(TextTask(None, _ctx(0, b)), None)[0] == digest  # a copy elsewhere
    (b / "two.txt").write_text("Guten Tag!\n")
    assert data_digest.task_digest(TextTask(None, _ctx(0, b)), None)[0] != digest  # one byte of one file
    (b / "two.txt").write_text("Guten Tag.\n")
    (b / "three.txt").write_text("")
    assert data_digest.task_digest(TextTask(None, _ctx(0, b)), None)[0] != digest  # one more (empty) file


class StreamTask(TextTask):
    reads_text = False

    def build_data(self):
        return TaskData(torch.utils.data.TensorDataset(torch.zeros(2)))


class DeclaredTask(StreamTask):
    def data_digest(self, data):
        return "table-snapshot-2026-11-29"


def test_data_the_framework_cannot_read_is_recorded_as_undeclared_unless_the_task_names_it(tmp_path):
    task = StreamTask(None, _ctx(0, tmp_path))
    digest, method = data_digest.task_digest(task, task.build_data())
    assert (digest, method) == (None, "undeclared")
    fields = data_digest.snapshot(digest, method, 2, 0)
    assert fields["digest"] == "" and fields["method"] == "undeclared" and "Task.data_digest" in fields["why"]
    own = DeclaredTask(None, _ctx(0, tmp_path))
    assert data_digest.task_digest(own, own.build_data()) == ("table-snapshot-2026-11-29", "task")
    assert data_digest.snapshot("table-snapshot-2026-11-29", "task", 2, 0) == {
        "digest": "table-snapshot-2026-11-29", "method": "task", "examples": 2, "val_examples": 0}


@pytest.mark.parametrize("size", [0, 1, 3 << 20])
def test_file_digest_is_the_files_sha256_and_follows_a_rewrite(tmp_path, size):
    import hashlib
    import os

    from site_trainer.text_data import file_digest

    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(size))
    assert file_digest(p) == hashlib.sha256(p.read_bytes()).hexdigest()
    p.write_bytes(os.urandom(size + 1))  # another size: read again, not the remembered digest
    assert file_digest(p) == hashlib.sha256(p.read_bytes()).hexdigest()


def test_the_hf_callback_names_a_datasets_dataset_by_its_fingerprints():
    """Without `data_digest=`, a Trainer's `datasets` datasets are named by their fingerprints (a
    hash of their source and every transform applied): another transform is another snapshot."""
    from types import SimpleNamespace

    datasets = pytest.importorskip("datasets")
    from site_trainer.hf_callback import FederatedCallback

    train = datasets.Dataset.from_dict({"text": ["Bonjour", "Guten Tag"]})
    ev = datasets.Dataset.from_dict({"text": ["Hallo"]})

    def fingerprint(train_ds, eval_ds):
        return FederatedCallback._dataset_fingerprint(SimpleNamespace(trainer=SimpleNamespace(
            train_dataset=train_ds, eval_dataset=eval_ds)))

    first = fingerprint(train, ev)
    assert first == f"datasets:{train._fingerprint}+{ev._fingerprint}"
    assert fingerprint(train, None) == f"datasets:{train._fingerprint}"
    assert fingerprint(train.map(lambda x: {"text": x["text"] + "!"}), ev) != first
    assert fingerprint([{"text": "a list"}], None) is None  # not a datasets Dataset: undeclared

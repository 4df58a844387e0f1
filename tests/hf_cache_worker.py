"""Worker for tests/test_hf_text_data.py, run under torchrun with 2 gloo ranks: the token cache
is built once per site, the other rank waits for it, errors reach every rank.

Not a test module: `python -m torch.distributed.run --nproc-per-node 2 tests/hf_cache_worker.py
MODEL_DIR DATA_DIR WORKDIR OUT_DIR`. Every rank writes OUT_DIR/rank<R>.json with, per case, how
many times it tokenized, the cache it opened, a digest of every sequence it can read, or the
error it raised.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from site_trainer import text_data
from group_exit import leave


class Explodes:
    """A document transform that fails on rank 0's build (the only rank that runs transforms)."""

    fingerprint = "explodes-v1"

    def __call__(self, path: str, text: str) -> str:
        raise RuntimeError(f"scrubber crashed on {Path(path).name}")


def run_case(corpus: text_data.Corpus, tokenizer, workdir: Path) -> dict:
    builds = []
    original = text_data.build_tokens

    def counted(*args, **kwargs):
        builds.append(1)
        return original(*args, **kwargs)

    text_data.build_tokens = counted
    try:
        cache = text_data.prepare(corpus, tokenizer, workdir, stall_s=60)
    except Exception as err:  # noqa: BLE001 - the test checks what each rank saw
        return {"error": f"{type(err).__name__}: {err}", "builds": len(builds)}
    finally:
        text_data.build_tokens = original
    seqs = cache.sequences("train", 32)
    digest = hashlib.sha256(b"".join(seqs[i].numpy().tobytes() for i in range(len(seqs)))).hexdigest()
    return {"builds": len(builds), "cache": str(cache.path), "sequences": len(seqs), "digest": digest}


def main(model_dir: str, data_dir: str, workdir: str, out_dir: str) -> None:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    files = [(p, None) for p in text_data.find_files([f"{data_dir}/*"])]
    work = Path(workdir)
    out = {
        "first": run_case(text_data.Corpus(files, val_fraction=0.2), tok, work),
        "again": run_case(text_data.Corpus(files, val_fraction=0.2), tok, work),
        "failing": run_case(text_data.Corpus(files, transforms=[Explodes()]), tok, work),
        # rank 1 looks in a directory rank 0 does not write: a workdir the nodes do not share
        "unshared": run_case(text_data.Corpus(files), tok, work if rank == 0 else work / f"elsewhere{rank}"),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    leave()  # group_exit.py


if __name__ == "__main__":
    main(*sys.argv[1:5])

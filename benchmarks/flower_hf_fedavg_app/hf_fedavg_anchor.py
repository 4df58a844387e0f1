"""Flower's FedAvg as shipped (train, then evaluate, every round) over a transformers ClientApp.

The ClientApp does what Flower's Hugging Face examples do: build the model, load the received
arrays into it, train `local-steps` steps of AdamW (a fresh optimiser each round) on the site's
own text, send every weight back; evaluate the received model on the site's validation text.
The site's text (node config `data-dir`: train/*.txt, val/*.txt) is tokenized as the sovereign-fl
hf-causal-lm task does (documents without special tokens, EOS after each, packed into windows of
seq-len + 1 tokens at a stride of seq-len), so both systems see the same token sequences.

The ServerApp records, per round, the wall-clock time (time.time()) at which the round's
evaluation was aggregated, the weighted eval loss, and the bytes of the train replies' arrays.
"""

from __future__ import annotations

import glob
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

client = ClientApp()
server = ServerApp()


def _model(model_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, torch_dtype=torch.float32)


def _windows(model_dir: str, data_dir: str, split: str, seq_len: int) -> torch.Tensor:
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids: list[int] = []
    for path in sorted(glob.glob(os.path.join(data_dir, split, "*.txt"))):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if text:
            ids += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    t = torch.tensor(ids, dtype=torch.long)
    n = max(0, (len(t) - 1) // seq_len)
    if n == 0:
        raise ValueError(f"data-dir {data_dir!r}: {len(t)} {split} token(s) under {split}/*.txt, fewer than seq-len + 1 "
                         f"= {seq_len + 1}")
    return torch.stack([t[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


def _received(msg: Message, context: Context, split: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model the message carries, loaded into a fresh build, and this site's `split` windows:
    what each of Flower's ClientApp processes does first, as its examples do."""
    cfg, node = context.run_config, context.node_config
    torch.set_num_threads(1)
    model = _model(str(cfg["model-dir"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return model, _windows(str(cfg["model-dir"]), str(node["data-dir"]), split, int(cfg["seq-len"]))


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


@client.train()
def train(msg: Message, context: Context) -> Message:
    cfg, node = context.run_config, context.node_config
    model, data = _received(msg, context, "train")
    rnd = int(msg.content["config"]["server-round"])
    g = torch.Generator().manual_seed(int(cfg["seed"]) * 1000 + rnd * 10 + int(node.get("partition-id", 0)))
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg["lr"]))
    model.train()
    losses = []
    bs = int(cfg["batch-size"])
    t0 = time.monotonic()
    for _ in range(int(cfg["local-steps"])):
        idx = torch.randint(len(data), (bs,), generator=g)
        loss = _loss(model, data[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"num-examples": int(len(data)), "train_loss": float(np.mean(losses)),
                                                      "train-s": time.monotonic() - t0})})
    return Message(content, reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model, data = _received(msg, context, "val")
    model.eval()
    total = 0.0
    t0 = time.monotonic()
    with torch.no_grad():
        for i in range(0, len(data), 8):
            b = data[i:i + 8]
            total += float(_loss(model, b)) * len(b)
    content = RecordDict({"metrics": MetricRecord({"num-examples": int(len(data)), "eval_loss": total / max(1, len(data)),
                                                      "eval-s": time.monotonic() - t0})})
    return Message(content, reply_to=msg)


def _slowest(replies, key: str) -> float | None:
    """The slowest site's seconds of its training (or evaluation) loop: a round's compute, for the
    benchmark's split of a round into link, compute and per-message cost."""
    got = [float(m.content["metrics"][key]) for m in replies if m.has_content() and key in m.content["metrics"]]
    return max(got) if got else None


class TimedFedAvg(FedAvg):
    """FedAvg unchanged; each round's evaluation time, loss and uplink array bytes recorded."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.rounds: dict[int, dict] = {}

    def aggregate_train(self, server_round, replies):  # type: ignore[no-untyped-def]
        replies = list(replies)
        up = sum(len(a.data) for m in replies if m.has_content() for a in m.content["arrays"].values())
        self.rounds[server_round] = {"bytes_up": up, "train_replies": len(replies), "train_done": time.time(),
                                     "train_s": _slowest(replies, "train-s")}
        return super().aggregate_train(server_round, replies)

    def aggregate_evaluate(self, server_round, replies):  # type: ignore[no-untyped-def]
        replies = list(replies)
        out = super().aggregate_evaluate(server_round, replies)
        self.rounds[server_round].update(time=time.time(), eval_loss=float(out["eval_loss"]) if out else None,
                                         eval_replies=len(replies), eval_s=_slowest(replies, "eval-s"))
        return out


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n = int(cfg["sites"])
    torch.manual_seed(int(cfg["seed"]))
    initial = ArrayRecord(_model(str(cfg["model-dir"])).state_dict())
    strategy = TimedFedAvg(min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n)
    t0 = time.time()
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=int(cfg["rounds"]), timeout=float(cfg["timeout"]))
    part = f"{cfg['out']}.part"  # renamed when whole: the benchmark reads the file as soon as it exists
    with open(part, "w") as f:
        json.dump({"start": t0, "rounds": strategy.rounds}, f)
    os.replace(part, str(cfg["out"]))

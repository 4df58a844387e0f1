"""Time to loss across wide-area links: Flower's own FedAvg against ours, each site behind a shaped link.

One run, side by side, per link (RATE/RTT, Mbit/s / ms; default 100/30 and 1000/10):
  (a) Flower: `flwr run` of benchmarks/flower_hf_fedavg_app: flwr.serverapp.strategy.FedAvg as
      shipped (train, then evaluate, every round) and a transformers ClientApp that fine-tunes the
      model the way Flower's examples do (every weight, a fresh AdamW each round, local steps of
      `--batch` sequences, every weight back as float32), once per local-step setting in
      `--flower-local-steps` (default 5, 30 and ours' step cap `--max-local-steps`), each `--rounds` rounds;
  (b) ours: `sovfl simulate`'s code (launcher.simulate) on the hf-causal-lm task, full fine-tuning,
      SecAgg+ on, `strategy: diloco` (outer Nesterov at the schema's defaults), compressed
      pseudo-gradients with error feedback, `overlap: true`, and `round_target_s` choosing each
      round's codec and local steps from the link probe's figures (the sites start at `--local-steps`),
      for a budget of `--ours-rounds` rounds.
Both: 3 sites (one rank each), the same Llama-style model built here from a config (random weights,
`--embd`, `--layers`, a byte-level BPE tokenizer trained on stdlib text), the same per-site split of
Python standard-library sources (train/ and val/ files per site), the same batch size and inner lr;
both deployments are real (SuperLink, one SuperNode per site, TLS, SuperNode
authentication). Each site's every connection to the coordinator (its SuperNode's to the SuperLink;
ours: also its data path) goes through its own ShapedLink (benchmarks/shaped_link: namespaces, tbf,
a delay line), checked with check(link) within 10% of nominal before use (the run stops otherwise).

Data: each site gets its own region of the stdlib sources, sized (`--text-kb 0`, the default) so that
the run that reads most (Flower's largest setting, or ours at its step cap for its round budget)
passes over a site's training text at most `--max-passes` times (default 1): a target set on a
data-limited plateau, where overfitting noise decides, measures nothing. The report's `data` says
the size, the tokenizer's bytes per token and the passes.

Target loss and anchor (benchmarks/_time_to_loss.py): the target is the lowest eval loss any Flower
setting reaches in its run (the sites' validation text, weighted by sequences, on the global model);
the anchor is the setting first at or below it, and every setting's best loss and time to the target
are reported (`anchor` in the report). Time to the target, on both sides: wall-clock seconds from the
moment the federation starts (Flower: the ServerApp calls strategy.start; ours: every site trainer
is ready and the SuperNodes start) to the FIRST evaluation at or below it, whatever the curve does
after, as the coordinator knows it (Flower: its strategy's aggregate_evaluate; ours: the driver's
line saying every site of round r+1 has evaluated round r's model, which the sites report on the
data path before their local steps (coordinator/evaluation.py EvalAnnouncer), else the round's
metrics line; the final evaluation with the last). If ours never reaches it, ours_s is `inf`. Ours
runs its whole round budget (the coordinator has no stop-at-loss); only the first crossing counts.
The same run also gives `held_*`: each evaluated model placed when the coordinator had it (Flower:
its round's fit aggregated; ours: its round's metrics line), not when its loss was known: ours
evaluates a model on the next round's train message, after that round's steps, where Flower spends
a separate evaluate message round on it; `held_speedup` compares the systems' training alone.
Bytes up: Flower (the anchor setting): the train replies' array bytes; ours: the metrics lines'
bytes_up (everything the sites sent the coordinator in the rounds, record headers included), both
summed over the run. Every round of every run is split into training, transfer and fixed cost
(`breakdown`); curves.csv has every curve against seconds and rounds; `ours_max_rise_pct` is the
largest rise of ours' eval loss from one evaluation to the next.

Needs root (network namespaces, tc). Not part of `make test`. The documented size (28,131,840
parameters, 112.5 MB float32), every Flower setting and enough text:

    python benchmarks/wan_time_to_loss.py --links 100/30 --embd 512 --layers 8 --vocab 8192 --seq-len 64 \
        --batch 4 --local-steps 30 --rounds 8 --flower-local-steps 5,30,{H} --ours-rounds 10 \
        --max-local-steps 60 --round-target-s 60

Results, with the load they were measured at: docs/benchmarks/wan_time_to_loss.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks._flower_deployment import run_anchor  # noqa: E402
from benchmarks._time_to_loss import (choose_anchor, passes, split_breakdown, text_bytes_per_site,  # noqa: E402
                                      time_to, tokens_read_per_site)
from benchmarks.shaped_link import ShapedLink, available, check  # noqa: E402
from federation.ops import launcher  # noqa: E402
from site_trainer.config import SiteConfig  # noqa: E402

ANCHOR_APP = Path(__file__).parent / "flower_hf_fedavg_app"
SITES = 3


def build_inputs(workdir: Path, args) -> tuple[Path, int, dict]:
    """The model directory and each site's train/ and val/ text; the parameter count; the data sizing
    (text per site, tokens the longest run reads, its passes over a site's training text)."""
    import hf_models
    from transformers import AutoTokenizer

    heads = max(1, args.embd // 64)
    model_dir = hf_models.tiny_llama(workdir / "model", hidden=args.embd, layers=args.layers, heads=heads,
                                     kv_heads=heads, context=2 * args.seq_len, vocab_size=args.vocab)
    from transformers import AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    # the most tokens a site reads: Flower's longest setting or ours at its step cap
    tokens = max([tokens_read_per_site(args.rounds, k, args.batch, args.seq_len) for k in flower_settings(args)]
                 + [tokens_read_per_site(args.ours_rounds or args.rounds, args.max_local_steps, args.batch,
                                         args.seq_len, args.overlap_max_steps_factor)])
    sample = hf_models.stdlib_text(max_bytes=200_000)
    bytes_per_token = len(sample) / len(AutoTokenizer.from_pretrained(model_dir)(sample)["input_ids"])
    per_site = args.text_kb * 1000 or text_bytes_per_site(tokens, bytes_per_token, args.max_passes)
    # each site its own region of the stdlib text: 8 train files and 1 validation file
    text = hf_models.stdlib_text(max_bytes=SITES * per_site + 1000)
    if len(text) < SITES * per_site:
        raise SystemExit(f"the stdlib text gives {len(text)} bytes, fewer than {SITES * per_site}: lower --text-kb, "
                         "or (with --text-kb 0) raise --max-passes or run fewer rounds or local steps")
    for s in range(SITES):
        chunk = text[s * per_site:(s + 1) * per_site]
        cut = int(len(chunk) * 0.9)
        train, val = chunk[:cut], chunk[cut:]
        d = workdir / "data" / f"site{s}"
        (d / "train").mkdir(parents=True, exist_ok=True)
        (d / "val").mkdir(parents=True, exist_ok=True)
        step = math.ceil(len(train) / 8)
        for i in range(8):
            (d / "train" / f"doc{i:02d}.txt").write_text(train[i * step:(i + 1) * step], encoding="utf-8")
        (d / "val" / "val.txt").write_text(val, encoding="utf-8")
    sizing = {"text_bytes_per_site": per_site, "bytes_per_token": round(bytes_per_token, 3),
              "max_tokens_read_per_site": tokens,
              "max_passes": round(passes(tokens, int(per_site * 0.9 / bytes_per_token)), 2)}
    return model_dir, n_params, sizing


def flower_settings(args) -> list[int]:
    """Flower's local-step settings: --flower-local-steps ({H}: ours' step cap, --max-local-steps)."""
    return sorted({int(x.format(H=args.max_local_steps)) for x in args.flower_local_steps.split(",")})


def our_config(path: Path, workdir: Path, model_dir: Path, args) -> Path:
    clip = args.secagg_clip
    cfg = {
        "federation": {
            "name": "wan-time-to-loss", "rounds": args.ours_rounds or args.rounds, "quorum": SITES,
            "update_kind": "delta", "evaluate": True, "seed": args.seed,
            "strategy": "diloco", "overlap": True, "error_feedback": True,
            "overlap_max_steps_factor": args.overlap_max_steps_factor,
            "codec": f"int8:clip={clip!r}", "downlink_codec": args.downlink_codec,
            "round_target_s": args.round_target_s,
            "link": {"probe_seconds": 0.5, "max_local_steps": args.max_local_steps,
                     "codecs": [c.format(clip=repr(clip)) for c in args.codecs.split(",")],
                     "min_local_steps": max(1, args.local_steps // 4)},
            "deadlines": {"connect_s": 300, "round_s": 1200, "evaluate_s": 600, "secagg_stage_s": 600,
                          "trainer_start_s": 600},
            "secagg": {"enabled": True, "threshold": 2, "clip": clip,
                       **({"max_weight": args.secagg_max_weight} if args.secagg_max_weight else {})},
        },
        "workload": {"task": "hf-causal-lm", "options": {
            "model_dir": str(model_dir), "data": str(workdir / "data" / "{site}" / "train" / "*.txt"),
            "val_data": str(workdir / "data" / "{site}" / "val" / "*.txt"), "seq_len": args.seq_len, "lora": None}},
        "sites": [{"id": f"site{i}", "ranks": 1, "partition": i, "local_steps": args.local_steps,
                   "batch_size": args.batch, "lr": args.lr, "optimizer": "adamw"} for i in range(SITES)],
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def run_flower(workdir: Path, data: Path, model_dir: Path, links: list[ShapedLink], args, local_steps: int) -> dict:
    """Flower's FedAvg at `local_steps` a round; each SuperNode dials the SuperLink through its site's link."""
    run_config = " ".join([
        f'model-dir="{model_dir}"', f"rounds={args.rounds}", f"sites={SITES}", f"local-steps={local_steps}",
        f"lr={args.lr!r}", f"batch-size={args.batch}", f"seq-len={args.seq_len}", f"seed={args.seed}", "timeout=1200"])
    sites = [SiteConfig(id=f"site{i}", partition=i) for i in range(SITES)]
    res = run_anchor(workdir, ANCHOR_APP, sites, run_config, 300 + args.rounds * 2400, database=False,
                     dial=lambda i, port: f"127.0.0.1:{links[i].forward(('127.0.0.1', port))}",
                     node_config=lambda i, s: {"data-dir": str(data / s.id), "partition-id": str(i)},
                     env={"OMP_NUM_THREADS": "1"})
    t0 = res["start"]
    ordered = [r for _, r in sorted(res["rounds"].items(), key=lambda kv: int(kv[0])) if r.get("eval_loss") is not None]
    # held: when the ServerApp had the model it then evaluated (round r's fit aggregated)
    return {"curve": [(r["time"] - t0, r["eval_loss"]) for r in ordered],
            "curve_rounds": [int(k) for k, r in sorted(res["rounds"].items(), key=lambda kv: int(kv[0]))
                             if r.get("eval_loss") is not None],
            "local_steps": local_steps, "held_curve": [(r["train_done"] - t0, r["eval_loss"]) for r in ordered],
            "bytes_up": sum(r["bytes_up"] for r in res["rounds"].values()), "rounds": res["rounds"], "start": t0}


def flower_breakdown(fl: dict, model_bytes: int, rate_mbit: float, rtt_ms: float) -> list[dict]:
    """Flower's rounds split into training, transfer and fixed cost (per-message cost: process start,
    imports, model load, Flower's delivery): transfer is the nominal time of its three model
    transfers per site in a round (train down, train up, evaluate down; the sites' links run in
    parallel) plus a round trip each; training is the slowest site's training and evaluation loops."""
    link_s = 3 * (model_bytes * 8 / (rate_mbit * 1e6) + rtt_ms / 1e3)
    out, prev = [], fl["start"]
    for key, r in sorted(fl["rounds"].items(), key=lambda kv: int(kv[0])):
        if "time" not in r:
            continue
        wall = r["time"] - prev
        prev = r["time"]
        compute = (r.get("train_s") or 0.0) + (r.get("eval_s") or 0.0)
        out.append({"round": int(key), **split_breakdown(wall, compute, link_s)})
    return out


def ours_breakdown(ours: dict, rate_mbit: float, rtt_ms: float) -> list[dict]:
    """Our rounds from their metrics lines: wall split into training (the slowest site's trainer seconds
    inside the round's calls), transfer (its data-path transfers, down and up) and fixed cost (the
    rest; where the updates travelled inline in Flower's messages, not on the data path, the nominal time
    of the slowest site's bytes up and its share of the bytes down, plus a round trip each way); also the
    seconds trained in the background (overlap: hidden behind the transfer) and the
    per-message cost (timing.message_cost: launch, startup, handler, return; the slowest site)."""
    out = []
    for m in ours["lines"]:
        sites = m.get("sites") or {}
        cost = (m.get("timing") or {}).get("message_cost") or {}
        worst = max(cost.values(), key=lambda c: c.get("total_s", 0.0), default={})
        measured = any("bulk_up_s" in v or "bulk_down_s" in v for v in sites.values())
        if measured:
            transfer = max((v.get("bulk_down_s", 0.0) + v.get("bulk_up_s", 0.0) for v in sites.values()), default=0.0)
        else:
            down = (m.get("bytes_down") or 0) / max(1, len(sites))
            transfer = max(((v.get("upload_bytes") or 0.0) + down for v in sites.values()), default=0.0) * 8 / (
                rate_mbit * 1e6) + 2 * rtt_ms / 1e3
        training = max((v.get("train_call_s") or 0.0 for v in sites.values()), default=0.0)
        out.append({
            "round": m["round"], **split_breakdown(m.get("round_s") or 0.0, training, transfer),
            "local_steps": (m.get("round_plan") or {}).get("local_steps"),
            "codec": (m.get("round_plan") or {}).get("codec"), "transfer": "measured" if measured else "nominal",
            "background_s": round(max((v.get("background_s") or 0.0 for v in sites.values()), default=0.0), 2),
            "idle_fraction": round(max((v.get("idle_fraction") or 0.0 for v in sites.values()), default=0.0), 3),
            "stages_s": {st["stage"]: st["seconds"] for st in (m.get("timing") or {}).get("stages", [])},
            "message_cost": {k: round(v, 2) for k, v in worst.items() if isinstance(v, (int, float))}})
    return out


def run_ours(workdir: Path, config: Path, links: list[ShapedLink]) -> dict:
    """Our federation; each site's SuperNode and data path through its site's link."""
    seen: list[tuple[float, str]] = []
    index = {f"site{i}": links[i] for i in range(SITES)}

    def progress(line: str) -> None:
        seen.append((time.time(), line))
        print(f"  [ours] {line}", flush=True)

    def tap(site: str, address: str) -> str:
        return f"127.0.0.1:{index[site].forward(_port(address))}"

    result = launcher.simulate(config, workdir / "ours", progress=progress, site_tap=tap)
    ready = [t for t, line in seen if "trainer ready" in line]
    t0 = max(ready) if ready else seen[0][0]
    lines = [json.loads(x) for x in (workdir / "ours" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    # when each round's line reached the progress log: the driver's `round N ...` summary line
    done: dict[int, float] = {}
    # when round r's train replies had brought their evaluation of round r-1's model (the driver says
    # so before the round's unmasking and aggregation): the loss is known from then on
    evaluated: dict[int, float] = {}
    for t, line in seen:
        for m in lines:
            if m["round"] not in done and line.startswith(f"round {m['round']}/"):
                done[m["round"]] = t
            if m["round"] not in evaluated and line.startswith(f"round {m['round']}: the model of round "):
                evaluated[m["round"]] = t
    curve, held = [], []
    for m in lines:
        t = done.get(m["round"])
        if t is None:
            continue
        if "eval_loss" in m:
            curve.append((evaluated.get(m["round"], t) - t0, m["eval_loss"], m["eval_model_round"]))
            # held: when the coordinator had that model (its round's line; the initial model at the start)
            held.append((done[m["eval_model_round"]] - t0 if m["eval_model_round"] in done else 0.0, m["eval_loss"]))
        if "final_eval_loss" in m:
            curve.append((t - t0, m["final_eval_loss"], m["round"]))
            held.append((t - t0, m["final_eval_loss"]))
    plans = [m.get("round_plan") for m in lines]
    return {"curve": [(t, loss) for t, loss, _ in curve], "curve_rounds": [r for *_, r in curve], "held_curve": held,
            "bytes_up": sum(m.get("bytes_up", 0) for m in lines), "round_plans": plans,
            "links": lines[0].get("links") if lines else None, "result": result, "lines": lines,
            "idle_fraction": [{k: v.get("idle_fraction") for k, v in m.get("sites", {}).items()} for m in lines]}


class LoadSampler:
    """The machine's 1-minute load average every 5 s while one side runs: the two sides run one after
    the other on a machine shared with other jobs, so each side's figure says what it ran against."""

    def __init__(self):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "LoadSampler":
        self.start = os.getloadavg()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end = os.getloadavg()

    def summary(self) -> dict:
        s = self.samples or [self.start[0]]
        return {"start": self.start, "end": self.end, "mean_1min": round(sum(s) / len(s), 2), "max_1min": max(s)}


def settled_steps(plans: list) -> int | None:
    """The local steps ours settles on: the median of its rounds' planned local steps."""
    steps = sorted(p["local_steps"] for p in plans if p and p.get("local_steps"))
    return steps[len(steps) // 2] if steps else None


def run_link(workdir: Path, model_dir: Path, n_params: int, rate: float, rtt: float, args) -> tuple[dict, str]:
    """Flower at each setting, then ours, on one link; the link's report entry and its RESULT line."""
    key = f"{rate:g}/{rtt:g}"
    entry: dict = {}
    with contextlib.ExitStack() as stack:
        links = [stack.enter_context(ShapedLink(rate, rtt)) for _ in range(SITES)]
        checks = []
        for i, ln in enumerate(links):
            m = check(ln)
            off = m.within(rate, rtt)
            print(f"# link {key} site{i}: up {m.up_mbit:.1f} down {m.down_mbit:.1f} Mbit/s RTT {m.rtt_ms:.1f} ms"
                  f"{' OFF: ' + '; '.join(off) if off else ''}", flush=True)
            if off:
                raise SystemExit(f"cannot run: link {key} site{i} is not as asked: {'; '.join(off)}")
            checks.append(vars(m))
        entry["checks"] = checks
        wd = workdir / key.replace("/", "-")
        entry["flower"] = {}
        for steps in [] if args.skip_flower else flower_settings(args):
            t = time.monotonic()
            with LoadSampler() as load:
                fl = run_flower(wd / f"flower-{steps}", workdir / "data", model_dir, links, args, steps)
            fl["load"] = load.summary()
            fl["breakdown"] = flower_breakdown(fl, 4 * n_params, rate, rtt)
            entry["flower"][steps] = fl
            print(f"# flower {key} local_steps={steps}: run {time.monotonic() - t:.0f}s; load {load.summary()}; "
                  f"curve {fl['curve']}", flush=True)
        anchor = choose_anchor({k: v["curve"] for k, v in entry["flower"].items()}) if entry["flower"] else None
        if anchor:
            entry["anchor"] = vars(anchor)
            print(f"# flower {key}: target {anchor.target} (the lowest loss any setting reached); anchor "
                  f"local_steps={anchor.local_steps} at {anchor.seconds:.1f}s; every setting {anchor.per_setting}",
                  flush=True)
        if not args.skip_ours:
            t = time.monotonic()
            wd.mkdir(parents=True, exist_ok=True)
            with LoadSampler() as load:
                entry["ours"] = run_ours(wd, our_config(wd / "ours.yaml", workdir, model_dir, args), links)
            entry["ours"]["load"] = load.summary()
            print(f"# ours {key}: run {time.monotonic() - t:.0f}s; load {load.summary()}; "
                  f"curve {entry['ours']['curve']}", flush=True)
    fl = entry["flower"].get(anchor.local_steps) if anchor else None
    ours = entry.get("ours")
    target = anchor.target if anchor else None
    flower_s = anchor.seconds if anchor else math.nan
    if ours and ours["curve"]:
        ours_s = time_to(ours["curve"], target) if target is not None else ours["curve"][-1][0]
    else:
        ours_s = math.nan
    # the same with each evaluated model placed when it was made, not when its loss was known
    held_flower = time_to(fl["held_curve"], target) if fl else math.nan
    held_ours = time_to(ours["held_curve"], target) if ours and ours["curve"] and target is not None else math.nan
    for steps, f in entry["flower"].items():
        for b in f["breakdown"]:
            print(f"# flower {key} local_steps={steps} round {b['round']}: {b['round_s']}s = training "
                  f"{b['training_s']}s (slowest site's train + eval loops) + transfer {b['transfer_s']}s (nominal) "
                  f"+ fixed {b['fixed_s']}s", flush=True)
    if ours:
        ours["breakdown"] = ours_breakdown(ours, rate, rtt)
        for b in ours["breakdown"]:
            print(f"# ours {key} round {b['round']}: {json.dumps(b)}", flush=True)
        ours.pop("lines", None)
        ours["settled_local_steps"] = settled_steps(ours["round_plans"])
        evals = [loss for _, loss in ours["curve"]]
        ours["max_rise_pct"] = round(max((100 * (b - a) / a for a, b in zip(evals, evals[1:])), default=0.0), 2)
        if anchor and ours["settled_local_steps"] not in entry["flower"]:
            print(f"# NOTE: ours settled on {ours['settled_local_steps']} local steps, a setting Flower did not run "
                  f"(--flower-local-steps)", flush=True)
    entry.update(target_loss=target, flower_s=flower_s, ours_s=ours_s, held_flower_s=held_flower,
                 held_ours_s=held_ours, ours_final_loss=ours["curve"][-1][1] if ours and ours["curve"] else None)
    speedup = flower_s / ours_s if ours_s and not math.isnan(ours_s) else math.nan
    line = (f"RESULT link={key} flower_s={flower_s:.1f} ours_s={ours_s:.1f} speedup={speedup:.2f} "
            f"flower_local_steps={anchor.local_steps if anchor else 'none'} target={target} "
            f"ours_bytes_up={ours['bytes_up'] if ours else 0} flower_bytes_up={fl['bytes_up'] if fl else 0} "
            f"ours_max_rise_pct={ours['max_rise_pct'] if ours else 'none'} "
            f"held_flower_s={held_flower:.1f} held_ours_s={held_ours:.1f} "
            f"held_speedup={held_flower / held_ours if held_ours else math.nan:.2f}")
    print(f"# {key}: target loss {target}; ours final loss {entry['ours_final_loss']}", flush=True)
    return entry, line


def write_curves(path: Path, report: dict) -> None:
    """Every curve against seconds and rounds: link, system (flower-<local steps> or ours), round, seconds, loss."""
    with open(path, "w") as f:
        f.write("link,system,kind,round,seconds,eval_loss\n")
        for key, entry in report["links"].items():
            runs = [(f"flower-{k}", v) for k, v in entry.get("flower", {}).items()]
            runs += [("ours", entry["ours"])] if entry.get("ours") else []
            for system, run in runs:
                for kind in ("curve", "held_curve"):
                    for r, (t, loss) in zip(run.get("curve_rounds", []), run.get(kind, [])):
                        f.write(f"{key},{system},{kind},{r},{t:.2f},{loss:.6f}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", default="100/30,1000/10", help="RATE/RTT,... (Mbit/s / ms)")
    ap.add_argument("--rounds", type=int, default=10, help="Flower's rounds, at every setting")
    ap.add_argument("--flower-local-steps", default="5,30,{H}", help="Flower's local-step settings; the fastest to "
                    "the lowest loss any of them reaches is the anchor ({H}: --max-local-steps)")
    ap.add_argument("--ours-rounds", type=int, default=0, help="our round budget (default: --rounds)")
    ap.add_argument("--embd", type=int, default=512, help="hidden size (512 with 8 layers, vocab 8192: ~30M parameters)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--local-steps", type=int, default=20, help="ours: round 1's local steps; then chosen")
    ap.add_argument("--max-local-steps", type=int, default=200, help="ours: the most local steps a round is given")
    ap.add_argument("--lr", type=float, default=3e-4, help="inner AdamW learning rate (both)")
    ap.add_argument("--round-target-s", type=float, default=30.0, help="ours: federation.round_target_s")
    ap.add_argument("--codecs", default="int8:clip={clip},randk:0.1+int8:clip={clip},randk:0.01+int8:clip={clip}",
                    help="ours: the ladder round_target_s chooses from (link.codecs), least lossy first; {clip} is "
                         "--secagg-clip. Dense is left out: the pseudo-gradients always travel compressed")
    ap.add_argument("--downlink-codec", default="int8", help="ours: federation.downlink_codec (the global model's "
                    "steps to the sites; 'identity': the dense model every message, as Flower sends it)")
    ap.add_argument("--secagg-clip", type=float, default=0.05, help="ours: SecAgg+'s clip (and the int8 codecs')")
    ap.add_argument("--overlap-max-steps-factor", type=float, default=1.0, help="ours: "
                    "federation.overlap_max_steps_factor (background steps until the next request, up to this x the "
                    "round's local steps)")
    ap.add_argument("--secagg-max-weight", type=int, default=0, help="ours: secagg.max_weight (0: its default); "
                    "smaller weights make the ring narrower (fewer bytes up), the sites' weights rounded to that many levels")
    ap.add_argument("--text-kb", type=int, default=0, help="kB of stdlib text per site (90%% train, 10%% val); "
                    "0 (default): enough that the longest run passes over a site's training text --max-passes times")
    ap.add_argument("--max-passes", type=float, default=1.0, help="with --text-kb 0: the most passes any run makes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-flower", action="store_true", help="ours only (no target: ours_s is the last round's time)")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    why = available()
    if why:
        print(f"cannot run: {why}")
        return 2
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="wan-ttl-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir, n_params, sizing = build_inputs(workdir, args)
    print(f"# {SITES} sites, Llama-style model {n_params:,} parameters ({4 * n_params / 1e6:.1f} MB float32), "
          f"full fine-tuning; data {sizing}; Flower's settings {flower_settings(args)}; workdir {workdir}", flush=True)
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "parameters": n_params, "data": sizing,
                    "links": {}}
    results = []
    for spec in args.links.split(","):
        rate, rtt = (float(x) for x in spec.split("/"))
        entry, line = run_link(workdir, model_dir, n_params, rate, rtt, args)
        report["links"][f"{rate:g}/{rtt:g}"] = entry
        results.append(line)
        (workdir / "report.json").write_text(json.dumps(report, indent=1, default=str))
        write_curves(workdir / "curves.csv", report)
    print(f"# report: {workdir / 'report.json'}, curves: {workdir / 'curves.csv'}")
    for line in results:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`sovfl report RUN_DIR`: one self-contained HTML page about a run, from its metrics.jsonl.

Four figures, matplotlib PNGs embedded as data URIs (the page needs no other file and no network):
loss and accuracy per round (beside it, in runs where sites train with `sites[].privacy`, each
such site's epsilon spent against rounds, with its budget); bytes up and down per site and round; compression ratios (uplink
and downlink) per round; and a stacked breakdown of each round's wall time from the `timing`
the coordinator writes into every metrics line:

  site work     the slowest site's trainer calls (evaluate + train)
  relay         that site's ClientApp time beyond its trainer calls (mods, codec, masking)
  push          handing the round's messages to the SuperLink
  aggregation   folding replies in (decode, verify, unmask), the server optimizer
  checkpoint    writing the global model
  waits         the rest: messages in flight through Flower (SuperNode polling, one ClientApp
                process per message), site start-up, deadlines

Runs that measure their links (`federation.link.probe`) get a table of each site's figures
(RTT, throughput up and down, the path measured), and runs with `federation.round_target_s` a
table of every round's codec and local steps with the reason.

`sovfl simulate` writes the report at the end of a run and prints its path. A figure without any
data is left out with a line saying why, never drawn empty; each figure carries the number of
points it shows (`data-points`).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
from collections.abc import Iterable
from pathlib import Path

REPORT = "report.html"
PARTS = ("site work", "relay", "push", "aggregation", "checkpoint", "waits")


class ReportError(ValueError):
    """The run directory holds nothing a report can be made of; the message says what is missing."""


def read_metrics(run_dir: Path) -> list[dict]:
    """The metrics lines of a run (a line that does not parse is skipped and named)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ReportError(f"{path} does not exist: give the run directory of `sovfl simulate` or "
                          "`sovfl coordinator` (it holds metrics.jsonl)")
    lines = []
    for i, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            print(f"sovfl report: {path}:{i} is not JSON; skipped")
            continue
        if isinstance(line, dict) and isinstance(line.get("round"), int):
            lines.append(line)
    if not lines:
        raise ReportError(f"{path} holds no round yet: the run has not finished a round")
    return lines


def time_breakdown(line: dict) -> dict[str, float]:
    """A round's wall time split into PARTS (seconds; they add up to round_s). Push, aggregation
    and checkpoint are the coordinator's own intervals; the rest of the round it waited, and the
    slowest site's work and relay are carved out of that wait (they happen while it waits)."""
    t = line.get("timing") or {}
    stages = t.get("stages") or []
    parts = {
        "push": sum(float(s.get("push_s") or 0.0) for s in stages),
        "aggregation": sum(float(s.get("receive_s") or 0.0) + float(s.get("aggregate_s") or 0.0) for s in stages)
        + float(t.get("optimizer_s") or 0.0),
        "checkpoint": float(t.get("checkpoint_s") or 0.0),
    }
    total = float(line.get("round_s") or t.get("round_s") or 0.0)
    rest = max(0.0, total - sum(parts.values()))
    work = float(t.get("site_work_s") or 0.0)
    parts["site work"] = min(work, rest)
    parts["relay"] = min(max(0.0, float(t.get("relay_s") or 0.0) - work), rest - parts["site work"])
    parts["waits"] = rest - parts["site work"] - parts["relay"]
    return {p: parts[p] for p in PARTS}


def _series(lines: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Loss and accuracy per round: the sites' mean train loss (weighted by samples) and the
    evaluation figures the coordinator recorded."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in lines:
        rnd, sites = line["round"], line.get("sites") or {}
        pairs = [(s.get("loss"), s.get("samples") or 1) for s in sites.values() if isinstance(s.get("loss"), (int, float))]
        if pairs:
            out.setdefault("train loss (sites' mean)", []).append(
                (rnd, sum(v * w for v, w in pairs) / sum(w for _, w in pairs)))
        for key, label in (("eval_loss", "eval loss"), ("eval_accuracy", "eval accuracy"),
                           ("final_eval_loss", "final eval loss"), ("final_eval_accuracy", "final eval accuracy")):
            v = line.get(key)
            if isinstance(v, (int, float)):  # eval_*: the model the round received (that of the round before)
                x = line.get("eval_model_round", rnd) if key.startswith("eval_") else rnd
                out.setdefault(label, []).append((x, float(v)))
    return out


def privacy_series(lines: list[dict]) -> list[tuple[str, list[tuple[int, float]], dict]]:
    """Each DP site's epsilon spent after every round it trained (`dp_epsilon` in its part of the
    metrics line), and its budget (`dp_epsilon_budget`) as a dashed line."""
    names = sorted({n for line in lines for n, s in (line.get("sites") or {}).items()
                    if isinstance((s or {}).get("dp_epsilon"), (int, float))})
    out = []
    for name in names:
        site = lambda line, key: ((line.get("sites") or {}).get(name) or {}).get(key)  # noqa: E731
        out.append((f"{name} epsilon", _points(lines, lambda line: site(line, "dp_epsilon")), {"marker": "o"}))
        budget = _points(lines, lambda line: site(line, "dp_epsilon_budget"))
        if budget:
            out.append((f"{name} budget", budget, {"linestyle": ":"}))
    return out


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _points(lines: list[dict], get) -> list[tuple[int, float]]:
    """(round, value) where `get(line)` is a number."""
    pts = [(line["round"], get(line)) for line in lines]
    return [(r, float(v)) for r, v in pts if isinstance(v, (int, float))]


def _line_figure(plt, title: str, ylabel: str, series: list[tuple[str, list[tuple[int, float]], dict]]):
    """(title, data points, PNG or None) of one line plot over rounds."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    n = 0
    for label, pts, style in series:
        if pts:
            ax.plot([r for r, _ in pts], [v for _, v in pts], label=label, **style)
            n += len(pts)
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    if n:
        ax.legend(fontsize=8)
    png = _png(fig) if n else None
    plt.close(fig)
    return title, n, png


def figures(lines: list[dict]) -> list[tuple[str, int, str | None]]:
    """(title, data points, base64 PNG or None when there is no data) for each figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    rounds = [line["round"] for line in lines]

    series = _series(lines)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    acc_ax, n = None, 0
    for label, pts in series.items():
        target = ax
        if "accuracy" in label:
            acc_ax = acc_ax or ax.twinx()
            target = acc_ax
        target.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                    linestyle="--" if "accuracy" in label else "-")
        n += len(pts)
    ax.set_xlabel("round (evaluations: the model of that round)")
    ax.set_ylabel("loss")
    if acc_ax is not None:
        acc_ax.set_ylabel("accuracy")
    handles = [h for a in (ax, acc_ax) if a is not None for h in a.get_legend_handles_labels()[0]]
    if handles:
        fig.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=8)
    out.append(("Loss and accuracy per round", n, _png(fig) if n else None))
    plt.close(fig)
    privacy = privacy_series(lines)
    if privacy:  # only runs with sites[].privacy on: other runs have no such figure at all
        out.append(_line_figure(plt, "Privacy: epsilon spent per site", "epsilon (at the site's delta)", privacy))

    names = sorted({name for line in lines for name in (line.get("sites") or {})})
    traffic = []
    for name in names:
        traffic.append((f"{name} up", _points(lines, lambda line: ((line.get("sites") or {}).get(name) or {})
                                              .get("upload_bytes")), {"marker": "o"}))
        traffic.append((f"{name} down", _points(lines, lambda line: ((line.get("downlink") or {}).get("bytes") or {})
                                                .get(name)), {"marker": "x", "linestyle": "--"}))
    out.append(_line_figure(plt, "Bytes up and down per site", "bytes per message payload", traffic))
    out.append(_line_figure(plt, "Compression ratio", "compression ratio", [
        ("uplink (dense / sent)", _points(lines, lambda line: line.get("compression_ratio")), {"marker": "o"}),
        ("downlink (dense / sent)", _points(lines, lambda line: (line.get("downlink") or {}).get("ratio")),
         {"marker": "o"})]))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    breakdown = [time_breakdown(line) for line in lines]
    bottom = [0.0] * len(lines)
    n = 0
    for part in PARTS:
        vals = [b[part] for b in breakdown]
        ax.bar(rounds, vals, bottom=bottom, label=part)
        bottom = [a + v for a, v in zip(bottom, vals)]
        n += sum(1 for v in vals if v > 0)
    ax.set_xlabel("round")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8, ncol=3)
    out.append(("Round time breakdown", n, _png(fig) if any(bottom) else None))
    plt.close(fig)
    return out


def _table(lines: Iterable[dict]) -> str:
    rows = []
    for line in lines:
        b = time_breakdown(line)
        cells = [str(line["round"]), html.escape(str(line.get("status", ""))), f"{line.get('round_s', 0.0):.2f}",
                 *(f"{b[p]:.2f}" for p in PARTS), str(max((line.get("messages") or {}).values(), default=""))]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("round", "status", "round s", *PARTS, "messages/site (run)"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def links_table(lines: list[dict]) -> str | None:
    """Each site's link figures as measured (`links` in the metrics lines, one row per measurement),
    None when the run measured none (federation.link.probe)."""
    seen: dict[tuple, dict] = {}
    for line in lines:
        for site, f in sorted((line.get("links") or {}).items()):
            if isinstance(f, dict):
                seen.setdefault((site, f.get("round"), f.get("path"), f.get("error")), f)
    if not seen:
        return None
    rows = []
    for (site, rnd, path, error), f in seen.items():
        cells = ([site, "", "", "", "", "", str(error)] if error else
                 [site, str(rnd), str(path), f"{f.get('rtt_ms', 0):.1f}", f"{f.get('up_mbit', 0):.1f}",
                  f"{f.get('down_mbit', 0):.1f}", "lower bound (byte cap)" if f.get("capped") else ""])
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("site", "before round", "path", "RTT ms", "up Mbit/s", "down Mbit/s",
                                              "note"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def plan_table(lines: list[dict]) -> str | None:
    """round_target_s's choice of every round (`round_plan`), None in runs without it."""
    rows = []
    for line in lines:
        p = line.get("round_plan")
        if not isinstance(p, dict):
            continue
        compute = p.get("compute_s")
        cells = [str(line["round"]), str(p.get("codec")), str(p.get("local_steps") or "sites' own"),
                 str(p.get("slowest") or ""), f"{p.get('transfer_s') or 0:.2f}",
                 "" if compute is None else f"{compute:.2f}", f"{line.get('round_s', 0.0):.2f}",
                 "yes" if p.get("fits") else "no", str(p.get("reason", ""))]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    if not rows:
        return None
    head = "".join(f"<th>{h}</th>" for h in ("round", "codec", "local steps", "slowest site", "transfer s (predicted)",
                                              "compute s (predicted)", "round s", "fits", "why"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def tracking_table(run_dir: Path) -> str | None:
    """The tracker runs the federation wrote (each party's tracking.json: the coordinator's in the
    run directory, the sites' under sites/ when they ran beside it), None when tracking was off."""
    rows = []
    for index in [run_dir / "tracking.json", *sorted(run_dir.glob("sites/*/tracking.json"))]:
        try:
            doc = json.loads(index.read_text())
        except (OSError, ValueError):
            continue
        for t in doc.get("trackers", []):
            cells = [str(doc.get("party", "")), str(t.get("tracker", "")), str(t.get("where", "")),
                     str(t.get("written", "")), str(t.get("dropped", ""))]
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    if not rows:
        return None
    head = "".join(f"<th>{h}</th>" for h in ("party", "tracker", "where", "records written", "records dropped"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def build_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's HTML report (default RUN_DIR/report.html); its path."""
    run_dir = Path(run_dir)
    lines = read_metrics(run_dir)
    parts = [f"<h1>sovereign-fl run: {html.escape(run_dir.name)}</h1>",
             f"<p>{len(lines)} round(s) from {html.escape(str(run_dir / 'metrics.jsonl'))}.</p>"]
    for title, n, png in figures(lines):
        if png is None:
            parts.append(f"<h2>{html.escape(title)}</h2><p>No data in this run's metrics for this figure.</p>")
        else:
            parts.append(f'<figure data-points="{n}"><h2>{html.escape(title)}</h2>'
                         f'<img alt="{html.escape(title)}" src="data:image/png;base64,{png}"></figure>')
    parts.append("<h2>Round times (seconds)</h2>" + _table(lines))
    links, plan = links_table(lines), plan_table(lines)
    if links is not None:
        parts.append("<h2>Links as measured (link probe)</h2>" + links)
    if plan is not None:
        parts.append("<h2>Codec and local steps chosen for the round target</h2>" + plan)
    tracked = tracking_table(run_dir)
    if tracked is not None:
        parts.append("<h2>Experiment tracking runs</h2>" + tracked)
    style = "body{font-family:sans-serif;max-width:60em;margin:auto}td,th{padding:2px 8px;text-align:right}"
    page = f"<!doctype html><html><head><meta charset='utf-8'><title>sovfl report</title><style>{style}</style>" \
           f"</head><body>{''.join(parts)}</body></html>"
    path = Path(out) if out else run_dir / REPORT
    path.write_text(page)
    return path


def report_after_run(run_dir: str | Path) -> str:
    """The line `sovfl simulate` prints at its end: the report's path, or why there is none (a
    report never fails a finished run)."""
    try:
        return f"report: {build_report(run_dir)}"
    except (ReportError, OSError) as err:
        return f"report: not written ({err})"


def cmd_report(args: argparse.Namespace) -> int:
    """`sovfl report RUN_DIR [--out FILE]`."""
    try:
        path = build_report(args.run_dir, args.out)
    except ReportError as err:
        print(f"sovfl report: {err}")
        return 2
    print(f"report: {path}")
    return 0


def register(sub) -> None:
    """Add `report` to the `sovfl` subcommands."""
    p = sub.add_parser("report", help="an HTML page of a run's metrics (loss, bytes, ratios, round times)")
    p.add_argument("run_dir", help="the run's directory (holds metrics.jsonl)")
    p.add_argument("--out", help="where to write the page (default: RUN_DIR/report.html)")
    p.set_defaults(fn=cmd_report)

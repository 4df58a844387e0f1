"""`sovfl report`: the HTML page from a run's metrics (the e2e check on a real run is in
test_codec_pipeline.py; here: the page from a real in-process coordinator's metrics, and errors)."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import sovfl
from federation.ops.report_cmd import PARTS, build_report, time_breakdown

PNG = b"\x89PNG\r\n\x1a\n"


def check_report(path: Path, figures: int) -> None:
    """The page holds `figures` figures, each an embedded PNG drawn from at least one data point."""
    page = path.read_text()
    found = re.findall(r'<figure data-points="(\d+)">.*?src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(found) == figures, page[:2000]
    for points, data in found:
        assert int(points) > 0
        assert base64.b64decode(data).startswith(PNG)
    assert "No data" not in page
    assert "http://" not in page and "https://" not in page  # self-contained


def test_report_from_an_in_process_run(tmp_path):
    """The real coordinator (SecAgg+ round strategy, evaluation at the start of train) writes the
    metrics; the report draws all four figures from them, and the time parts add up to the round."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks._fedsim import RUN_ID, coordinator, simulated_sites
    from federation.ops.inprocess import FunctionTrainer, task_identity

    model = {"w": np.zeros(300, np.float32)}

    def trainer(s: int) -> FunctionTrainer:
        return FunctionTrainer(lambda glob, config: ({"w": glob["w"] + np.float32(0.01 * (s + 1))},
                                                     {"loss": 1.0 / (1 + float(glob["w"].mean()))}),
                               50 + s, tmp_path / f"site{s}",
                               evaluate=lambda glob, config: {"loss": 1.0 - float(glob["w"].mean()),
                                                              "accuracy": 0.5 + float(glob["w"].mean())})

    with task_identity(RUN_ID):
        coord = coordinator(tmp_path, model, simulated_sites([trainer(s) for s in range(3)], 0),
                            codec="randk:0.5+int8:clip=0.5", rounds=3, evaluate=True,
                            secagg={"enabled": True, "clip": 0.5})
        for rnd in (1, 2, 3):
            coord.run_round(rnd)
    run = tmp_path / "coordinator"
    path = build_report(run)
    assert path == run / "report.html"
    check_report(path, figures=4)
    import json

    for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
        parts = time_breakdown(line)
        assert set(parts) == set(PARTS) and all(v >= 0 for v in parts.values())
        assert sum(parts.values()) == pytest.approx(line["round_s"], rel=1e-6, abs=1e-4)


def test_report_command_names_what_is_missing(tmp_path):
    proc = sovfl("report", str(tmp_path))
    assert proc.returncode == 2 and "metrics.jsonl" in proc.stdout and "does not exist" in proc.stdout
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    proc = sovfl("report", str(tmp_path))
    assert proc.returncode == 2 and "holds no round" in proc.stdout

"""TensorBoard: event files written with the `tensorboard` package's own writer (no TensorFlow,
no torch). Parameters go in as one text summary; tags as text too."""

from __future__ import annotations

import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tracking.tracker import Tracker


class TensorBoardOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    log_dir: str = Field("tensorboard", description="the event files' directory (relative: under the party's "
                                                    "workdir); point `tensorboard --logdir` at it")


class TensorBoardTracker(Tracker):
    """Scalars in event files under `log_dir/<party>`."""

    Options = TensorBoardOptions

    def open(self) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self.dir = self.run.workdir / Path(self.options.log_dir) / self.run.party
        self.dir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(self.dir))

    def log_metrics(self, metrics: dict[str, float], step: int, axis: str) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self.writer.add_event(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))

    def _text(self, tag: str, rows: dict[str, str]) -> None:
        from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        text = "\n".join(f"{k}: {v}" for k, v in sorted(rows.items())).encode()
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        tensor = TensorProto(dtype=7, string_val=[text], tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        self.writer.add_event(self._event(wall_time=time.time(), step=0, summary=self._summary(
            value=[self._summary.Value(tag=tag, metadata=meta, tensor=tensor)])))

    def log_params(self, params: dict[str, str]) -> None:
        self._text("config", params)

    def set_tags(self, tags: dict[str, str]) -> None:
        self._text("tags", tags)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def where(self) -> str:
        return str(self.run.workdir / Path(self.options.log_dir) / self.run.party)

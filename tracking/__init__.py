"""Experiment tracking: a run's figures written, live, to the trackers ML teams already use.

Each party (the coordinator, each site) writes to its own trackers (`config.TrackingConfig`):
TensorBoard, MLflow, Weights & Biases, or a user's plug-in (`tracker.Tracker`, entry point group
`sovereign_fl.trackers`). Writes are queued off the training path (`writer.BoundedWriter`), each
tracker in a helper process of its own by default (`process_tracker.py`, `child.py`): a tracker that
is slow or down never slows or fails a round; what it cannot take is dropped and counted. Imports neither torch nor flwr; a tracker's library is imported when the tracker opens,
never on the ClientApp's import path.
"""

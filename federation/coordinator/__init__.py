"""The coordinator's side: the ServerApp, the driver that runs rounds over Flower's Grid, the round
strategies (plain, SecAgg+), attested admission, evaluation, aggregation, checkpoints and the
downlink sender. Never imports federation.site or federation.ops (README.md)."""

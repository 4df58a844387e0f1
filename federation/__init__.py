"""Flower glue for sovereign-fl: ServerApp, ClientApp, strategies, config schema, CLI, launcher."""

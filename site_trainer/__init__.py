"""The site trainer service: a persistent torch.distributed trainer pool behind a local endpoint.

This package never imports flwr. Modules that the Flower relay imports (`endpoint`, `handoff`,
`config`) stay free of torch too; the workload interface (`workload`) and the session every
training loop uses (`session`) are the public API for users' code.
"""

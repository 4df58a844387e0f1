"""The site trainer service: a persistent torch.distributed trainer pool behind a local endpoint.

This package never imports flwr. Modules that the Flower relay imports (`endpoint_client`,
`handoff`, `protocol`) stay free of torch too.
"""

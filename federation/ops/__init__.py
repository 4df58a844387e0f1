"""Operator tools: the `sovfl` CLI, the process launcher (simulate, coordinator, site) and the
in-process federation that simulations and benchmarks run. The only place that joins the
coordinator's side and the site's (README.md)."""

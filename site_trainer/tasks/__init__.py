"""The built-in workloads, each an ordinary `site_trainer.workload.Task` registered as an entry point
of group `sovereign_fl.workloads` (pyproject.toml): nothing in the framework knows them by name."""

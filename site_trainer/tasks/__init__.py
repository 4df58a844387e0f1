"""Built-in tasks: ordinary `site_trainer.workload.Task` plug-ins, registered under the entry-point
group `sovereign_fl.workloads` exactly as a user's task would be."""

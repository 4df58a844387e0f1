"""Example sovereign-fl workload: credit-default risk from each bank's own loan records."""

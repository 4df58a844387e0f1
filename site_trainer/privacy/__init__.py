"""Record-level differential privacy of a site's training (`sites[].privacy`): DP-SGD and its budget.

`config.py` is torch-free (the schema imports it); `accountant.py`, `dp_sgd.py` and
`site_privacy.py` are the trainer's.
"""

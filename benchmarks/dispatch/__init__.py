"""A raw-kazoo model of one queue's delivery to K consumer processes (issue 26,
item 5): run it with ``benchmarks/dispatch_model.py``."""

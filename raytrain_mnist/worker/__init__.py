"""Code that runs inside Ray Train workers: the training loop, its progress feed and the
scoring worker. The only caller of the worker-side ``ray.train`` API; imports nothing from
``driver`` or ``serving``."""

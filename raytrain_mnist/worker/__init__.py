"""Code that runs inside Ray Train workers: the training loop, its optimizer and
checkpoints. Imports nothing from ``driver`` or ``serving``."""

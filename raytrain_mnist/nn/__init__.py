"""Plain PyTorch shared by every process: the model, the checkpoint format, the optimizer and
AMP, and scoring. No Ray: the workers, the driver and Serve's replicas all import it."""

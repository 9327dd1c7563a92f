"""Code that runs in the driver process: connecting to Ray, a run's storage and claim, the
trainer, tracking and plots. Library code: it logs, never prints."""

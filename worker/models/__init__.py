"""keepwarm.worker.models."""

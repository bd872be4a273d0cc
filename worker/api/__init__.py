"""keepwarm.worker.api."""

"""keepwarm.worker."""

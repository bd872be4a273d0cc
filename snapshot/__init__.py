"""keepwarm.snapshot."""

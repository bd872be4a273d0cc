"""keepwarm.daemon."""

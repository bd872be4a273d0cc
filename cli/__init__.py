"""keepwarm.cli."""

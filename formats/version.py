"""keepwarm's version: recorded in arena manifests, snapshots and `/version`; re-exported as `keepwarm.__version__`."""

__version__ = "0.1.0"

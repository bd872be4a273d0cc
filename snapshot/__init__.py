"""Snapshots: a serving state (model, quantization, adapters, server config) as a verified, content-addressed artifact.

Owns: the blob store (``store``), manifests (``manifest``), identities and digests (``identity``), create / restore /
inspect / diff (``create``, ``restore``, ``inspect``), archives for export and import (``archive``: bounded, path
checked), OCI push and pull (``oci``) and the node_exporter textfile (``textfile``).
May import: keepwarm.worker (server config), keepwarm.daemon (client, images), keepwarm.weights, keepwarm.formats;
only keepwarm.cli imports it (import-linter's layers).
"""

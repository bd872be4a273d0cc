"""Errors that more than one formats module raises (so neither has to import the other for them)."""

from __future__ import annotations


class QuantizationError(ValueError):
    """A scheme, shape or manifest entry that cannot be quantized / loaded; one-line message."""

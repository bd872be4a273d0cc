"""The CLI's error shape, shared by ``main`` and the command modules it registers (which ``main`` imports)."""

from __future__ import annotations

import typer


def fail(message: str, code: int = 1) -> None:
    """A one-line error on stderr and a non-zero exit."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)

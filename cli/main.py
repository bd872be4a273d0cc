"""The ``keepwarm`` command line (typer)."""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from keepwarm.cli import (
    bench_llamacpp,  # noqa: F401  (registers `bench llamacpp`)
    bench_lora,  # noqa: F401  (registers `bench lora`)
    bench_profile,  # noqa: F401  (registers `bench profile`)
    bench_serving,  # noqa: F401  (registers `bench restart` and `bench serving`)
    bench_snapshot,  # noqa: F401  (registers `bench snapshot`)
    bench_structured,  # noqa: F401  (registers `bench structured`)
    daemon_cmds,
    serve_cmd,
    snapshot_cmds,
)
from keepwarm.cli.bench import bench_app
from keepwarm.cli.errors import fail
from keepwarm.formats.version import __version__
from keepwarm.worker.sampling_params import SamplingParams

app = typer.Typer(help="Keep LLM weights warm in a daemon; serve them from restartable workers.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _add_subcommands() -> None:
    app.add_typer(bench_app, name="bench")
    daemon_cmds.register(app)
    serve_cmd.register(app)
    snapshot_cmds.register(app)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"keepwarm {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")] = "info",
) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)



@app.command()
def generate(
    prompt: Annotated[list[str] | None, typer.Argument(help="Prompt(s); each is sent as a user chat message.")] = None,
    model: Annotated[str | None, typer.Option(help="Model directory (default: bundled SmolLM2).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    temperature: Annotated[float, typer.Option()] = 0.0,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")] = False,
    dtype: Annotated[str, typer.Option()] = "auto",
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Generate without a server and print the text (attaches to a running daemon, else loads from disk)."""
    # deferred, these three: torch (~1.2 s), which `keepwarm --help` and the daemon commands must not pay
    from keepwarm.formats.model_config import ModelConfigError
    from keepwarm.worker.engine import RequestError  # deferred (above)
    from keepwarm.worker.llm import LLM  # deferred (above)

    prompts = prompt or ["What is the capital of France? Answer in one sentence."]
    try:
        llm = LLM(model=model, dtype=dtype, seed=seed)
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
        if raw:
            outs = llm.generate(prompts, params)
        else:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    except (ModelConfigError, RequestError, ValueError, FileNotFoundError) as e:
        fail(str(e))
        return
    for p, out in zip(prompts, outs, strict=True):
        typer.echo(f">>> {p}\n{out.outputs[0].text.strip()}\n")


@app.command()
def kernels() -> None:
    """Print this machine's CPU dispatch table: which kernel each op takes, by rows and instruction set, and why."""
    from keepwarm.kernels import describe  # deferred: torch, which the other commands may not need

    for line in describe().lines():
        typer.echo(line)


_add_subcommands()


def run() -> None:
    """The console script. vLLM's spellings of the serve flags (several values, underscores, ``--model``) are
    taken by the serve commands themselves (cli/serve_cmd.py's VllmCommand)."""
    app(args=sys.argv[1:], prog_name="keepwarm")


if __name__ == "__main__":
    run()

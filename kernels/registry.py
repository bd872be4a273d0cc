"""The kernel registry: kernel name x backend -> implementation, and which backend a call runs on.

Rules:
- The mode comes from env var KEEPWARM_KERNELS, read and checked once (at the first dispatch); from then on only
  `set_backend` changes it: a process picks its kernels at start (workers inherit the variable), and code that must
  switch in-process (tests, benchmarks) says so with `set_backend`, never by editing os.environ:
    auto   (default) triton when the input is on CUDA, triton is importable and the kernel has a triton impl;
           torch otherwise.
    torch  always the torch backend (kernels/cpu.py, quant.py: on the CPU the C kernels kernels/dispatch.py picks).
    triton always triton; a kernel without a triton impl raises KernelBackendError.
- Backends plug in through `register(name, backend, fn)` (keepwarm.kernels wires the torch and triton ones); each
  choice is logged once and cached per (kernel, device type) until `register` or `set_backend` changes it.
- This module imports no kernel: every kernel module may import it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BACKENDS", "ENV_VAR", "KernelBackendError", "get_impl", "impl", "register", "select_backend",
           "set_backend"]

logger = logging.getLogger("keepwarm.kernels")

ENV_VAR = "KEEPWARM_KERNELS"
BACKENDS = ("torch", "triton")
_MODES = ("auto", *BACKENDS)
# Checked once: find_spec walks sys.path, too slow for every kernel call.
_TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None

# kernel name -> backend -> implementation.
_IMPLS: dict[str, dict[str, Callable[..., Any]]] = {}
# The checked mode; None until the first dispatch reads KEEPWARM_KERNELS (or `set_backend` sets it).
_mode_now: str | None = None
# (kernel, backend) pairs already logged, so each choice is logged once rather than per call.
_LOGGED: set[tuple[str, str]] = set()
# (kernel, device type) -> the implementation get_impl chose: a decode step dispatches ~300 kernels, and choosing
# anew each time cost ~1 us apiece. Emptied by whatever can change a choice: register and set_backend.
_RESOLVED: dict[tuple[str, str], Callable[..., Any]] = {}


class KernelBackendError(RuntimeError):
    """The requested backend has no implementation of a kernel."""


def register(name: str, backend: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make `fn` the `backend` implementation of kernel `name` (replacing any previous one)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    _IMPLS.setdefault(name, {})[backend] = fn
    _RESOLVED.clear()
    return fn


def impl(name: str, backend: str) -> Callable[..., Any]:
    """The `backend` implementation of kernel `name` (KeyError where there is none)."""
    return _IMPLS[name][backend]


def _checked(raw: str | None, source: str) -> str:
    mode = (raw or "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{source}={mode!r} is not one of {_MODES}")
    return mode


def _mode() -> str:
    global _mode_now
    if _mode_now is None:
        _mode_now = _checked(os.environ.get(ENV_VAR), ENV_VAR)
    return _mode_now


def set_backend(mode: str | None) -> str | None:
    """Select the kernel mode ('auto', 'torch' or 'triton') for this process; None re-reads KEEPWARM_KERNELS at
    the next dispatch. Returns the previous setting (None if the environment had not been read yet), so callers
    can restore it."""
    global _mode_now
    previous = _mode_now
    _mode_now = None if mode is None else _checked(mode, "kernel backend")
    _RESOLVED.clear()
    return previous


def select_backend(name: str, device: torch.device) -> str:
    """The backend that `name` runs on for inputs on `device` under the current KEEPWARM_KERNELS."""
    impls = _IMPLS.get(name)
    if not impls:
        raise KeyError(f"no kernel named {name!r}; known: {sorted(_IMPLS)}")
    mode = _mode()
    if mode == "auto":
        use_triton = device.type == "cuda" and _TRITON_IMPORTABLE and "triton" in impls
        mode = "triton" if use_triton else "torch"
    if mode not in impls:
        raise KernelBackendError(
            f"{ENV_VAR} selects the {mode!r} backend, but kernel {name!r} has no {mode} implementation "
            f"(available: {sorted(impls)}); set {ENV_VAR}=auto to fall back per kernel"
        )
    return mode


def get_impl(name: str, device: torch.device) -> Callable[..., Any]:
    fn = _RESOLVED.get((name, device.type))
    if fn is not None:
        return fn
    backend = select_backend(name, device)
    if (name, backend) not in _LOGGED:
        _LOGGED.add((name, backend))
        logger.info("kernel %s: %s backend (device %s)", name, backend, device)
    fn = _RESOLVED[(name, device.type)] = _IMPLS[name][backend]
    return fn

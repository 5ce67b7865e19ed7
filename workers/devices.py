"""Whether a torch device exists here: checked once, before a model is built or an actor starts.

Holds ``check_device``: a one-line ``InputError`` for ``cuda``/``cuda:N``/``mps`` on a machine
without it (torch itself fails much later, with an AssertionError or a RuntimeError from deep
inside the first transfer, and a Ray actor failing that way would be replaced again and again).
"""

from __future__ import annotations

import torch

from classgrad.errors import InputError

__all__ = ["check_device"]


def check_device(device: str | torch.device) -> None:
    """Raise ``InputError`` unless ``device`` can be used on this machine."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"device {str(device)!r}: not a torch device ({exc})") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InputError(f"device {str(device)!r}: CUDA is not available on {_host()} (use cpu)")
        if dev.index is not None and dev.index >= count:
            raise InputError(f"device {str(device)!r}: {_host()} has {count} CUDA device(s), numbered from 0")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise InputError(f"device {str(device)!r}: MPS (Apple GPU) is not available on {_host()} (use cpu)")
    elif dev.type != "cpu":
        raise InputError(f"device {str(device)!r}: not supported (cpu, cuda, cuda:N or mps)")


def _host() -> str:
    import socket

    return f"this machine ({socket.gethostname()})"

"""Child processes this package starts (fleet replicas, tensor-parallel ranks):
a free loopback port for each, and no child left behind when its parent dies."""
from __future__ import annotations

import ctypes
import signal
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In a child (as ``preexec_fn``): SIGTERM when the parent dies (Linux).

    The signal follows the parent *thread* that started the child, so start
    children from a thread that lives as long as they should."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass

"""A free TCP port for each test that starts a server or a process group.

A fixed port (29517, or train.sbatch's 20000 + job id) is shared by every run on a machine: a
second CI job on the same host, or a process a killed test left behind, holds it, and the
rendezvous hangs or joins the wrong group. Each test asks the kernel for a port instead.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the kernel's pick, released on return)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

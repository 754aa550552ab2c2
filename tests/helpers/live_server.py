"""`python -m guided.serve` started by a test, on a free port, and stopped after."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

#: What clients of the shared server (conftest.py's ``server``) send.
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, key: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def post(url: str, body: bytes, key: str | None = None) -> tuple[int, dict, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read().decode()


def metric(base: str, name: str) -> float | None:
    """A sample's value from /metrics (the first line that starts with ``name``)."""
    for line in get(base + "/metrics")[1].splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


@contextlib.contextmanager
def running_server(*args: str, timeout: float = 180, command: list[str] | None = None,
                   cwd: str | None = None):
    """The base URL of a server started with ``args`` (``command``: another
    server than guided's, taking --port too; ``cwd``: where it runs); it is
    stopped on exit."""
    port = free_port()
    command = command or [sys.executable, "-m", "guided.serve", "--log-level", "warning"]
    proc = subprocess.Popen([*command, "--port", str(port), *args], cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}")
            try:
                if get(base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"server did not come up in {timeout:.0f} s")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def sdk_clients(model_path: str, *args: str):
    """(openai client, anthropic client, model id) of a server of ``model_path``."""
    import anthropic
    import openai
    with running_server("--model", model_path, "--kv-cache-tokens", "16384", "--api-key", "k", *args) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        yield client, anthropic.Anthropic(base_url=base, api_key="k", max_retries=0), \
            client.models.list().data[0].id

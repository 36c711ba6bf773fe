"""Fixtures shared by the tests: run directories and server processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests follow a run by its processes' log lines on the console, as ``asyncrl run -v``
# shows them; tests/integration/test_console.py checks the quiet default without it.
os.environ.setdefault("ASYNCRL_VERBOSE", "1")


@dataclass
class ServerProcess:
    """A server running in its own process, started by ``start_server``."""

    proc: subprocess.Popen[str]
    endpoint: str
    pid: int
    args: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> str:
        """Send ``sig``, wait for exit, return the rest of stdout."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=timeout)
        return out


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Every test starts from the same environment: a run started in-process sets variables
    (the agent's control secret, a trace directory) that would otherwise reach the processes of
    later tests, e.g. an echo server that then refuses a STOP without the secret."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def start_server_process(endpoint: str, *args: str) -> ServerProcess:
    """Start tests/helpers/echo_server.py and wait for its READY line (no sleeping)."""
    cmd = [sys.executable, "-m", "tests.helpers.echo_server", endpoint, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"server did not start: {line!r}")
    _, bound, pid = line.split()
    return ServerProcess(proc, bound, int(pid), list(args))


@pytest.fixture
def run_dir() -> Iterator[str]:
    """A short, private directory for sockets and files (ipc paths must stay short)."""
    path = tempfile.mkdtemp(prefix="arl-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def server_process(run_dir: str) -> Iterator[ServerProcess]:
    """An echo server in its own process on an ipc endpoint; stopped after the test."""
    server = start_server_process(f"ipc://{run_dir}/echo.sock", "--run", os.path.basename(run_dir))
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
    server.proc.communicate()

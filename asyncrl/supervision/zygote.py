"""The zygote: one pre-imported process per node that forks each restarted role incarnation.

A cold start costs an interpreter and its imports (torch, transformers, the role's module): 1-3 s.
The zygote pays them once. It is started by the supervisor after the run's first processes (``python
-m asyncrl.supervision.zygote``) with the environment most of them share (the run's ``run.env``),
imports torch and their roles' and program's modules (each role class's ``Role.preload`` runs once,
whatever its replicas), and then waits. Each restart of a Python role or of the driver asks it to
``fork()``; the child is the new incarnation, with everything already imported, and runs
``process.main`` as a cold start would.

Forking is safe only from a process with a single thread, no event loop, no zmq context and no
device: the zygote creates none of them (it pins OpenMP and BLAS to one thread while importing,
so that no BLAS pool starts), checks that it has exactly one thread before it says ``ready``,
and otherwise exits: the supervisor then keeps starting processes cold.

Each child, before it runs the role:

- leads a session and process group of its own (the supervisor, the agent's janitor and chaos
  kill it by that group, as they kill a cold-started one; the zygote answers a fork only once
  the child leads its group);
- gets the parent-death signal (SIGKILL) tied to the zygote, which has its own tied to the agent:
  nothing outlives the agent;
- closes the zygote's pipes, restores default signal handling, reads stdin from ``/dev/null``,
  writes stderr to its role's log file (stdout stays the agent's, as for a cold start), and
  replaces its environment with the one the supervisor gives (its threads and spec file);
- reseeds numpy's global random state (and sizes OpenBLAS's threads if ``threadpoolctl`` is
  installed);
- runs ``process.main``, which sets up logging, signals, its own zmq context and event loop,
  and ends as a cold process does: ``atexit`` handlers, logging's shutdown, stdio flushed.

The zygote is the child's parent, not the supervisor: it reaps each child (``waitpid``) and
reports its exit status over a pipe (``exited <pid> <status>``, the status as asyncio gives a
``returncode``: negative for a signal). A zygote that dies takes its children with it (their
parent-death signal); the supervisor then learns each child's end from the ``pidfd`` it opened
at the fork (reported as SIGKILL), starts processes cold, and starts a new zygote after
``ZYGOTE_BACKOFF_S`` (at most ``ZYGOTE_RESTARTS`` times a run).

External ``command:`` roles, and processes whose environment differs from the zygote's in more
than ``PER_PROCESS_ENV`` (a role's own ``env``), always start cold. ``ASYNCRL_ZYGOTE=0`` in the
agent's environment turns the zygote off.

Protocol: the zygote's stdin carries first the JSON list of what to import (``kind``,
``target``, ``config``, ``model``; each once), then requests, one JSON line each (``{"id",
"env", "stderr"}``); reports are lines on the pipe given by ``--report-fd``: ``ready``,
``unsafe <threads>``, ``forked <id> <pid>``, ``failed <id> <why>``, ``exited <pid> <status>``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import json
import logging
import os
import selectors
import signal
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any, NoReturn

import msgspec

from asyncrl.observe import logs
from asyncrl.safe_files import open_append

__all__ = ["PER_PROCESS_ENV", "AnyProcess", "ForkedProcess", "Launcher", "main"]

ZYGOTE_ENV = "ASYNCRL_ZYGOTE"
"""Set to ``0`` in the agent's environment to start every process cold."""
ZYGOTE_RESTARTS = 3
"""How many times a run starts a new zygote after one died; then processes start cold."""
ZYGOTE_BACKOFF_S = 1.0
"""Seconds between a zygote's death and the start of the next."""
FORK_TIMEOUT_S = 5.0
"""How long the supervisor waits for a fork's answer before it starts the process cold."""
PER_PROCESS_ENV = (
    "ASYNCRL_SPEC_FILE",
    "ASYNCRL_SECRET_FILE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "ASYNCRL_DIST_STORE",
    "ASYNCRL_DIST_PREFIX",
    "ASYNCRL_ZYGOTE_PARENT",
)
"""The only variables in which a forked process's environment may differ from its zygote's: its spec
file, the secret file and the store of a group spanning nodes (read at run time, not at import), its
thread counts (``process.set_threads`` applies them in the child), and its devices (the zygote
initialises no device: CUDA reads them in the child). Any other difference (``run.env`` or a role's
``env``: ``HF_HOME``, ``PYTHONPATH``, ``TORCH_HOME``...) may have been read by a module the zygote
imported, so such a process starts cold."""
PRELOAD: tuple[str, ...] = ("torch", "transformers.modeling_utils", "asyncrl.supervision.process")
PRELOAD += ("asyncrl.dispatch.driver",)
"""What every zygote imports before the roles' modules (each only where it is installed)."""
_ONE_THREAD = {v: "1" for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


# -- the supervisor's side ---------------------------------------------------------------------


def _shared(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less ``PER_PROCESS_ENV``: what a forked process must share with its zygote."""
    return {k: v for k, v in env.items() if k not in PER_PROCESS_ENV}


class ForkedProcess:
    """A process the zygote forked, as the supervisor sees it: ``pid``, ``returncode`` (None
    while it runs) and ``wait()``, as an ``asyncio.subprocess.Process`` has them.

    It is made as soon as the zygote says ``forked``, before the zygote can have reaped the
    child, and holds a pidfd of it from then on: if the zygote dies, the end of this process is
    watched through it, never through a pid that a new process may have taken meanwhile. A
    pid that is not the zygote's child (``zygote``) by then has already ended."""

    def __init__(self, pid: int, zygote: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done = asyncio.Event()
        self._pidfd: int | None = None
        with contextlib.suppress(OSError):
            self._pidfd = os.pidfd_open(pid)
        if self._pidfd is not None and _parent(pid) != zygote:
            self._close_pidfd()  # reaped, and the pid taken by another process already

    @property
    def alive(self) -> bool:
        """Whether it was still the zygote's child when the zygote reported its fork."""
        return self._pidfd is not None or self.returncode is not None

    async def wait(self) -> int:
        """Wait for the process to end; return its status (negative: killed by that signal)."""
        await self._done.wait()
        assert self.returncode is not None
        return self.returncode

    def _exited(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = status
            self._done.set()
        self._close_pidfd()

    def _orphaned(self) -> None:
        """Its zygote is gone, and with it the exit status: watch the pid's end through a
        pidfd instead (its parent-death signal kills it with the zygote: SIGKILL)."""
        if self.returncode is not None:
            return
        if self._pidfd is None:
            self._exited(-signal.SIGKILL)
            return
        loop = asyncio.get_running_loop()
        loop.add_reader(self._pidfd, self._exited, -signal.SIGKILL)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None


def _parent(pid: int) -> int:
    """``pid``'s parent's pid; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


AnyProcess = asyncio.subprocess.Process | ForkedProcess
"""A process the supervisor started: cold (an asyncio subprocess) or forked by the zygote."""


class Launcher:
    """Starts the supervisor's processes: forked by the zygote when it can, cold otherwise.

    ``start()`` learns each Python process's role class or program from its spec file; ``run()``
    (after the run's first processes) keeps a zygote that imported them alive until cancelled.

    Args:
        log_dir: where the zygote's stderr goes (``zygote.stderr``) beside the processes'.
        enabled: False starts every process cold (``ASYNCRL_ZYGOTE=0`` also does).
    """

    def __init__(self, log_dir: str, *, enabled: bool = True) -> None:
        self.log_dir = log_dir
        self.enabled = enabled and os.environ.get(ZYGOTE_ENV, "1") != "0"
        self.forks = 0
        self._targets: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
        self._proc: asyncio.subprocess.Process | None = None
        self._env: dict[str, str] = {}  # the zygote's, less PER_PROCESS_ENV
        self.ready = asyncio.Event()
        """Set while a zygote is ready to fork (tests and benchmarks wait on it)."""
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[ForkedProcess]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._log = logs.get_logger("asyncrl.supervision.zygote")

    @property
    def pid(self) -> int | None:
        """The zygote's pid while it runs and can fork; None otherwise."""
        return self._proc.pid if self._proc is not None and self.ready.is_set() else None

    async def start(
        self, argv: list[str], env: Mapping[str, str], log_path: str, kind: str, incarnation: int
    ) -> AnyProcess:
        """Start incarnation ``incarnation`` of a process: ``argv`` with ``os.environ`` updated
        by ``env``, stdin from ``/dev/null``, stderr appended to ``log_path`` after the line
        ``--- incarnation N ---`` (where the supervisor's failure report starts reading it). A
        Python role or driver (``kind``) is forked by the zygote when one is ready and its
        environment is the zygote's but for ``PER_PROCESS_ENV``; anything else starts cold."""
        with open_append(log_path) as stderr:
            stderr.write(f"--- incarnation {incarnation} ---\n".encode())
        full = {**os.environ, **env}
        python = kind in ("role", "driver") and argv[1:] == ["-m", "asyncrl.supervision.process"]
        if python:
            self._learn(full)
        if python and self.ready.is_set() and self._compatible(full):
            forked = await self._fork(full, log_path)
            if forked is not None:
                return forked
        with open_append(log_path) as stderr:
            return await asyncio.create_subprocess_exec(
                *argv,
                env=full,
                stdin=asyncio.subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )

    def _learn(self, env: Mapping[str, str]) -> None:
        """Note the role class or program named by the process's spec file, and the environment
        it starts with, for the zygote."""
        path = env.get("ASYNCRL_SPEC_FILE", "")
        # <name>.<replica>.<incarnation>.json: one entry per replica, whatever its incarnation
        key = os.path.basename(path).rsplit(".", 2)[0]
        if not path or key in self._targets:
            return
        try:
            with open(path, "rb") as f:
                spec = msgspec.json.decode(f.read())
            target = {
                "kind": spec.get("kind", ""),
                "target": spec.get("target", ""),
                "config": spec.get("config", {}),
                "model": spec.get("model", {}),
            }
            self._targets[key] = (target, _shared(env))
        except (OSError, msgspec.DecodeError):
            pass

    def _compatible(self, env: Mapping[str, str]) -> bool:
        return _shared(env) == self._env

    def _plan(self) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """The next zygote's environment (less ``PER_PROCESS_ENV``), and what it imports.

        It takes the environment most processes start with (the run's ``run.env``; on a tie,
        that of the first started), so that they fork; a process whose own ``env`` differs
        starts cold, and its role is not imported. Each role class or program is imported
        once, whatever its number of replicas."""
        envs = [env for _, env in self._targets.values()]
        base = max(envs, key=envs.count)
        imports: dict[bytes, dict[str, Any]] = {}
        for target, env in self._targets.values():
            if env == base:
                imports.setdefault(msgspec.json.encode(target, order="sorted"), target)
        return base, list(imports.values())

    async def _fork(self, env: dict[str, str], log_path: str) -> ForkedProcess | None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            return None
        self._next_id += 1
        ident = self._next_id
        answer: asyncio.Future[ForkedProcess] = asyncio.get_running_loop().create_future()
        self._pending[ident] = answer
        request = json.dumps({"id": ident, "env": env, "stderr": log_path}).encode()
        try:
            proc.stdin.write(request + b"\n")
            await proc.stdin.drain()
            async with asyncio.timeout(FORK_TIMEOUT_S):
                child = await answer
        except (OSError, TimeoutError, ConnectionError, RuntimeError) as exc:
            self._log.warning("zygote did not fork; starting cold", error=repr(exc))
            return None
        finally:
            self._pending.pop(ident, None)
        self.forks += 1
        return child

    async def run(self) -> None:
        """Keep a zygote until cancelled: start it, read its reports, start another after it
        dies (at most ``ZYGOTE_RESTARTS`` times). Cancelled: the zygote is killed (children it
        still has die with it) and their ends are watched through pidfds."""
        if not self.enabled or not self._targets:
            return
        try:
            for attempt in range(ZYGOTE_RESTARTS + 1):
                if attempt:
                    await asyncio.sleep(ZYGOTE_BACKOFF_S)
                try:
                    if not await self._serve_one():
                        return  # it cannot fork safely here: another would not either
                except Exception as exc:  # the run goes on, starting its processes cold
                    self._log.error("zygote failed", error=repr(exc))
                    await self._close()
        finally:
            await self._close()

    async def _serve_one(self) -> bool:
        """Run one zygote until it exits; False if it said forking is unsafe."""
        self._env, imports = self._plan()
        targets = json.dumps(imports)
        env = {**self._env, **_ONE_THREAD, "ASYNCRL_ZYGOTE_PARENT": str(os.getpid())}
        read_fd, write_fd = os.pipe()
        try:
            with open_append(os.path.join(self.log_dir, "zygote.stderr")) as stderr:
                self._proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "asyncrl.supervision.zygote",
                    "--report-fd",
                    str(write_fd),
                    env=env,
                    stdin=asyncio.subprocess.PIPE,
                    stderr=stderr,
                    pass_fds=(write_fd,),
                    start_new_session=True,
                )
        finally:
            os.close(write_fd)
        assert self._proc.stdin is not None
        self._proc.stdin.write(targets.encode() + b"\n")  # first line: what to import
        started = time.monotonic()
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0)
        )
        safe = True
        try:
            while line := await reader.readline():
                safe = self._report(line.decode().split(), started) and safe
        finally:
            transport.close()
            self.ready.clear()
            self._orphan_all()
        code = await self._proc.wait()
        if safe:
            self._log.warning(
                "zygote exited; starting processes cold", pid=self._proc.pid, code=code
            )
        self._proc = None
        return safe

    def _report(self, words: list[str], started: float) -> bool:
        """Act on one report of the zygote; False when it says it cannot fork safely."""
        match words:
            case ["ready"]:
                self.ready.set()
                took = round(time.monotonic() - started, 3)
                self._log.info("zygote ready", pid=self._proc.pid if self._proc else None, s=took)
            case ["unsafe", threads]:
                self._log.warning(
                    "zygote not used: its imports started threads; processes start cold",
                    threads=int(threads),
                )
                return False
            case ["forked", ident, pid]:
                # Known before its requester resumes: its "exited" may be the next line.
                zygote = self._proc.pid if self._proc is not None else 0
                child = self._children[int(pid)] = ForkedProcess(int(pid), zygote)
                answer = self._pending.get(int(ident))
                if answer is not None and not answer.done():
                    answer.set_result(child)
                elif child.alive:  # its requester gave up on it and started the process cold
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(int(pid), signal.SIGKILL)
            case ["failed", ident, *why]:
                answer = self._pending.get(int(ident))
                if answer is not None and not answer.done():
                    answer.set_exception(RuntimeError(" ".join(why)))
            case ["exited", pid, status]:
                ended = self._children.pop(int(pid), None)
                if ended is not None:
                    ended._exited(int(status))
        return True

    def _orphan_all(self) -> None:
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(RuntimeError("the zygote exited"))
        for child in self._children.values():
            child._orphaned()
        self._children.clear()

    async def _close(self) -> None:
        proc, self._proc = self._proc, None
        self.ready.clear()
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.shield(proc.wait())
        self._orphan_all()


# -- the zygote process ------------------------------------------------------------------------


def _preload(targets: list[dict[str, Any]]) -> None:
    """Import torch, transformers' modeling code when it is installed (over a second, paid by
    the first model a process builds), the process wrapper, and each role's module (with its
    ``Role.preload``) or the program's module. A module that fails here fails again in the
    child, which reports it as a cold start would."""
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    from asyncrl.manifest.model_section import inherited_config
    from asyncrl.supervision.process import load_role_class

    for t in targets:
        target = str(t.get("target", ""))
        try:
            if t.get("kind") == "role" and target:
                cls = load_role_class(target)
                config = t.get("config") or {}
                cls.preload(inherited_config(config, cls.Config, t.get("model") or {}))
            elif t.get("kind") == "driver" and ":" in target:
                where = target.rpartition(":")[0]
                if not where.endswith(".py") and os.sep not in where:
                    importlib.import_module(where)
        except (Exception, SystemExit):  # reported by the child, as a cold start would
            traceback.print_exc()


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def serve(report_fd: int) -> int:
    """The zygote's loop: read what to import (stdin's first line), import it, then fork on
    each request and reap and report children, until stdin closes."""
    from asyncrl.supervision.process import die_with_parent

    die_with_parent(int(os.environ.get("ASYNCRL_ZYGOTE_PARENT", "0")))
    buffered = b""
    while b"\n" not in buffered and (data := os.read(0, 1 << 20)):
        buffered += data
    first, _, buffered = buffered.partition(b"\n")
    _preload(json.loads(first) if first.strip() else [])
    if (threads := _threads()) != 1:
        os.write(report_fd, f"unsafe {threads}\n".encode())
        return 3
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    private = [report_fd, wake_r, wake_w, sel.fileno()]
    os.write(report_fd, b"ready\n")
    while True:
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            _fork_one(json.loads(line), report_fd, private)
        for key, _ in sel.select():
            if key.fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(report_fd)
                continue
            data = os.read(0, 1 << 20)
            if not data:
                return 0  # the supervisor is gone or done
            buffered += data


def _reap(report_fd: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        os.write(report_fd, f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _fork_one(request: dict[str, Any], report_fd: int, private: list[int]) -> None:
    ident = int(request["id"])
    zygote = os.getpid()
    sys.stdout.flush()  # or the child would write what the zygote buffered again
    sys.stderr.flush()
    try:
        sync_r, sync_w = os.pipe()
        pid = os.fork()
    except OSError as exc:
        os.write(report_fd, f"failed {ident} {exc!r}\n".encode())
        return
    if pid == 0:
        os.close(sync_r)
        _become(request, zygote, private, sync_w)
    os.close(sync_w)
    os.read(sync_r, 1)  # once it leads its own group (or died trying): killpg reaches it
    os.close(sync_r)
    os.write(report_fd, f"forked {ident} {pid}\n".encode())


def _become(request: dict[str, Any], zygote: int, private: list[int], sync_w: int) -> NoReturn:
    """In the child: detach from the zygote, then run the process wrapper; never returns."""
    code = 1
    try:
        os.setsid()
        os.write(sync_w, b"x")
        os.close(sync_w)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in private:
            with contextlib.suppress(OSError):
                os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        err = os.open(
            request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600
        )
        os.dup2(err, 2)
        os.close(err)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.argv[0]]
        _after_fork()
        from asyncrl.supervision.process import main as process_main

        process_main(parent_pid=zygote)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # the child must never return into the zygote
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        _exit(code)


def _after_fork() -> None:
    """In the child: what it shares with the zygote and its siblings but would not share as a
    cold process. numpy's global random state is reseeded from the OS's entropy, and OpenBLAS's
    thread pool (sized to one thread when the zygote loaded it) is resized to
    ``OPENBLAS_NUM_THREADS`` through ``threadpoolctl`` when it is installed."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return
    with contextlib.suppress(Exception):
        numpy.random.seed()  # from the OS's entropy, as a cold import seeds it
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 1:
        with contextlib.suppress(Exception):
            import threadpoolctl

            threadpoolctl.threadpool_limits(int(threads), user_api="blas")


def _exit(code: int) -> NoReturn:
    """End the child as a cold interpreter ends: its ``atexit`` handlers (the last trace
    flush, shared-memory cleanups), logging's shutdown, stdio flushed; then ``os._exit``, so
    that nothing of the zygote's own state runs again."""
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        logging.shutdown()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def main() -> None:
    """``python -m asyncrl.supervision.zygote --report-fd FD``; stdin: the protocol above."""
    sys.exit(serve(int(sys.argv[2])))


if __name__ == "__main__":
    from asyncrl.supervision.zygote import main as _main

    _main()

"""One trace of a launch over several nodes (``asyncrl.launch --trace``).

Every node's agent records into its own ``trace`` folder (``asyncrl.observe.trace.enable``). Node 0
takes the other nodes' files over tcp (Curve applies) with a ``TraceSink``
(``start_node_trace``); at the end node R sends its files there (``send_node_trace``) before it
says it is done, and node 0 merges every node's into ``RUN_DIR/trace.json``
(``asyncrl.observe.trace.merge_and_tell``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from asyncrl.observe.trace import TraceSink, enable, send_traces, trace_dir
from asyncrl.transport import TransportError, load_keys, tracing

__all__ = ["TRACE_SEND_S", "send_node_trace", "start_node_trace"]

TRACE_SEND_S = 30.0
"""The longest node R waits for node 0 to take its trace (to connect, then per piece)."""


def _curve(curve_keys: str) -> Any:
    """The Curve keys of the launch's tcp sockets from the folder ``curve_keys``, or None
    without Curve.

    Raises:
        TransportError: the keys do not load.
    """
    return load_keys(curve_keys) if curve_keys else None


async def start_node_trace(
    node: int,
    nodes: int,
    node_dir: str,
    sink: str,
    *,
    run: str,
    curve_keys: str,
    say: Callable[[int, str], None],
) -> TraceSink | None:
    """Turn tracing on for the processes this node starts from now on, and on node 0 take the
    other nodes' traces.

    Args:
        node: this node's rank.
        nodes: the launch's number of nodes.
        node_dir: this node's folder (the run's directory on node 0).
        sink: on node 0, the tcp endpoint to take the traces on ("": none).
        run: the run's name.
        curve_keys: the launch's Curve key folder ("": no Curve).
        say: tells the launch's console (node, message).

    Returns:
        Node 0's started sink, for the caller to close; None on another node, or when the sink
        cannot start (which is said: the run goes on with node 0's trace alone).
    """
    started = None
    if node == 0 and sink:
        try:
            started = TraceSink(node_dir, nodes, sink, run=run)
            started.curve = _curve(curve_keys)
            await started.start()
        except TransportError as exc:
            say(node, f"the other nodes' traces cannot reach node 0 ({exc})")
            if started is not None:
                await started.close()
            started = None
    enable(node_dir)  # after the sink is built: the agent's own sockets are not traced
    return started


async def send_node_trace(
    node: int,
    node_dir: str,
    sink: str,
    *,
    run: str,
    curve_keys: str,
    timeout_s: float,
    say: Callable[[int, str], None],
) -> str:
    """Send this node's trace files to node 0's sink at ``sink`` (before saying it is done,
    which node 0 waits for); what happened, in words, for node 0 to tell.

    Args:
        node: this node's rank (not 0).
        node_dir: this node's folder, whose ``trace`` folder is sent.
        sink: node 0's endpoint ("": node 0 takes none).
        run: the run's name.
        curve_keys: the launch's Curve key folder ("": no Curve).
        timeout_s: the launch's join timeout; the wait is at most ``TRACE_SEND_S`` of it.
        say: tells the launch's console (node, message) when the files cannot be sent.
    """
    recorder = tracing.uninstall()  # the agent's own: complete its file, send untraced
    if recorder is not None:
        recorder.close()
    directory = trace_dir(node_dir)
    limit = min(timeout_s, TRACE_SEND_S)  # node 0 gone: the run's end is not held for long
    if not sink or not os.path.isdir(directory):
        return f"nothing sent ({directory} holds no trace, or node 0 takes none)"
    try:
        names = await send_traces(
            directory, node, sink, run=run, curve=_curve(curve_keys), timeout_s=limit
        )
    except (TransportError, OSError) as exc:
        say(node, f"could not send the trace to node 0 at {sink}: {exc}")
        return f"not sent to {sink}: {exc}"
    return f"sent {len(names)} files"

"""How the nodes of a launch agree on the run's secret without the launch's store holding it.

torchrun's store (a TCPStore on ``MASTER_ADDR:MASTER_PORT``) is a plain tcp service: anyone who
reaches that port during the launch reads every key. So the run's secret never goes there; the
store holds only what lets each node arrive at the same secret on its own:

- With ``security.curve_keys`` (the CurveZMQ key folder every node holds a copy of): node 0 puts
  a fresh random nonce in the store, and each node derives the secret as HMAC-SHA256, keyed with
  the folder's server secret key, of the attempt's store prefix and that nonce. Only a holder of
  the folder can compute it, and each attempt has its own.
- Without keys: node 0 writes a fresh secret into its ``RUN_DIR/secret`` (0600) and puts the
  file's path in the store; each other node reads that file, which it can where the nodes share
  a filesystem (node ranks on one machine, or a shared mount, with the same ``--run-dir``). A
  node that cannot read it (machines apart, without Curve keys) refuses the launch, naming the
  two ways out: a key folder on every node, or one filesystem.

Either way node 0 also puts a check value, HMAC-SHA256 keyed with the secret, in the store; a
node whose secret does not match it (another key folder, a file another run wrote) refuses the
launch rather than start processes that the other nodes' would refuse.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets

from asyncrl.supervision.store_registry import StoreClient
from asyncrl.transport import TransportError, load_keys
from asyncrl.transport.control import SECRET_FILE, new_secret, read_secret, write_secret

__all__ = ["derive_secret", "secret_check", "shared_secret"]

_DERIVE = b"asyncrl run secret\x00"
_CHECK = b"asyncrl run secret check"


def derive_secret(server_secret_key: bytes, context: str) -> str:
    """The run's secret for ``context`` (the attempt's store prefix and nonce), derived from a
    key folder's server secret key: 64 hex digits."""
    return hmac.new(server_secret_key, _DERIVE + context.encode(), hashlib.sha256).hexdigest()


def secret_check(secret: str) -> str:
    """A value that tells whether two nodes hold the same secret, and nothing of the secret."""
    return hmac.new(secret.encode(), _CHECK, hashlib.sha256).hexdigest()


async def shared_secret(
    store: StoreClient,
    prefix: str,
    node: int,
    node_dir: str,
    curve_keys: str,
    timeout_s: float,
) -> tuple[str, str]:
    """The run's secret, the same on every node of the attempt: (secret, "") or ("", why this
    node cannot have it, for the launch to refuse with).

    Args:
        store: the launch's store.
        prefix: the attempt's key prefix in the store (``LaunchKeys.prefix``).
        node: this node's rank; node 0 makes what the others read.
        node_dir: this node's run folder (node 0's is where its secret file goes).
        curve_keys: the manifest's ``security.curve_keys`` (absolute), or "".
        timeout_s: how long a node waits for node 0's record.

    Raises:
        StoreError: node 0's record did not come within ``timeout_s``.
    """
    key = f"{prefix}/secret-record"
    server_key = b""
    if curve_keys:
        try:
            server_key = load_keys(curve_keys).server_secret
        except TransportError as exc:
            return "", f"security.curve_keys: {exc}"
    if node == 0:
        if server_key:
            nonce = secrets.token_hex(16)
            secret = derive_secret(server_key, f"{prefix}/{nonce}")
            record = {"nonce": nonce, "check": secret_check(secret)}
        else:
            secret = new_secret()
            path = os.path.join(os.path.abspath(node_dir), SECRET_FILE)
            write_secret(path, secret)
            record = {"file": path, "check": secret_check(secret)}
        mine = json.dumps(record)
        if await store.set_once(key, mine) == mine:
            return secret, ""
    await store.wait_for([key], timeout_s, why="node 0 makes the run's secret")
    return _follow(json.loads(await store.get(key)), prefix, node, server_key, curve_keys)


def _follow(
    record: dict[str, str], prefix: str, node: int, server_key: bytes, curve_keys: str
) -> tuple[str, str]:
    """The secret node 0's ``record`` leads to on this node, or why it leads nowhere."""
    if "nonce" in record:
        if not server_key:
            return "", (
                f"node 0 derives the run's secret from its security.curve_keys, but node {node} "
                "has none; launch every node with the same manifest"
            )
        secret = derive_secret(server_key, f"{prefix}/{record['nonce']}")
        if secret_check(secret) != record["check"]:
            return "", (
                f"node {node} derives another run secret from its security.curve_keys "
                f"({curve_keys}) than node 0 from its own: the two key folders differ, and the "
                "nodes' processes would refuse one another; copy node 0's key folder to every "
                "node"
            )
        return secret, ""
    path = record["file"]
    try:
        secret = read_secret(path)
    except TransportError as exc:
        cause = exc.__cause__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else exc
        return "", (
            f"node {node} cannot read the run's secret from node 0's file {path} ({reason}), "
            f"and the manifest has no security.curve_keys. The secret never goes "
            f"through the launch's store, which anyone who reaches MASTER_PORT can read: nodes "
            f"on separate machines derive it from the CurveZMQ key folder they share. Make one "
            f"with 'asyncrl keys generate DIR', copy it to every node and set "
            f"security.curve_keys (it also encrypts the tcp traffic between nodes), or give "
            f"every node the same --run-dir on one filesystem"
        )
    if secret_check(secret) != record["check"]:
        return "", (
            f"node {node} read a secret from node 0's file {path} that is not the one node 0 "
            "made for this attempt (the file was replaced since: another run in the same "
            "directory?); give each launch a run directory of its own"
        )
    return secret, ""

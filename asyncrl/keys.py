"""Curve key directories for runs across hosts: what ``asyncrl keys generate DIR`` does.

A run across hosts needs one key directory, copied to every node and named in the manifest
(``security.curve_keys``). It holds two key pairs in pyzmq's certificate format:

- ``server.key`` / ``server.key_secret``: the pair every binding socket serves with;
- ``client.key`` / ``client.key_secret``: the pair every connecting socket presents.

One pair of each for the whole run, not one per node: every node both serves and calls, so every
node must hold both secrets and admit every other node anyway; per-node keys would add files to
copy and no protection. A peer that is not an asyncrl node (one written in another language) can
be admitted with its own pair by dropping its public ``.key`` file into ``DIR/authorized/``.

Secret files are mode 0600 and the directory 0700. Reading the keys (``load_keys``) and using
them belong to the transport (``asyncrl.transport.curve``).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import zmq.auth

from asyncrl.errors import ConfigError
from asyncrl.transport.curve import AUTHORIZED_DIR, CLIENT, SERVER, CurveKeys, load_keys
from asyncrl.transport.sockets import make_private_dir

__all__ = ["AUTHORIZED_DIR", "CurveKeys", "files", "generate", "load_keys"]


def files(directory: str) -> list[str]:
    """The key files ``generate`` writes into ``directory``, in the order it writes them."""
    return [
        os.path.join(directory, f"{name}{suffix}")
        for name in (SERVER, CLIENT)
        for suffix in (".key", ".key_secret")
    ]


def generate(directory: str, force: bool = False) -> list[str]:
    """Write a new server and client key pair into ``directory``; return the files written.

    The directory is created (and made) 0700; each secret file is 0600, each public file 0644.
    Every file is written beside its final name and renamed into place, so a reader never sees
    a half-written key.

    Args:
        directory: where the keys go.
        force: replace keys that are there already (every node then needs the new directory).

    Raises:
        ConfigError: the directory holds keys already and ``force`` is not set, or a file cannot
            be written.
        TransportError: the directory is a symlink or belongs to another user.
    """
    directory = os.path.abspath(directory)
    targets = files(directory)
    existing = [os.path.basename(p) for p in targets if os.path.lexists(p)]
    if existing and not force:
        raise ConfigError(
            f"{directory} already holds Curve keys ({', '.join(existing)}); add --force to "
            f"replace them (then copy the directory to every node again)"
        )
    make_private_dir(directory)
    staging = tempfile.mkdtemp(prefix=".keys-", dir=directory)
    try:
        for name in (SERVER, CLIENT):
            public, secret = zmq.auth.create_certificates(staging, name)
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
        for target in targets:
            os.replace(os.path.join(staging, os.path.basename(target)), target)
    except OSError as exc:
        raise ConfigError(f"cannot write Curve keys into {directory}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return targets

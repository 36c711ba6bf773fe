"""``torchrun ... -m asyncrl.launch MANIFEST``: one node's agent of a launch over several nodes.

The launch itself is ``asyncrl.supervision.multinode`` (docs/multinode.md); this module is the short
name torchrun is given.
"""

from __future__ import annotations

import sys

from asyncrl.supervision.multinode import LaunchEnv, main
from asyncrl.supervision.rundir import node_dir

__all__ = ["LaunchEnv", "main", "node_dir"]

if __name__ == "__main__":
    sys.exit(main())

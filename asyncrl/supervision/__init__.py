"""Supervision and launch: the processes of a run, started, watched and restarted.

Owns: the node agent (``agent``) and its supervisor (``supervisor``), how a role's process
starts and runs (``process``, ``zygote`` for forked restarts, ``standby`` for restarts started
ahead, ``heap`` for its allocator's thresholds, ``liveness`` for the heartbeat thread that tells
a frozen process from a busy one), launches across nodes (``launch``, ``store_registry``,
``hosts``, and ``launch_secret``: how the nodes agree on the run's secret without the store
holding it), the run directory (``rundir``), leftovers and leases (``janitor``, ``leases``),
fault injection for tests (``faults``) and the report of how a run ended (``runreport``).

May import: the core, ``asyncrl.manifest``, ``asyncrl.observe``, ``asyncrl.dispatch`` (a driver
process runs ``asyncrl.dispatch.driver``) and the transport.
"""

"""Dispatch: how the driver's calls reach a role's replicas, and how the run is paced.

Owns: the dispatcher and its scheduler (``dispatcher``, ``scheduler``: credit, load balance,
retries), the handles a program calls roles through (``handles``), owned background tasks
(``background``), the driver process (``driver``) and its watchdog (``watchdog``). What paces and
reduces RL samples belongs to the roles' sample pipeline (``asyncrl.roles.sampling``).

May import: the core, ``asyncrl.manifest``, ``asyncrl.observe`` and the transport.
"""

from __future__ import annotations

from asyncrl.dispatch.dispatcher import Busy, Dispatcher, Group, Work

__all__ = ["Busy", "Dispatcher", "Group", "Work"]

"""Agents: multi-turn episodes of the policy against environments that run as roles.

Owns: the environment contract and its base role (``environment``) and the episode runner with
the trajectories it keeps (``episodes``), and its quarantine of failing environment replicas
(``quarantine``); an environment driven by agent code, one reset and step at a time, with its
failures typed (``environment_client``).

May import: ``asyncrl.roles.payloads``, the runtime and the transport.
"""

"""Adapters: outside packages for agentic RL behind asyncrl's own contracts.

Owns: one module per package, each importing its package at import time (install them with
``pip install 'asyncrl[agents-adapters]'``):

- ``reasoning_gym``: reasoning-gym's procedural tasks as rows of the prompt source
  (``PromptSource``'s ``generator``) and the verifier ``reasoning_gym_entry``, which scores with
  the task's own ``score_answer``;
- ``textarena``: a single-player textarena game as an ``Environment`` role;
- ``verifiers``: a ``verifiers`` environment's rollouts run against ``OpenAIServer``, each turned
  into the server's trajectory with the environment's reward.

May import: ``asyncrl.roles.agents``, ``asyncrl.roles.services``, ``asyncrl.roles.payloads``, the
runtime and the transport.
"""

"""What a program calls: typed clients of the roles (``clients``), the RL and BC loops
(``programs``), evaluation (``evaluation``) and the metrics a run writes (``metrics``).

May import: every other part of the roles (``asyncrl.roles.learning``,
``asyncrl.roles.generation``, ``asyncrl.roles.training``, ``asyncrl.roles.services``,
``asyncrl.roles.sampling``, ``asyncrl.roles.payloads``), the runtime and the transport.
"""

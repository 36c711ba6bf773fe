"""What a program calls: typed clients of the roles (``clients``), the RL loop and its stop
conditions (``loop``), the built-in programs (``programs``), evaluation with a verifier of its
own (``evaluation``; by episodes against an environment: ``episode_evaluation``), the metrics
of each step (``metrics``), and the state a run carries across restarts: its phases and summary
(``run``, ``report``) and its history (``history``).

May import: every other part of the roles (``asyncrl.roles.learning``,
``asyncrl.roles.generation``, ``asyncrl.roles.training``, ``asyncrl.roles.services``,
``asyncrl.roles.sampling``, ``asyncrl.roles.agents``, ``asyncrl.roles.payloads``), the runtime
and the transport.
"""

"""Training: the ``Trainer`` component (``trainer``: model, optimizer, the micro-batched step of
an objective, state), the learner and the critic roles over it (``learner*``, ``critic*``,
``objective``, ``models``, ``zero_rows``), their parallelism (``data_parallel``, ``sharding``,
``host_buffers``) and durability (``checkpoints``, ``journal``, ``wal``).

May import: ``asyncrl.roles.learning``, ``asyncrl.roles.generation`` (the messages a learner
sends its rollouts), ``asyncrl.roles.payloads``, ``asyncrl.roles.device_report``, the plugin
registry and contract, the runtime and the transport.
"""

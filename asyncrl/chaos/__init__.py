"""Tools a person runs against a run: ``asyncrl chaos`` (``chaos``) and the accounting of what a
run delivered, lost or counted twice (``accounting``).

May import: the core, ``asyncrl.manifest``, ``asyncrl.observe``, ``asyncrl.dispatch``,
``asyncrl.supervision`` and the transport.
"""

"""asyncrl: an asynchronous actor-model runtime for RL post-training of language models.

Importing this package is cheap: it imports neither torch nor zmq. The layers import as
``asyncrl.transport``, ``asyncrl.roles`` and ``asyncrl.plugins``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

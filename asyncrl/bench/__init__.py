"""Benchmarks: ``asyncrl bench <name>`` runs the module ``<name>`` here (``transport``,
``runtime``, ``learner``, ``pipeline``, ``scale``, ``multinode``, ``sharding``, ``durability``),
each with a ``main(argv) -> int``.

Unlike the rest of the runtime, this package may import every layer (the roles included): a
benchmark measures the whole stack. Nothing outside it imports it, except the command line.
``pipeline_model`` and ``sim`` are the pipeline benchmark's discrete-event model and its simulated
roles.
"""

"""Benchmarks the wheel ships, as checks a user runs on their own machine: ``asyncrl bench
<name>`` runs the module ``<name>`` here (``transport``, ``runtime``, ``learner``), each with a
``main(argv) -> int``; ``engines`` compares the rollout engines (``asyncrl bench rollout``, an
entry point). ``harness`` starts a role under a real supervisor for them and for the developers'
benchmarks, which live outside the wheel in the repository's top-level ``benchmarks/``.

Unlike the rest of the runtime, this package may import every layer (the roles included): a
benchmark measures the whole stack. Nothing outside it imports it, except the command line and
the developers' benchmarks.
"""

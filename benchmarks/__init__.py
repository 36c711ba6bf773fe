"""The developers' benchmarks, outside the wheel: simulators and the discrete-event model of the
sample pipeline (``sim``, ``pipeline_model``, ``pipeline``, ``scale``), the multi-node, sharding
and durability benches, and the multi-turn episodes bench. ``asyncrl bench <name>`` runs the
module ``<name>`` (its ``main(argv) -> int``) from a source checkout; ``python -m
benchmarks.<name>`` does the same from the checkout's root.

They may import every part of asyncrl; nothing in the package imports them.
"""

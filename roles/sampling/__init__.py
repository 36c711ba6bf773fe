"""The driver's sample pipeline: prompts admitted, generated, scored, grouped and batched
(``pipeline``, which orchestrates its parts: ``admission``, the prompts admitted next, with feed
paging, resume skips, the prompt schedule (``schedule``) and probes; ``pacing``, admission under
the staleness bound; ``release``, what becomes of a scored group, with split-mode reduction of
its statistics (``reduce``), the uniform-drop cap and staleness; ``counters``, what it counts;
``group``, one admitted prompt's group; what it takes and gives, with its settings, its resume
state and the default sample source: ``contract``; one call a group: ``coalesce``), and the
weight sync that follows the learner (``weight_sync``).

May import: ``asyncrl.roles.learning``, ``asyncrl.roles.payloads``, the runtime and the
transport.
"""

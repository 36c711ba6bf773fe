"""The driver's sample pipeline: prompts admitted, generated, scored, grouped and batched
(``pipeline``), and the weight sync that follows the learner (``weight_sync``).

May import: ``asyncrl.roles.learning``, ``asyncrl.roles.payloads``, the runtime and the
transport.
"""

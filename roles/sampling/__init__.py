"""The driver's sample pipeline: prompts admitted, generated, scored, grouped and batched
(``pipeline``; what it takes and gives, with the default sample source: ``contract``; one call a
group: ``coalesce``; prompt scheduling: ``schedule``; admission under the staleness bound:
``pacing``; split-mode reduction of group statistics: ``reduce``), and the weight sync that
follows the learner (``weight_sync``).

May import: ``asyncrl.roles.learning``, ``asyncrl.roles.payloads``, the runtime and the
transport.
"""

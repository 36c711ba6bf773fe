"""The learner's maths: algorithms and their settings (``algorithms``), advantages and their
estimators (``advantages``, ``estimators``, ``groups``), losses (``losses``), masked reductions
(``masked``) and batches of samples as tensors (``batching``).

May import: ``asyncrl.roles.payloads``, the runtime and the transport.
"""

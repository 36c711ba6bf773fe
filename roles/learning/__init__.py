"""The learner's maths: algorithms and their settings (``algorithms``), advantages and their
estimators (``advantages``, ``estimators``, ``groups``), losses (``losses``), masked reductions
(``masked``), batches of samples as tensors (``batching``) and the statistics the pipeline and
the learner share (``statistics``: moments that merge, staleness, percentiles).

May import: ``asyncrl.roles.payloads``, the runtime and the transport.
"""

"""asyncrl.roles: the roles of an RL run, their payload types and the algorithms.

Parts: the payloads every role speaks (``payloads``) and the device report (``device_report``);
``learning`` (the learner's maths), ``generation`` (rollout and engines), ``training`` (learner
and critic), ``services`` (prompts, reward, reference, relay), ``sampling`` (the driver's sample
pipeline) and ``program`` (what a program calls). ``docs/architecture.md`` draws their arrows.
"""

"""The service roles: the prompt source (``prompts``), the reward (``reward``), the reference
model (``reference``) and the weight relay between nodes (``relay``).

May import: ``asyncrl.roles.generation``, ``asyncrl.roles.training``, ``asyncrl.roles.payloads``,
``asyncrl.roles.device_report``, the plugin registry and contract, the runtime and the
transport.
"""

"""Generation: the rollout role (``rollout``) and its engines (``engine``, ``engine_rows``,
``vllm_engine``).

May import: ``asyncrl.roles.payloads``, ``asyncrl.roles.device_report``, the plugin registry and
contract, the runtime and the transport.
"""

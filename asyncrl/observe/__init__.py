"""Observability: what a run shows of itself while it runs and after.

Owns: logs (``logs``), traces and their page (``trace``, ``trace_nodes``, ``trace_analysis``,
``trace_view``, ``trace_view_graph``), metrics, plots and the progress line (``metrics``,
``plots``, ``progress``) and ``asyncrl status`` (``status``).

May import: the core and the transport.
"""

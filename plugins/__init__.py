"""asyncrl.plugins: hardware plugins, their contract and registry."""

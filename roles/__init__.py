"""asyncrl.roles: the roles of an RL run, their payload types and the algorithms."""

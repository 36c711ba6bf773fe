"""What a supervised process's exit status says, and what the supervisor does about it.

- ``0``: a role stopped when asked; the driver's program finished (the run completed).
- ``EXIT_PROGRAM`` (70, EX_SOFTWARE): the driver's program raised. The run fails once, with the
  traceback; it is never restarted, since running the same program again fails the same way.
- ``EXIT_STOPPED`` (75, EX_TEMPFAIL): the driver was stopped (STOP, SIGTERM, SIGINT) before its
  program finished. Expected during the run's own shutdown; otherwise it is treated like a
  crash: the driver restarts and its program resumes. It never reads as success.
- ``EXIT_CONFIG`` (78, EX_CONFIG, in ``asyncrl.manifest.spec``): a configuration error; the run
  fails at once. Among them: a program or role class that does not import, a config the role
  rejects, and an ``ImportError`` raised in a role's ``setup`` (``asyncrl.imports`` words its
  message).
- anything else, or a signal: a crash, restarted within the process's budget.
"""

from __future__ import annotations

__all__ = ["EXIT_PROGRAM", "EXIT_STOPPED"]

EXIT_PROGRAM = 70
EXIT_STOPPED = 75

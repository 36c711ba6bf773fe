"""The plugins' errors sit in asyncrl's one hierarchy, say what failed, and cross processes."""

from __future__ import annotations

import pickle

import asyncrl.plugins.errors as plugin_errors
from asyncrl.errors import AsyncrlError, ConfigError
from asyncrl.plugins.errors import CollectiveTimeoutError, PluginError


def test_plugin_errors_are_asyncrl_errors_fatal_or_recoverable() -> None:
    assert PluginError.__mro__[1:4] == (ConfigError, AsyncrlError, Exception)
    assert CollectiveTimeoutError.__mro__[1:3] == (AsyncrlError, Exception)
    assert (PluginError.retryable, CollectiveTimeoutError.retryable) == (False, True)


def test_the_module_draws_its_tree_with_every_error() -> None:
    doc = plugin_errors.__doc__ or ""
    tree = doc[doc.index("AsyncrlError") :]
    assert [name for name in plugin_errors.__all__ if name not in tree] == []
    assert "PluginError               F" in tree
    assert "CollectiveTimeoutError        R" in tree


def test_a_collective_timeout_names_the_collective_and_ranks_and_pickles() -> None:
    exc = CollectiveTimeoutError("all_gather", [1, 3], 2.5, 0)
    assert str(exc) == (
        "all_gather: rank(s) [1, 3] did not arrive within 2.5 s (this is rank 0); check that "
        "process's log for a crash or a hang, or raise dist_timeout_s in the manifest"
    )
    back = pickle.loads(pickle.dumps(exc))
    assert (type(back), back.collective, back.missing, back.timeout_s, back.rank, str(back)) == (
        CollectiveTimeoutError,
        "all_gather",
        [1, 3],
        2.5,
        0,
        str(exc),
    )
    unknown = CollectiveTimeoutError("barrier", [], 1.0, 2)
    assert str(unknown).startswith("barrier: the ranks did not all arrive within 1 s (this is")

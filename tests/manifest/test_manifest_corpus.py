"""A corpus of broken manifests, each beside the exact report it must produce.

``tests/manifests/broken/<case>.yaml`` is a manifest with problems; ``<case>.expected`` is the
report, ``str(ManifestError)``, that ``load_manifest`` must give for it: every problem at once,
each with its path in the file. Lines ``# --set KEY=VALUE`` at the top of a manifest are the
overrides it is loaded with. The manifests are loaded from their own folder, the directory the
run would start in, so that commands and program files are looked up there; ``{cwd}`` in an
expected report stands for that folder.

To write the report of a new case, run ``python -m tests.manifest.test_manifest_corpus <case>``
and read it before saving it: it must name what is wrong, where, and how to fix it.
"""

from __future__ import annotations

import os
import sys

import pytest

from asyncrl.manifest.load import ManifestError, load_manifest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(TESTS, "manifests", "broken")
CASES = sorted(name.removesuffix(".yaml") for name in os.listdir(CORPUS) if name.endswith(".yaml"))


def report(case: str) -> str:
    """The report ``load_manifest`` gives for ``case``, loaded from the corpus folder."""
    path = f"{case}.yaml"
    with open(os.path.join(CORPUS, path), encoding="utf-8") as f:
        overrides = [
            line.removeprefix("# --set ").rstrip("\n") for line in f if line.startswith("# --set ")
        ]
    cwd = os.getcwd()
    os.chdir(CORPUS)
    try:
        load_manifest(path, overrides)
    except ManifestError as exc:
        return str(exc).replace(CORPUS, "{cwd}") + "\n"
    finally:
        os.chdir(cwd)
    raise AssertionError(f"{path} loaded without a problem")


def test_the_corpus_is_large_and_every_case_has_its_report() -> None:
    assert len(CASES) >= 30
    expected = sorted(
        n.removesuffix(".expected") for n in os.listdir(CORPUS) if n.endswith(".expected")
    )
    assert expected == CASES


@pytest.mark.parametrize("case", CASES)
def test_a_broken_manifest_gives_its_exact_report(case: str) -> None:
    with open(os.path.join(CORPUS, f"{case}.expected"), encoding="utf-8") as f:
        assert report(case) == f.read()


if __name__ == "__main__":
    for case in sys.argv[1:] or CASES:
        print(f"== {case}\n{report(case)}", end="")

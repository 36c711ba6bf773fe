"""Reading manifest YAML: numbers written the usual ways are numbers."""

from __future__ import annotations

import pytest

from asyncrl.manifest.yaml_reader import apply_override, load_yaml


@pytest.mark.parametrize(
    ("text", "value"),
    [("3e-4", 3e-4), ("1E5", 1e5), ("-2.5e-3", -2.5e-3), ("+1e0", 1.0), ("0.001", 0.001)],
)
def test_exponent_floats_are_floats_in_files_and_overrides(text: str, value: float) -> None:
    problems: list[str] = []
    ok, data = load_yaml(f"lr: {text}\n", problems)
    assert ok and not problems
    assert data == {"lr": value} and isinstance(data["lr"], float)
    raw: dict[str, object] = {}
    apply_override(raw, f"run.config.lr={text}", problems, [])
    assert not problems
    assert raw == {"run": {"config": {"lr": value}}}


@pytest.mark.parametrize("text", ["e5", "3e", "1e-4x", "'3e-4'", "0x1f"])
def test_other_text_is_not_read_as_an_exponent_float(text: str) -> None:
    problems: list[str] = []
    ok, data = load_yaml(f"v: {text}\n", problems)
    assert ok and not problems
    assert not isinstance(data["v"], float)

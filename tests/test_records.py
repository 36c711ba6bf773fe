"""tests/helpers/records.py: a JSON-lines file read while its writer appends."""

import json
from pathlib import Path

from tests.helpers.records import complete_lines, records


def test_a_line_being_written_is_left_out_whole(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "ids": [["a#b')
    assert records(str(path)) == [{"step": 1}]
    with open(path, "a") as f:
        f.write('c", 0]]}\n')
    assert records(str(path)) == [{"step": 1}, {"step": 2, "ids": [["a#bc", 0]]}]


def test_a_missing_file_has_no_lines(tmp_path: Path) -> None:
    assert complete_lines(str(tmp_path / "absent.jsonl")) == []

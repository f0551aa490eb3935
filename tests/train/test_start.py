"""The records ``rpb train`` writes before its first step: routing-kd's base (where it comes from, a frozen copy's
size), appended as step-0 lines of log.jsonl; none for a run without a base."""

from __future__ import annotations

import json

from rpb.train.start import note_base


def test_the_base_is_a_step_zero_record_and_a_run_without_one_writes_none(tmp_path):
    log = tmp_path / "out" / "log.jsonl"
    note_base(None, log)
    assert not log.exists()
    note_base({"source": "online", "mode": "frozen-copy", "copy_bytes": 3 * 2**20 + 2**19}, log)
    note_base({"source": "routes", "routes_file": "r.safetensors"}, log)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines == [
        {"step": 0, "base/source": "online", "base/mode": "frozen-copy", "base/copy_mib": 3.5},
        {"step": 0, "base/source": "routes"},
    ]

"""The shapes a row carries an assistant's reasoning in, read without any template (the labels those
shapes get under the vendors' templates: tests/data/test_template_vendors.py)."""

from __future__ import annotations

import re

import pytest

from rpb.data.errors import RowProblem
from rpb.data.reasoning import merge_channels, split_turn


def test_a_think_block_splits_off_its_reasoning_and_keeps_the_layout():
    turn = split_turn({"role": "assistant", "content": "<think>\nstep one\nstep two\n</think>\n\nAnswer."}, 1)
    assert (turn.shape, turn.reasoning, turn.answer) == ("think-tags", "step one\nstep two", "Answer.")
    probe = turn.probe({"role": "assistant", "content": "x"}, "R", "A")
    assert probe == {"role": "assistant", "content": "<think>\nR\n</think>\n\nA"}


def test_a_reasoning_field_keeps_its_name_in_the_probe():
    message = {"role": "assistant", "content": "Answer.", "thinking": "why", "name": "bot"}
    turn = split_turn(message, 1)
    assert (turn.shape, turn.reasoning, turn.answer) == ("thinking", "why", "Answer.")
    assert turn.probe(message, "R", "A") == {"role": "assistant", "name": "bot", "content": "A", "thinking": "R"}
    plain = split_turn({"role": "assistant", "content": "No tags </think> here"}, 1)
    assert (plain.shape, plain.reasoning) == ("plain", None)


def test_harmony_channels_become_one_turn():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "channel": "analysis", "content": "thinking it over"},
        {"role": "assistant", "channel": "final", "content": "done"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "channel": "final", "content": "done2"},
    ]
    merged, origin = merge_channels(messages)
    assert merged == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "done", "thinking": "thinking it over"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "done2"},
    ]
    assert origin == [0, 2, 3, 4]


@pytest.mark.parametrize(
    ("message", "named"),
    [
        (
            {"role": "assistant", "content": "<think>a</think>b", "reasoning_content": "a"},
            "both in 'reasoning_content'",
        ),
        ({"role": "assistant", "content": "b", "reasoning_content": "a", "thinking": "c"}, "different reasonings"),
        ({"role": "assistant", "content": "b", "channel": "commentary"}, "channel 'commentary'"),
        ({"role": "assistant", "content": "b", "reasoning_content": 3}, "'reasoning_content' must be a string"),
    ],
)
def test_ambiguous_reasoning_is_refused(message, named):
    with pytest.raises(RowProblem, match=re.escape(named)):
        split_turn(merge_channels([{"role": "user", "content": "q"}, message])[0][1], 1)

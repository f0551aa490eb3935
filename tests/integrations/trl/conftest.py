"""Shared by the TRL integration's GRPO tests."""

from __future__ import annotations

import pytest

from rpb.testing.tokenizers import moonlight_tokenizer


@pytest.fixture(scope="module")
def tok():
    """The Moonlight-style tokenizer, padding on the left as TRL's generation wants."""
    t = moonlight_tokenizer()
    t.padding_side = "left"
    return t

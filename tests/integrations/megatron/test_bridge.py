"""The version-aware parts of the Bridge glue that need no Bridge: where the SFT dataset lives on each
line, and rpb's own seeded row order (Bridge v0.3.1's online sample mapping ignores ``data.seed``)."""

from __future__ import annotations

import sys
import types

import pytest

from rpb.integrations.megatron.bridge import SFT_DATASET_MODULES, row_order, sample_row, sft_dataset_class

GPT_SFT, SFT = SFT_DATASET_MODULES


def fake_module(monkeypatch, name: str) -> type:
    module = types.ModuleType(name)
    module.GPTSFTDataset = type("GPTSFTDataset", (), {"where": name})
    monkeypatch.setitem(sys.modules, name, module)
    return module.GPTSFTDataset


def test_the_sft_dataset_is_found_where_each_line_keeps_it(monkeypatch):
    assert (GPT_SFT, SFT) == ("megatron.bridge.data.datasets.gpt_sft", "megatron.bridge.data.datasets.sft")
    # v0.3.1: only ...sft
    monkeypatch.setitem(sys.modules, GPT_SFT, None)  # a None entry makes the import fail, as a missing module
    old = fake_module(monkeypatch, SFT)
    assert sft_dataset_class() is old
    # 0.6.x: ...gpt_sft (and ...sft gone: Bridge's own tests assert the old import raises)
    new = fake_module(monkeypatch, GPT_SFT)
    monkeypatch.setitem(sys.modules, SFT, None)
    assert sft_dataset_class() is new


def test_no_sft_dataset_names_both_places(monkeypatch):
    for name in SFT_DATASET_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"gpt_sft.*datasets\.sft"):
        sft_dataset_class()


def test_two_seeds_give_two_orders_and_every_epoch_reads_every_row_once():
    n = 12
    first = [sample_row(i, n, seed=42) for i in range(3 * n)]
    other = [sample_row(i, n, seed=43) for i in range(3 * n)]
    assert first != other
    for epoch in range(3):
        assert sorted(first[epoch * n : (epoch + 1) * n]) == list(range(n))
    assert first[:n] != first[n : 2 * n]  # each epoch its own order
    assert first == [sample_row(i, n, seed=42) for i in range(3 * n)]  # and the same on every call
    assert row_order(n, 42, 0).tolist() == first[:n]
    assert sample_row(-5, n, 42) == sample_row(5, n, 42)  # a padding id of a global batch reads a real row

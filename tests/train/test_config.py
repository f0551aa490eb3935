"""The config reader: every problem listed at once, enumerations checked from their ``Literal`` types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from rpb.errors import ConfigError
from rpb.train.config import build_section, load_config


@dataclass
class Inner:
    mode: Literal["a", "b"] = "a"
    level: Literal["x", "y"] | None = None


@dataclass
class Outer:
    rate: float = 1.0
    count: int = 2
    inner: Inner = field(default_factory=Inner)


def test_literal_fields_accept_their_values_and_name_them_when_refusing():
    problems: list[str] = []
    built = build_section(Outer, {"rate": "1e-5", "inner": {"mode": "b", "level": None}}, problems)
    assert problems == [] and built.rate == 1e-5 and built.inner.mode == "b"
    built = build_section(Outer, {"count": 1.5, "inner": {"mode": "c", "level": "z", "other": 1}}, problems)
    assert problems == [
        "count: expected int, got 1.5",
        "inner.mode: expected one of 'a', 'b', got 'c'",
        "inner.level: expected one of 'x', 'y' or None, got 'z'",
        "inner.other: unknown key (known: mode, level)",
    ]
    assert built.inner.mode == "a"  # a refused value keeps the default


def test_run_config_enumerations_are_checked_with_every_other_problem(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data_jsonl={data}", "train.loss_on=everything", "train.dtype=float64",
                           "anchor.router_transform=relu", "anchor.method=rpb"])  # fmt: skip
    assert e.value.problems == [
        "train.loss_on: expected one of 'answer', 'all', got 'everything'",
        "train.dtype: expected one of 'float32', 'bfloat16', 'float16', got 'float64'",
        "anchor.router_transform: expected one of 'softmax', 'sigmoid-normalized' or None, got 'relu'",
        "model: required",
        "output_dir: required",
        "prior: required by anchor.method 'rpb' (collect one with `rpb collect`)",
        "train.max_seq_len: required when there is no prior to take it from",
    ]


def test_a_setting_the_method_never_reads_is_refused_naming_who_reads_it(tmp_path):
    """A leftover coefficient (``lambda`` after switching to sft) would train a run other than the one meant,
    as a leftover ``base_dtype`` would: each is named with the methods that read it."""
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data_jsonl={data}", "model=m", "output_dir=o", "train.max_seq_len=64",
                           "anchor.method=sft", "anchor.lambda=0.1", "anchor.lbl_coef=0.01",
                           "anchor.base_dtype=bfloat16"])  # fmt: skip
    assert e.value.problems == [
        "anchor.lambda: read only by router-l2, kl-to-base, logit-l2, routing-kd, output-kd, routing-kd-router, "
        "hidden-kd, not by 'sft'",
        "anchor.lbl_coef: read only by lbl, not by 'sft'",
        "anchor.base_dtype: read only by the methods with a base (routing-kd, output-kd, routing-kd-router, "
        "hidden-kd), not by 'sft'",
    ]
    assert load_config(None, [f"data_jsonl={data}", "model=m", "output_dir=o", "anchor.method=kl-to-base",
                              "anchor.lambda=0.1", "train.max_seq_len=64"]).anchor.lambda_ == 0.1  # fmt: skip

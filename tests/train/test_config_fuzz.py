"""Property tests of the configuration loader: any YAML file and any ``key=value`` overrides end in a
``RunConfig`` or one ``ConfigError`` listing the problems -- never a traceback."""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rpb.errors import ConfigError
from rpb.train.config import RunConfig, load_config

FUZZ = settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEYS = ["model", "data_jsonl", "output_dir", "prior", "anchor", "anchor.method", "anchor.beta", "anchor.lambda",
        "train", "train.max_steps", "train.lr", "train.batch_size", "train.loss_on", "train.report_to", "data",
        "data.packing", "data.chat_template_kwargs", "data.chat_template_kwargs.enable_thinking", "lora",
        "lora.rank", "lora.experts", "nonsense", "anchor.beta.deeper", ""]  # fmt: skip
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=3), max_leaves=8)  # fmt: skip
documents = st.one_of(
    st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), values, max_size=6).map(yaml.safe_dump),
    values.map(yaml.safe_dump),
    st.text(max_size=60),  # not YAML at all, mostly
)
override = st.one_of(
    st.tuples(st.sampled_from(KEYS), st.text(max_size=12)).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(max_size=20),
)


@FUZZ
@given(documents, st.lists(override, max_size=4))
@example("anchor: [1, 2]\n", ["anchor.beta=3"])
@example("train: {lr: 1e-5}\n", ["train.lr=abc", "data.chat_template_kwargs=[1]"])
@example("{", [])
def test_any_config_loads_or_lists_its_problems(document, overrides):
    path = Path(tempfile.mkdtemp()) / "run.yaml"
    path.write_text(document)
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        assert e.problems and str(path) in str(e)
    else:
        assert isinstance(cfg, RunConfig) and isinstance(cfg.data.chat_template_kwargs, dict)

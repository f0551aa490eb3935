"""The axolotl YAML as the plugin reads it (pure: no axolotl import). The run itself: test_plugin.py."""

from __future__ import annotations

import pytest

from rpb.errors import ConfigError
from rpb.integrations.axolotl.config import REPLACES_RPB, read_axolotl_config
from rpb.monitor.routing import MonitorConfig


@pytest.fixture
def files(tmp_path):
    (tmp_path / "train.jsonl").write_text("{}\n")
    (tmp_path / "prior.safetensors").write_bytes(b"")
    return tmp_path


def yaml_cfg(files, **extra) -> dict:
    return {"base_model": "m", "datasets": [{"path": str(files / "train.jsonl"), "type": "chat_template"}],
            "rpb": {"prior": str(files / "prior.safetensors"), "anchor": {"method": "rpb", "beta": 1.0}},
            **extra}  # fmt: skip


def problems(cfg: dict) -> list[str]:
    with pytest.raises(ConfigError) as e:
        read_axolotl_config(cfg)
    return e.value.problems


def test_a_valid_yaml_is_read_and_completed(files):
    cfg = yaml_cfg(files, gradient_checkpointing=True, train_on_inputs=True)
    cfg["rpb"]["monitor"] = {"every_n_steps": 10, "min_overlap": 0.5}
    run = read_axolotl_config(cfg)
    assert run.data_jsonl == str(files / "train.jsonl") and run.loss_on == "all"
    assert run.section.anchor.beta == 1.0
    assert run.section.monitor == MonitorConfig(enabled=True, every_n_steps=10, min_overlap=0.5)  # a mapping asks
    # axolotl's own default with checkpointing on and no kwargs is reentrant; the plugin puts in non-reentrant
    assert cfg["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert cfg["remove_unused_columns"] is False
    assert read_axolotl_config(yaml_cfg(files)).section.monitor == MonitorConfig()  # on where the base is at hand
    cfg = yaml_cfg(files)
    cfg["rpb"]["monitor"] = False
    assert read_axolotl_config(cfg).section.monitor == MonitorConfig(enabled=False)


def test_every_contradiction_is_listed_at_once(files):
    cfg = yaml_cfg(files, **dict.fromkeys(REPLACES_RPB, True), val_set_size=0.1, remove_unused_columns=True,
                   overrides_of_model_config={"output_router_logits": True, "router_aux_loss_coef": 0.01},
                   gradient_checkpointing_kwargs={"use_reentrant": True})  # fmt: skip
    cfg["rpb"]["anchor"] = {"method": "kl-to-base", "lambda": 0.1}
    found = problems(cfg)
    for key in (*REPLACES_RPB, "val_set_size", "remove_unused_columns", "output_router_logits",
                "router_aux_loss_coef", "use_reentrant: true"):  # fmt: skip
        assert sum(key in p for p in found) >= 1, (key, found)
    assert len(found) == len(REPLACES_RPB) + 5


def test_reentrant_checkpointing_is_allowed_for_the_bias_methods(files):
    cfg = yaml_cfg(files, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    read_axolotl_config(cfg)  # rpb only chooses experts: no loss term to cut off
    assert cfg["gradient_checkpointing_kwargs"] == {"use_reentrant": True}


def test_the_rpb_block_and_the_dataset_are_checked_field_by_field(files):
    cfg = yaml_cfg(files)
    cfg["rpb"] = {"prior": str(files / "missing.safetensors"), "anchor": {"method": "rpb", "beta": -1}, "bogus": 1,
                  "monitor": "yes"}  # fmt: skip
    cfg["datasets"] = [{"path": "nowhere.jsonl", "type": "alpaca", "roles_to_train": ["assistant"]}]
    found = problems(cfg)
    expected = ("rpb.prior: ", "rpb.anchor.beta", "rpb.bogus: unknown key", "rpb.monitor: expected",
                "datasets[0]: ['roles_to_train']", "datasets[0].type", "datasets[0].path")  # fmt: skip
    assert all(any(p.startswith(e) for p in found) for e in expected), found
    assert len(found) == len(expected)
    assert problems({"datasets": []})[0].startswith("rpb: required")
    two = yaml_cfg(files, datasets=[{"path": str(files / "train.jsonl")}] * 2)
    assert problems(two)[0].startswith("datasets: exactly one entry")

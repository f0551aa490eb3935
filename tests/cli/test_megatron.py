"""``rpb megatron-check``: the overrides it passes on (before and after options) and what it prints."""

from types import SimpleNamespace

import rpb.integrations.megatron.config as megatron_config
from rpb.cli import main


def test_overrides_on_both_sides_of_an_option_reach_the_loader(monkeypatch, capsys):
    seen = {}

    def fake_load(path, overrides, check_files):
        seen.update(path=path, overrides=overrides, check_files=check_files)
        anchor = SimpleNamespace(method="rpb")
        return SimpleNamespace(notes=["a departure"], anchor=anchor, world_size=8, data_parallel_size=2)

    monkeypatch.setattr(megatron_config, "load_megatron_config", fake_load)
    assert main(["megatron-check", "c.yaml", "train.seed=43", "--files", "anchor.beta=0.5"]) == 0
    assert seen == {"path": "c.yaml", "overrides": ["train.seed=43", "anchor.beta=0.5"], "check_files": True}
    out = capsys.readouterr().out
    assert "note (departs from the paper): a departure" in out
    assert "c.yaml: Megatron configuration OK (anchor.method=rpb, world size 8, DP 2)" in out

"""``run_revert`` end to end: the report's figures are the rows' own (the interval over rows, the training domain
named first), a LoRA post model saved as an adapter alone is merged and gives the figures of the same model
merged at save time, a model of another family is refused and nothing written (other shapes:
tests/adapters/test_revert.py), the shared-expert gates move only when asked; and the domains' parsing refuses
every malformed one at once."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from rpb.adapters import get_adapter
from rpb.errors import ArgumentError
from rpb.models import load_causal_lm
from rpb.retention.revert import POST, REVERTED
from rpb.retention.revert_run import load_pair, parse_domains, run_revert
from rpb.retention.run import RoutingMismatchError
from rpb.testing import replica as build_replica
from rpb.testing.data import conversations, write_jsonl
from rpb.train.lora import LoraSection, apply_lora, save_lora

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("revert-run")
    return {
        "trained": write_jsonl(conversations(6, seed=11), tmp / "trained.jsonl"),
        "other": write_jsonl(conversations(5, seed=12), tmp / "other.jsonl"),
    }


def test_the_report_is_the_rows_own_figures(replica, sets, tmp_path):
    base = replica("deepseek_v3")
    post = build_replica("deepseek_v3", tmp_path / "post", seed=2)
    out = tmp_path / "out"
    report = run_revert(str(base), str(post), sets, out, data_jsonl=sets["other"], reverse=True, progress=False)
    assert report["training_domain"] == "trained" and list(report["sets"]) == ["trained", "other", "routing data"]
    assert report["variants"] == ["post", "post+base routers", "base", "base+post routers"]
    for name, e in report["sets"].items():
        v = e["variants"]
        d = np.array(v[REVERTED]["nll_rows"]) - np.array(v[POST]["nll_rows"])
        assert e["delta_nll"]["estimate"] == pytest.approx(float(d.mean())) and e["delta_nll"]["rows"] == len(d)
        lo, hi = e["delta_nll"]["ci"]
        assert lo <= d.mean() <= hi and lo >= d.min() and hi <= d.max(), name
        assert v[POST]["nll"] == pytest.approx(float(np.mean(v[POST]["nll_rows"])))
        assert v["base"]["topk_overlap"] == {"all": 1.0, "Q": 1.0, "A": 1.0}
    assert json.loads((out / "report.json").read_text()) == report
    md = (out / "report.md").read_text()
    assert "training domain: **trained**" in md and "| trained (trained) |" in md and "Reverse" in md
    assert (out / "revert.png").stat().st_size > 0


def _lora_post(base_dir, out, merged_out):
    model = load_causal_lm(str(base_dir))
    facts = get_adapter(model.config.model_type)
    wrapped = apply_lora(model, LoraSection(rank=2, experts=False, router="lora", merge=False), facts)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    merged = copy.deepcopy(wrapped)
    save_lora(wrapped, out, merge=False)
    save_lora(merged, merged_out, merge=True)


def test_a_lora_adapter_is_merged_first_and_reads_as_the_model_merged_at_save(replica, sets, tmp_path):
    base = replica("qwen3_30b_a3b")
    _lora_post(base, tmp_path / "adapter", tmp_path / "merged")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    pair = load_pair(str(base), str(tmp_path / "adapter"), "float32", "cpu", False)
    assert not any(type(m).__name__.startswith("Lora") for m in pair.post.modules()), "merged: no wrapper left"
    facts = pair.facts
    moved = [
        not torch.equal(p.router.weight, b.router.weight)
        for p, b in zip(pair.post_layers, pair.base_layers, strict=True)
    ]
    assert all(moved) and facts.model_type == "qwen3_moe"
    ours = run_revert(str(base), str(tmp_path / "adapter"), sets, tmp_path / "a", progress=False)
    theirs = run_revert(str(base), str(tmp_path / "merged"), sets, tmp_path / "m", progress=False)
    for name in sets:
        for v in ours["variants"]:
            a, b = ours["sets"][name]["variants"][v], theirs["sets"][name]["variants"][v]
            assert a["nll_rows"] == pytest.approx(b["nll_rows"], abs=1e-5) and a["topk_overlap"] == b["topk_overlap"]
        assert ours["sets"][name]["variants"][POST]["topk_overlap"]["all"] < 1.0


def test_another_family_is_refused_and_nothing_written(replica, sets, tmp_path):
    base = replica("deepseek_v3")
    other = build_replica("qwen3_30b_a3b", tmp_path / "qwen")
    with pytest.raises(RoutingMismatchError, match="'deepseek_v3' model, the post model a 'qwen3_moe'"):
        run_revert(str(base), str(other), sets, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_the_shared_expert_gates_move_only_when_asked(replica, sets, tmp_path):
    base = replica("qwen1_5_moe_a2_7b")
    post = build_replica("qwen1_5_moe_a2_7b", tmp_path / "post", seed=4)
    for asked in (False, True):
        pair = load_pair(str(base), str(post), "float32", "cpu", asked)
        gates = [pair.post.get_submodule(m.name.rpartition(".")[0]).shared_expert_gate.weight for m in pair.post_layers]
        theirs = [
            pair.base.get_submodule(m.name.rpartition(".")[0]).shared_expert_gate.weight for m in pair.base_layers
        ]
        before = [g.clone() for g in gates]
        with pair.running(REVERTED):
            assert all(torch.equal(g, t) == asked for g, t in zip(gates, theirs, strict=True)), asked
            assert all(
                torch.equal(p.router.weight, b.router.weight)
                for p, b in zip(pair.post_layers, pair.base_layers, strict=True)
            )
        assert all(torch.equal(g, b) for g, b in zip(gates, before, strict=True)), "restored after"


def test_domains_parse_in_order_and_every_bad_one_is_named():
    assert list(parse_domains(["math=a.jsonl", "code=b=c.jsonl"]).items()) == [
        ("math", "a.jsonl"),
        ("code", "b=c.jsonl"),
    ]
    with pytest.raises(ArgumentError) as err:
        parse_domains(["math", "x=a", "x=b", "=c", "routing data=d"])
    text = str(err.value)
    assert "'math' is not NAME=PATH" in text and "'x' given twice" in text and "'=c' is not NAME=PATH" in text
    assert "'routing data' is reserved" in text
    with pytest.raises(ArgumentError, match="at least one --domain"):
        parse_domains([])

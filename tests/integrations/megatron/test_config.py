"""The Megatron-Bridge example without GPUs or Bridge: its configuration, micro-batches and context feed.

None of this imports megatron: ``rpb megatron-check`` and ``train.py --dry-run`` must work on
a machine that has neither megatron-core nor Megatron-Bridge.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from rpb.cli import main as rpb_main
from rpb.data import file_sha256
from rpb.errors import ConfigError
from rpb.integrations.megatron.bridge import (
    ANCHOR_LOSS_KEY,
    SAMPLE_KEY,
    SPAN_KEY,
    ContextIterator,
    anchored_loss,
    micro_batch,
)
from rpb.integrations.megatron.config import PAPER, load_megatron_config
from rpb.prior.artifact import SCHEMA, SCHEMA_VERSION, PriorArtifact, save_artifact

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "moonlight"
CONFIG = EXAMPLE / "config.yaml"


def test_example_config_is_the_papers_setup():
    cfg = load_megatron_config(CONFIG)
    assert cfg.notes == []  # no departure from PAPER, seeds 42/42
    assert (cfg.world_size, cfg.data_parallel_size) == (128, 64)
    assert (cfg.anchor.method, cfg.anchor.beta, cfg.anchor.eps, cfg.anchor.c) == ("rpb", 1.0, 0.05, 5.0)
    assert PAPER["train.steps"] == cfg.train.steps == 782
    # the values the paper does not state are Megatron-Bridge's Moonlight recipe's
    assert (cfg.optimizer.lr, cfg.optimizer.adam_beta2, cfg.optimizer.adam_eps) == (5e-6, 0.98, 1e-5)
    assert (cfg.scheduler.lr_warmup_iters, cfg.scheduler.lr_decay_iters, cfg.scheduler.start_weight_decay) == (
        50,
        1000,
        0.033,
    )


def test_overrides_and_every_problem_at_once():
    cfg = load_megatron_config(CONFIG, ["train.seed=43", "data.seed=43"])
    assert cfg.notes == []
    cfg = load_megatron_config(CONFIG, ["train.seq_length=4096"])
    assert cfg.notes == ["train.seq_length: 4096 (paper: 8192)"]
    with pytest.raises(ConfigError) as err:
        load_megatron_config(
            CONFIG,
            ["parallel.context=2", "parallel.pipeline=2", "moe.router_fusion=true", "moe.mtp_num_layers=1",
             "anchor.method=within-soft", "train.global_batch_size=100", "data.packed=true", "nope.key=1"],
        )  # fmt: skip
    text = str(err.value)
    for needle in (
        "parallel.context", "parallel.pipeline", "moe.router_fusion", "moe.mtp_num_layers", "'within-soft'",
        "train.global_batch_size", "data.packed", "nope: unknown key",
    ):  # fmt: skip
        assert needle in text, needle


def test_files_are_checked_against_the_prior(tmp_path):
    (tmp_path / "ckpt").mkdir()
    data = tmp_path / "data"
    data.mkdir()
    (data / "training.jsonl").write_text('{"input": "q", "output": "a"}\n')
    meta = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "rpb_version": "0", "model": "m",
        "model_type": "deepseek_v3", "model_config_sha256": "c" * 64, "routers_sha256": "r" * 64, "tokenizer": "t",
        "chat_template_sha256": "h" * 64, "chat_template_kwargs": {}, "chat_template_date": None, "reasoning": {},
        "router_transform": "sigmoid", "prior_kind": "probability", "top_k": 6, "max_seq_len": 8192,
        "routed_positions": "all-positions-of-truncated-sequence", "moe_layers": [1], "num_experts": 64,
        "num_rows": 1, "data_sha256": file_sha256(data / "training.jsonl"), "spans": ["Q", "A"],
    }  # fmt: skip
    prior = tmp_path / "prior.safetensors"
    tensors = {"prior_qa": torch.full((1, 2, 1, 64), 1 / 64), "span_tokens": torch.ones(1, 2, dtype=torch.int64),
               "row_sha256": torch.zeros(1, 32, dtype=torch.uint8)}  # fmt: skip
    save_artifact(PriorArtifact(metadata=meta, **tensors), prior)
    paths = [f"model.pretrained_checkpoint={tmp_path / 'ckpt'}", f"data.root={data}", f"prior={prior}"]
    cfg = load_megatron_config(CONFIG, paths, check_files=True)
    assert any("idx.npy is missing" in n for n in cfg.notes)  # index files: built before launch
    with pytest.raises(ConfigError, match=r"top_k is 6, the run's moe section says 8[\s\S]*max_seq_len=8192"):
        load_megatron_config(CONFIG, [*paths, "moe.topk=8", "train.seq_length=4096"], check_files=True)


def test_cli_and_entry_point_dry_run_need_no_megatron(capsys):
    assert rpb_main(["megatron-check", str(CONFIG), "train.seed=44", "data.seed=44"]) == 0
    assert "Megatron configuration OK" in capsys.readouterr().out
    assert rpb_main(["megatron-check", str(CONFIG), "parallel.context=2"]) == 2
    spec = importlib.util.spec_from_file_location("moonlight_train", EXAMPLE / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--config", str(CONFIG), "--dry-run"]) == 0
    assert "megatron.bridge" not in sys.modules


def test_micro_batch_feeds_every_position_and_keeps_the_shifted_loss():
    rows = [
        {"input_ids": [10, 11, 12, 13, 14, 15], "span_ids": [-1, 0, 0, -1, 1, 1], "sample_index": 7},
        {"input_ids": [20, 21, 22, 23], "span_ids": [-1, 0, 1, -1], "sample_index": 3},
    ]
    batch = micro_batch(rows, pad_id=0, seq_length=16, pad_to_multiple=4)
    assert batch["tokens"].tolist() == [[10, 11, 12, 13, 14, 15, 0, 0], [20, 21, 22, 23, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[11, 12, 13, 14, 15, 0, 0, 0], [21, 22, 23, 0, 0, 0, 0, 0]]
    # targets: assistant content and the token after it (the turn end); never the last position or padding
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [list(range(8))] * 2
    assert batch[SAMPLE_KEY].tolist() == [[7] * 6 + [-1] * 2, [3] * 4 + [-1] * 4]
    assert batch[SPAN_KEY].tolist() == [[-1, 0, 0, -1, 1, 1, -1, -1], [-1, 0, 1, -1, -1, -1, -1, -1]]
    every = micro_batch(rows, pad_id=0, seq_length=16, pad_to_multiple=4, loss_on="all")
    assert every["loss_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="does not fit"):
        micro_batch(rows, pad_id=0, seq_length=5)


def test_context_iterator_sets_each_micro_batch_and_hands_bridge_its_keys():
    class Recorder:
        def __init__(self):
            self.calls = []

        def set_micro_batch(self, sample_BS, span_BS):
            self.calls.append((sample_BS.tolist(), span_BS.tolist()))

    rows = [{"input_ids": [1, 2, 3], "span_ids": [0, 1, -1], "sample_index": i} for i in range(2)]
    batches = [micro_batch([r], pad_id=0, seq_length=8, pad_to_multiple=2) for r in rows]
    handle = Recorder()
    it = ContextIterator(iter(batches), handle)
    first = next(it)
    assert SAMPLE_KEY not in first and SPAN_KEY not in first and "tokens" in first
    assert handle.calls == [([[0, 0, 0, -1]], [[0, 1, -1, -1]])]
    next(it)
    assert handle.calls[-1][0] == [[1, 1, 1, -1]]


def test_loss_anchors_validate_as_on_the_hf_path():
    """Every HF method but the within-* controls runs here; only the prior-based ones need a prior."""
    for method, extra in (("lbl", "anchor.lbl_coef=0.01"), ("router-l2", "anchor.lambda=0.1"),
                          ("kl-to-base", "anchor.lambda=0.1"), ("logit-l2", "anchor.lambda=0.1"),
                          ("router-freeze", "anchor.beta=1.0")):  # fmt: skip
        cfg = load_megatron_config(CONFIG, [f"anchor.method={method}", extra, "prior=''"])
        assert cfg.anchor.method == method
    with pytest.raises(ConfigError) as err:
        load_megatron_config(CONFIG, ["anchor.method=lbl", "anchor.lbl_coef=0.01", "moe.aux_loss_coeff=0.001"])
    assert "moe.aux_loss_coeff" in str(err.value)
    with pytest.raises(ConfigError, match=r"anchor\.lambda: required"):
        load_megatron_config(CONFIG, ["anchor.method=kl-to-base"])
    with pytest.raises(ConfigError, match=r"train\.recompute_granularity: full recomputation"):
        load_megatron_config(
            CONFIG, ["anchor.method=logit-l2", "anchor.lambda=0.1", "train.recompute_granularity=full"]
        )
    with pytest.raises(ConfigError, match=r"prior: required by anchor\.method 'rpb-hard'"):
        load_megatron_config(CONFIG, ["anchor.method=rpb-hard", "prior=''"])


def test_anchored_loss_adds_the_term_once_per_micro_batch():
    """Megatron divides the loss function's sum by its token count: the term enters as term * num_tokens."""

    class Handle:
        loss_shares = 2  # two sequence-parallel ranks, each returning half the term
        method = type("Method", (), {"loss": object()})

        def __init__(self):
            self.term = torch.tensor(0.25, requires_grad=True)

        def loss(self):
            return self.term

        def report(self):  # the routing figures ride along
            return {"moe/mean/bias_changed_fraction": torch.tensor([3.0, 10.0])}

    def bridge_loss(output_tensor):
        losses, mask = output_tensor, torch.tensor([1.0, 1.0, 0.0, 1.0])
        total, num_tokens = (losses * mask).sum(), mask.sum().to(torch.int)
        return total, num_tokens, {"lm loss": torch.stack([total.detach(), num_tokens.float()])}

    handle, output = Handle(), torch.tensor([1.0, 2.0, 5.0, 3.0])
    loss, num_tokens, report = anchored_loss(bridge_loss, handle, output)
    assert int(num_tokens) == 3 and float(loss.detach() / num_tokens) == pytest.approx(6.0 / 3 + 0.25)
    loss.backward()
    assert float(handle.term.grad) == 3.0  # after Megatron's division by num_tokens: d/dterm = 1
    assert report["lm loss"].tolist() == [6.0, 3.0] and report[ANCHOR_LOSS_KEY].tolist() == [0.5, 1.0]
    assert report["moe/mean/bias_changed_fraction"].tolist() == [3.0, 10.0]
    # a micro-batch without targets still adds its routers' term
    empty, _, _ = anchored_loss(lambda o: (o.sum() * 0, torch.tensor(0, dtype=torch.int), {}), Handle(), output)
    assert float(empty.detach()) == pytest.approx(0.25)

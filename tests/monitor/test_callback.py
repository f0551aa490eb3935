"""The monitor inside a plain ``transformers.Trainer`` run (no rpb anchor): the bounded set of figures reaches
TensorBoard (read back from the event files), and an alarm fires on a run built to collapse a layer. A trainer's own
monitor (``attach_default_monitor``): asked for, it attaches; unasked, where the anchor has the base's routing at hand
(``routing-kd``), and off with one line under FSDP1, whose flat parameters it would refuse; a ``monitor:`` section
of ``rpb train`` asks for it."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from rpb.adapters import find_moe_layers, get_adapter
from rpb.errors import ConfigError
from rpb.monitor import FIGURES, MonitorConfig, attach_monitor
from rpb.monitor.callback import RoutingMonitorCallback, attach_default_monitor
from rpb.testing.models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


class Rows(torch.utils.data.Dataset):
    def __init__(self, n=16, width=10, vocab=64):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (n, width), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[:3] = -100
        return {"input_ids": self.ids[i], "labels": labels, "attention_mask": torch.ones_like(self.ids[i])}


def trainer(tmp_path, steps, callbacks=(), report_to=("tensorboard",), monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    model = build_tiny_model("qwen3_moe", vocab_size=64).train()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=5e-2,
        report_to=list(report_to),
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=Rows(), callbacks=list(callbacks))


def test_a_plain_trainer_logs_the_bounded_set_to_tensorboard(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = trainer(tmp_path, 3, monkeypatch=monkeypatch)
    attach_monitor(t)
    t.train()
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    tags = set(events.Tags()["scalars"])
    expected = {f"train/routing/{agg}/{name}" for agg in ("mean", "min", "max") for name in FIGURES}
    assert expected <= tags and not any("/layer_" in tag for tag in tags)  # bounded: no per-layer series
    overlap = [e.value for e in events.Scalars("train/routing/mean/topk_overlap")]
    kl = [e.value for e in events.Scalars("train/routing/mean/kl")]
    assert len(overlap) == 3 and overlap[0] == 1.0 and kl[0] == pytest.approx(0.0, abs=1e-7)  # step 1: the base
    assert kl[-1] > 0  # the routers trained away from the base


class Collapse(TrainerCallback):
    """After step 1, every router of the first MoE layer sends every token to experts 0 and 1."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            router = find_moe_layers(model, get_adapter("qwen3_moe"))[0].router
            collapse_hook(router)


def collapse_hook(router):
    def forward_hook(module, args, output):
        logits, gates, ids = output
        forced = torch.full_like(logits, -30.0)
        forced[:, :2] = 30.0
        return forced, gates, torch.tensor([[0, 1]]).expand_as(ids)

    router.register_forward_hook(forward_hook, prepend=True)  # the output every later hook (and the block) sees


class Keep(TrainerCallback):
    """What the logging integrations receive (they run after the monitor, as this does)."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.logs.append(dict(logs))


def test_an_alarm_fires_on_a_collapsing_layer_and_stops_training(tmp_path, caplog):
    keep = Keep()
    t = trainer(tmp_path, 4, callbacks=[Collapse(), keep], report_to=())
    attach_monitor(t, MonitorConfig(max_dead_fraction=0.7, stop_on_alarm=True))
    with caplog.at_level(logging.WARNING, logger="rpb.monitor"):
        t.train()
    logs = keep.logs
    assert logs[0]["routing/max/dead_fraction"] < 0.7 and "routing/alarm" not in logs[0]
    assert logs[1]["routing/max/dead_fraction"] == 0.75 and logs[1]["routing/alarm"] == 1.0  # 6 of 8 unused
    assert t.state.global_step == 2  # stopped at the alarm
    index = find_moe_layers(t.model, get_adapter("qwen3_moe"))[0].layer_index
    assert f"layer {index} left 0.750 of its experts unused (alarm above 0.7)" in caplog.text


class CountHooks(TrainerCallback):
    """The forward hooks on each router, at every step's end (while the monitor is attached)."""

    def __init__(self):
        self.counts = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.counts.append([len(m.router._forward_hooks) for m in find_moe_layers(model, get_adapter("qwen3_moe"))])


def test_on_an_anchored_trainer_it_reads_the_anchors_taps_beside_the_anchors_own_figures(tmp_path):
    from rpb.anchors import AnchorConfig, install_anchor
    from rpb.train.trainer import AnchorTrainer
    from tests.monitor.test_audit import Rows as KeyedRows

    model = build_tiny_model("qwen3_moe", vocab_size=64).train()
    handle = install_anchor(model, AnchorConfig(method="kl-to-base", lambda_=0.1))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=5e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    keep, hooks = Keep(), CountHooks()
    t = AnchorTrainer(model=model, args=args, train_dataset=KeyedRows(), anchor=handle, callbacks=[keep, hooks])
    callback = attach_monitor(t)
    t.train()
    assert hooks.counts == [[1, 1], [1, 1]] and callback.monitor.anchor is handle  # the anchor's hook alone
    for logs in keep.logs:  # both sets, each from its own counters
        assert {"routing/mean/topk_overlap", "moe/mean/base_topk_overlap_current_hidden"} <= logs.keys()
    # at step 1 both compare the base with itself; at step 2 both see the same moved routers on the same tokens
    # (the anchor counts every attended token, the monitor the loss tokens only: equal only at the base)
    assert keep.logs[0]["routing/mean/topk_overlap"] == 1.0 == keep.logs[0]["moe/mean/base_topk_overlap_current_hidden"]
    assert keep.logs[1]["routing/mean/kl"] > 0
    handle.remove()


def test_trainer_state_json_holds_the_figures_and_a_second_train_logs_them_again(tmp_path):
    """The figures (and the alarm count) reach state.log_history, so the checkpoint's trainer_state.json; the
    logging callbacks after the monitor see them; a second train() on the same trainer logs them again."""
    keep = Keep()
    t = trainer(tmp_path, 2, callbacks=[keep], report_to=())
    t.args.save_strategy, t.args.save_steps = "steps", 2
    attach_monitor(t, MonitorConfig(min_overlap=1.01))  # an alarm at every window: overlap never exceeds 1
    t.train()
    history = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    steps = [entry for entry in history if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    for entry, seen in zip(steps, keep.logs, strict=True):
        routing = {k: v for k, v in entry.items() if k.startswith("routing/")}
        assert len(routing) == 3 * len(FIGURES) + 1 and routing["routing/alarm"] == 1.0
        assert routing == {k: v for k, v in seen.items() if k.startswith("routing/")}
    first = len(keep.logs)
    t.train()  # the same trainer again: the monitor's hooks back on the routers
    again = keep.logs[first:]
    assert len(again) == 2 and all("routing/mean/kl" in logs for logs in again)
    assert all("routing/mean/kl" in entry for entry in t.state.log_history if "loss" in entry)
    assert again[0]["routing/mean/kl"] > 0  # the base is the first run's start, which both runs left


def stand_in(overlap: bool, **args):
    anchor = SimpleNamespace(overlap=object() if overlap else None, facts=SimpleNamespace(model_type="deepseek_v3"))
    return SimpleNamespace(
        anchor=anchor,
        args=TrainingArguments(output_dir="unused", use_cpu=True, report_to="none", **args),
        callback_handler=SimpleNamespace(callbacks=[]),
    )


FSDP1 = {"fsdp": "full_shard auto_wrap"}
FSDP2 = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["X"]}}


@pytest.mark.parametrize(
    ("overlap", "args", "config", "attached"),
    [
        (True, {}, None, True),  # routing-kd: the base's routing at hand
        (False, {}, None, False),  # no base at hand: off unless asked
        (False, {}, MonitorConfig(enabled=True), True),
        (True, {}, MonitorConfig(enabled=False), False),
        (True, FSDP2, None, True),  # FSDP2's shards are gathered
        (True, FSDP1, None, False),  # unasked under FSDP1: off, not a refusal
        (True, FSDP1, MonitorConfig(enabled=True), True),  # asked: attached (refused at the first step, by name)
    ],
)
def test_the_monitor_attaches_where_asked_or_where_the_base_is_at_hand(overlap, args, config, attached, caplog):
    t = stand_in(overlap, **args)
    with caplog.at_level(logging.INFO, logger="rpb.monitor"):
        callback = attach_default_monitor(t, config)
    assert (callback is not None) == attached
    assert t.callback_handler.callbacks == ([callback] if attached else [])
    if attached:
        assert isinstance(callback, RoutingMonitorCallback) and callback.anchor is t.anchor
    said = [r.getMessage() for r in caplog.records if "FSDP1" in r.getMessage()]
    assert len(said) == (1 if (args is FSDP1 and config is None) else 0)


def test_a_monitor_section_asks_for_the_monitor_and_its_fields_are_checked(tmp_path):
    from rpb.train.config import load_config

    data = tmp_path / "train.jsonl"
    data.write_text("")
    common = ["model=m", f"data_jsonl={data}", f"output_dir={tmp_path}", "train.max_seq_len=8", "anchor.method=sft"]
    assert load_config(None, common).monitor == MonitorConfig()  # unasked: on where the base is at hand
    assert load_config(None, [*common, "monitor.every_n_steps=5"]).monitor == MonitorConfig(True, 5)
    assert load_config(None, [*common, "monitor.enabled=false"]).monitor.enabled is False
    with pytest.raises(ConfigError) as e:
        load_config(None, [*common, "monitor.every_n_steps=0", "monitor.router_transform=tanh", "monitor.bogus=1"])
    said = "\n".join(e.value.problems)
    assert all(k in said for k in ("monitor.every_n_steps", "monitor.router_transform", "monitor.bogus: unknown key"))


@pytest.mark.parametrize(("method", "said"), [("router-freeze", 1), ("kl-to-base", 0)])
def test_the_first_line_points_frozen_routers_with_nothing_holding_the_routing_to_routing_kd(method, said, caplog):
    from rpb.anchors import AnchorConfig, install_anchor
    from rpb.monitor.verdict import FROZEN_ROUTERS_NOTE

    model = build_tiny_model("qwen3_moe", vocab_size=64).train()
    handle = install_anchor(model, AnchorConfig.for_method(method, lambda_=0.1))
    callback = RoutingMonitorCallback(anchor=handle)
    with caplog.at_level(logging.WARNING, logger="rpb.monitor"):
        callback.on_train_begin(None, None, None, model=model)
        callback.on_train_end(None, None, None)
        callback.on_train_begin(None, None, None, model=model)  # a second train(): said once
    assert [r.getMessage() for r in caplog.records].count(f"rpb monitor: {FROZEN_ROUTERS_NOTE}") == said
    callback.on_train_end(None, None, None)
    handle.remove()

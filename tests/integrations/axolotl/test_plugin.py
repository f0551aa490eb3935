"""The axolotl plugin through axolotl's real train entry (``python -m axolotl.cli.train run.yaml``).

Which path runs: axolotl imports under the CPU torch pin, so this is the real entry, not hooks called by
hand. ``make venv`` installs axolotl 0.19.0 and the Hugging Face stack it pins (transformers 5.16.1,
trl 1.9.0, ...) with ``--no-deps`` into ``.venv/axolotl`` (``pins.txt``); each run is a subprocess with that
folder first on PYTHONPATH, so axolotl runs with its own versions and this process keeps rpb's. A second
plugin (``recorder.py``) records what the run did; everything is checked here against a selection written
out from the router's own logits and the prior file (``tests/hand_routing.py``), not against rpb.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiktoken
import torch
import yaml
from tiktoken.load import load_tiktoken_bpe
from transformers import AutoTokenizer

from rpb.collect import collect
from rpb.prior.artifact import load_artifact
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.models import ARCHITECTURES
from tests.hand_routing import hand_select, token_bias

ROOT = Path(__file__).resolve().parents[3]
#: beside the interpreter running the tests (the repository's .venv; the same in a mutant's scratch copy)
FOLDER = Path(sys.prefix) / "axolotl"
PINS = Path(__file__).with_name("pins.txt")
STEPS, BATCH = 2, 4


def axolotl_folder() -> Path:
    assert (FOLDER / "axolotl").is_dir(), f"{FOLDER} is missing: `make venv` installs axolotl there ({PINS.name})"
    return FOLDER


@pytest.fixture(scope="module")
def work(tmp_path_factory, save_tiny):
    """Two tiny bases with their priors: Moonlight (sigmoid + correction bias) and a Qwen3-MoE whose config
    switches its native load-balancing loss on (output_router_logits true, coefficient 0.001)."""
    tmp = tmp_path_factory.mktemp("axolotl")
    data = write_jsonl(conversations(12, seed=3), tmp / "train.jsonl")
    out = {"data": data, "tmp": tmp}
    for arch, overrides in (("moonlight", {}), ("qwen3_moe", {"output_router_logits": True})):
        model = save_tiny(arch, **overrides)
        prior = tmp / f"{arch}.safetensors"
        top_k = ARCHITECTURES[arch][1]["num_experts_per_tok"]
        collect(str(model), data, prior, top_k=top_k, max_seq_len=192, progress=False)
        out[arch] = (model, prior)
    return out


def axolotl_yaml(work, arch: str, name: str, rpb: dict, **settings) -> Path:
    """The YAML of one axolotl run of ``STEPS`` steps on the arch's base, under ``work["tmp"]``."""
    model, prior = work[arch]
    config = {
        "base_model": str(model),
        "plugins": ["rpb.integrations.axolotl.RpbPlugin", "tests.integrations.axolotl.recorder.RecordRouting"],
        "rpb": {"prior": str(prior), **rpb},
        "datasets": [{"path": str(work["data"]), "type": "chat_template"}],
        "sequence_len": 192, "micro_batch_size": BATCH, "gradient_accumulation_steps": 1, "max_steps": STEPS,
        "num_epochs": 1, "learning_rate": 1e-3, "optimizer": "adamw_torch", "lr_scheduler": "constant",
        "output_dir": str(work["tmp"] / name), "logging_steps": 1, "save_strategy": "no", "seed": 7, "bf16": False,
        "fp16": False, "tf32": False, "dataloader_num_workers": 0, **settings,
    }  # fmt: skip
    path = work["tmp"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def under_axolotl(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python ARGS`` with axolotl's folder first on the path (its transformers shadows rpb's), then this
    checkout's rpb and tests; it must succeed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    search = [str(axolotl_folder()), str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env.update(PYTHONPATH=os.pathsep.join(search), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               AXOLOTL_DO_NOT_TRACK="1", DO_NOT_TRACK="1", WANDB_MODE="disabled")  # fmt: skip
    done = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return done


def run_axolotl(work, arch: str, name: str, rpb: dict, **settings) -> tuple[dict, Path]:
    """One axolotl run of ``STEPS`` steps on the arch's base; returns the recorder's record and output_dir."""
    under_axolotl(["-m", "axolotl.cli.train", str(axolotl_yaml(work, arch, name, rpb, **settings))], work["tmp"])
    out = work["tmp"] / name
    return json.loads((out / "record.json").read_text()), out


def test_pins_are_the_plugins_tested_version():
    from rpb.integrations.axolotl import config  # the pure half: the plugin module itself imports axolotl

    pins = dict(line.split("==") for line in PINS.read_text().splitlines() if line and not line.startswith("#"))
    tested = next(
        line.split('"')[1] for line in (ROOT / "src/rpb/integrations/axolotl/plugin.py").read_text().splitlines()
        if line.startswith("TESTED_AXOLOTL =")
    )  # fmt: skip
    assert pins["axolotl"] == tested
    installed = [p.name for p in axolotl_folder().glob("axolotl-*.dist-info")]
    assert installed == [f"axolotl-{tested}.dist-info"], installed
    assert config.RpbArgs.model_fields["rpb"].default is None


def test_per_step_selection_through_axolotl_equals_the_hand_selection(work):
    beta = 1.0
    record, out = run_axolotl(work, "moonlight", "rpb", {"anchor": {"method": "rpb", "beta": beta},
                                                        "monitor": {"every_n_steps": 1}})  # fmt: skip
    facts = record["facts"]
    print("path that ran:", facts["entry"], "axolotl", facts["axolotl"], "transformers", facts["transformers"])
    assert facts["axolotl"] == "0.19.0" and facts["entry"].startswith("axolotl.cli.train")
    mro = facts["trainer_mro"]  # rpb's mixins (the anchor, then the routing hold) before axolotl's trainer
    assert mro[1:4] == ["AnchorTrainerMixin", "HoldingTrainer", "AxolotlTrainer"]
    assert facts["collator"] == "AxolotlAnchorCollator" and facts["remove_unused_columns"] is False

    # each batch row is the JSONL row its sample key names: that row rendered by the tokenizer's own template
    tok = AutoTokenizer.from_pretrained(work["moonlight"][0])
    rows = [json.loads(line) for line in work["data"].read_text().splitlines()]
    for batch in record["batches"]:
        for ids, mask, sample in zip(batch["input_ids"], batch["attention_mask"], batch["sample"], strict=True):
            x = sample[0]
            rendered = tok.apply_chat_template(rows[x]["messages"], tokenize=True, return_dict=False)
            assert [t for t, m in zip(ids, mask, strict=True) if m] == list(rendered), f"row {x}"

    pi = load_artifact(work["moonlight"][1]).prior_qa
    k = ARCHITECTURES["moonlight"][1]["num_experts_per_tok"]
    # the data loader collates one batch ahead: batches and forwards pair in order
    assert len(record["forwards"]) == STEPS <= len(record["batches"])
    for batch, forward in zip(record["batches"][:STEPS], record["forwards"], strict=True):
        sample_T, span_T = torch.tensor(batch["sample"]).reshape(-1), torch.tensor(batch["span"]).reshape(-1)
        assert len(forward) == facts["routers"] == 2 and ((sample_T >= 0) & (span_T >= 0)).any()
        for layer, seen in enumerate(forward):
            z_TE = torch.tensor(seen["logits"])
            expert_bias = torch.tensor(seen["expert_bias"]) if seen["expert_bias"] is not None else None
            hand = hand_select(z_TE, token_bias(pi, layer, sample_T, span_T, beta), k, expert_bias)
            assert [frozenset(c) for c in seen["chosen"]] == hand, f"layer {layer}"
    train_logs = [log for log in record["logs"] if "loss" in log]
    assert len(train_logs) == STEPS
    for log in train_logs:  # rpb did act: tokens moved to other experts, so this is not sft
        assert log["moe/mean/bias_changed_fraction"] > 0, log
        assert 0 < log["routing/mean/topk_overlap"] <= 1  # rpb.monitor ran through the plugin
    run = json.loads((out / "rpb_run.json").read_text())
    assert run["method"] == "rpb" and run["rows"] == 12


def test_loss_anchor_gets_non_reentrant_checkpointing_and_no_native_aux_loss(work):
    record, out = run_axolotl(work, "qwen3_moe", "kl", {"anchor": {"method": "kl-to-base", "lambda": 0.1}},
                              gradient_checkpointing=True)  # fmt: skip
    facts = record["facts"]
    # axolotl's own default with checkpointing on is reentrant, which would cut the loss term off
    assert facts["gradient_checkpointing"] and facts["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert record["output_router_logits_while_training"] is False  # the config asked for the native loss
    train_logs = [log for log in record["logs"] if "loss" in log]
    assert len(train_logs) == STEPS and all(log["anchor_loss"] >= 0 for log in train_logs)
    assert any(log["anchor_loss"] > 0 for log in train_logs[1:])  # the routers moved: the term is live
    saved = json.loads((out / "config.json").read_text())
    assert saved["output_router_logits"] is True  # the anchor left with post_train: the model's own value


def test_routing_kd_through_axolotl_holds_to_the_bases_own_forward(work):
    """routing-kd's online base under axolotl (transformers 5.16): a frozen copy of the checkpoint; the first step
    trains the base itself, so its term is 0, and the next one's is not."""
    record, out = run_axolotl(work, "qwen3_moe", "routing-kd", {"anchor": {"method": "routing-kd", "lambda": 1.0}})
    train_logs = [log for log in record["logs"] if "loss" in log]
    assert len(train_logs) == STEPS
    assert train_logs[0]["anchor_loss"] == pytest.approx(0.0, abs=1e-6) and train_logs[-1]["anchor_loss"] > 0
    # with no monitor asked, the routing keys rpb train logs: the step's overlap and the monitor's (on by default)
    keys = {"anchor/overlap", "anchor/overlap_min", "routing/mean/base_forward_topk_overlap"}
    assert all(keys <= log.keys() for log in train_logs)
    assert train_logs[0]["anchor/overlap"] == 1.0 == train_logs[0]["routing/mean/base_forward_topk_overlap"]
    run = json.loads((out / "rpb_run.json").read_text())
    assert run["method"] == "routing-kd" and run["base"]["mode"] == "frozen-copy"


#: axolotl's own config loading (which registers the plugins) and its own tokenizer loader, nothing of rpb's
LOAD_TOKENIZER = """
import json, sys
from axolotl.cli.config import load_cfg
from axolotl.loaders.tokenizer import load_tokenizer
tok = load_tokenizer(load_cfg(sys.argv[1]))
print(json.dumps({"class": type(tok).__name__, "ids": tok(sys.argv[2], add_special_tokens=False)["input_ids"]}))
"""


def test_moonlights_remote_tokenizer_loads_through_axolotls_own_loader(work):
    """axolotl 0.19's transformers (5.16.1) has no ``bytes_to_unicode`` where Moonlight's tokenizer code imports
    it from: the plugin puts it back at ``register``, so axolotl's own loader gets the vendor's class, which
    encodes as tiktoken does on the same ranks."""
    from tests.moonshot_tokenizer import moonshot_tokenizer_dir, standin_pattern

    moon = moonshot_tokenizer_dir(work["tmp"] / "moonshot-tok")
    path = axolotl_yaml(work, "moonlight", "moonshot-tokenizer", {"anchor": {"method": "rpb"}},
                        tokenizer_config=str(moon), trust_remote_code=True)  # fmt: skip
    text = "What is 2+2? It is 4. 专家路由 don't"
    done = under_axolotl(["-c", LOAD_TOKENIZER, str(path), text], work["tmp"])
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    reference = tiktoken.Encoding(
        "reference",
        pat_str=standin_pattern(),
        mergeable_ranks=load_tiktoken_bpe(str(moon / "tiktoken.model")),
        special_tokens={},
    )
    assert loaded == {"class": "TikTokenTokenizer", "ids": reference.encode(text)}

"""Contract tests against the real Megatron-Bridge wheels, one line at a time, on CPU.

``make venv`` puts each tested line's wheels in ``.venv/bridge/<line>`` (``pip install --no-deps
--target``; ``rpb.integrations.megatron.versions.TESTED_LINES`` pins them). ``bridge_line.py`` runs in a
subprocess per line with only that folder on ``PYTHONPATH``, so no two lines, and neither line and rpb's
transformers 5.24, ever share an environment:

- v0.3.1 runs on this Python with its own transformers 4.x: Bridge's SFT dataset, sampler, micro-batch
  split and loss are imported and run on a small data file labelled by rpb; the modules that import
  Transformer Engine or ModelOpt at import time (GPU-only) are parsed, and named.
- 0.6.2 needs Python 3.12: its wheel's metadata is read and its source parsed.

Token parity: the tokens and spans Bridge's dataset hands to the model under transformers 4.57 equal,
row by row (``Example.token_sha256``), what rpb labels here under transformers 5.24 -- the labelling
``rpb collect`` keys the prior with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from rpb.data import load_labelled
from rpb.integrations.megatron import bridge
from rpb.integrations.megatron.config import load_megatron_config
from rpb.integrations.megatron.guard import RUN_CONTRACT
from rpb.integrations.megatron.versions import TESTED_LINES
from rpb.models import load_tokenizer
from rpb.testing.data import conversations, write_jsonl
from tests.moonshot_tokenizer import moonshot_tokenizer_dir

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("bridge_line.py")
LINES = {line.bridge: line for line in TESTED_LINES}
ROWS = 6


def line_folder(bridge_version: str) -> Path:
    folder = ROOT / ".venv" / "bridge" / bridge_version
    assert folder.is_dir(), f"{folder} is missing: `make venv` installs each tested Megatron-Bridge line there"
    return folder


class Recorder:
    """A ConfigContainer stand-in that records every ``section.field`` assigned to it (unset fields read None)."""

    def __init__(self, log: list[str], prefix: str = ""):
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_values", {})

    def __getattr__(self, name):
        values = object.__getattribute__(self, "_values")
        if name not in values:
            values[name] = None if self._prefix else Recorder(self._log, name)
        return values[name]

    def __setattr__(self, name, value):
        self._values[name] = value
        self._log.append(f"{self._prefix}.{name}")


def fields_rpb_sets(monkeypatch) -> dict[str, list[str]]:
    """What ``build_container`` assigns, recorded on a stand-in recipe: the run's own fields, and the run
    contract's (which a line without the field skips)."""
    import types

    log: list[str] = []
    module = types.ModuleType("megatron.bridge.recipes.moonlight")
    module.moonlight_16b_sft_config = lambda: Recorder(log)
    monkeypatch.setitem(sys.modules, "megatron.bridge.recipes.moonlight", module)
    bridge.build_container(load_megatron_config(None, ["model.pretrained_checkpoint=/c", "data.root=/d",
                                                       "train.output_dir=/o", "prior=/p"]))  # fmt: skip
    fields = sorted(set(log))
    return {
        "required": [f for f in fields if f not in RUN_CONTRACT],
        "contract": [f for f in fields if f in RUN_CONTRACT],
    }


@pytest.fixture(scope="module")
def work(tmp_path_factory, moon_tok):
    """The data file, a tokenizer both transformers lines load, and the fields rpb sets."""
    work = tmp_path_factory.mktemp("bridge-lines")
    write_jsonl(conversations(ROWS, seed=1), work / "data.jsonl")
    moon_tok.save_pretrained(work / "tok")
    moonshot_tokenizer_dir(work / "moon")  # Moonlight's own kind: remote code over tiktoken ranks
    # transformers 5 writes its backend's class name and the extra special tokens as a list; 4.x reads neither
    config_path = work / "tok" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = config.pop("extra_special_tokens", [])
    config_path.write_text(json.dumps(config))
    with pytest.MonkeyPatch.context() as m:
        (work / "paths.json").write_text(json.dumps(fields_rpb_sets(m)))
    return work


def run_line(bridge_version: str, work: Path, on_path: bool) -> dict:
    folder = line_folder(bridge_version)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if on_path:
        env["PYTHONPATH"] = str(folder)
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, str(WORKER), bridge_version, str(folder), str(work)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=work)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"megatron-bridge {bridge_version}:", json.dumps(report["objects"], indent=1))
    return report


@pytest.fixture(scope="module")
def v031(work):
    return run_line("0.3.1", work, on_path=True)


@pytest.fixture(scope="module")
def v062(work):
    return run_line("0.6.2", work, on_path=False)


#: rpb's keyword arguments to Bridge's GPTSFTDataset (``bridge.rpb_sft_dataset``)
SFT_KWARGS = ("file_path", "tokenizer", "max_seq_length", "seed", "max_num_samples", "prompt_template", "label_key",
              "truncation_field", "memmap_workers")  # fmt: skip


def check_source_contract(report: dict) -> None:
    """What both lines are held to by their source: the recipe name rpb starts from, finetune(config,
    forward_step_func), a forward step that may be asked for a schedule plan (the guard refuses it), Bridge's
    own signature test injecting the state into rpb's forward step, the dataset's keyword arguments, and every
    field rpb sets existing in the section's class."""
    assert report["recipe"] == {"moonlight_16b_sft_config exported": True}
    assert report["finetune"][:2] == ["config", "forward_step_func"]
    assert report["forward_step"] == ["state", "data_iterator", "model", "return_schedule_plan"]
    assert report["state_injected"] is True
    assert set(SFT_KWARGS) <= set(report["sft_dataset"]["init"])
    missing = [path for path, found in report["fields"].items() if not found]
    assert report["fields"] and missing == [], f"fields rpb sets that this line's classes lack: {missing}"
    # the run contract's too: a field a line lacks would be skipped there, and the contract would not hold
    absent = [path for path, found in report["contract_fields"].items() if not found]
    assert sorted(report["contract_fields"]) == sorted(RUN_CONTRACT) and absent == [], absent


def test_v031_runs_under_its_own_transformers_4(v031):
    assert v031["imports"] and v031["transformers"].startswith("4."), v031.get("transformers")
    assert v031["rpb_modules"] == "imported"  # rpb's anchors and Megatron path under transformers 4
    assert v031["python"] == f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"


def test_v031_imports_what_imports_on_cpu_and_names_what_it_parses(v031):
    imported = sorted(k for k, v in v031["objects"].items() if v == "imported")
    assert imported == [
        "megatron.bridge.data.datasets.sft.GPTSFTDataset",
        "megatron.bridge.data.finetuning.prepare_finetuning_batch",
        "megatron.bridge.data.samplers.build_pretraining_data_loader",
        "megatron.bridge.training.losses.masked_next_token_loss",
    ]
    # the rest import Transformer Engine (or ModelOpt) at import time: each named with what stops it
    parsed = {k: v for k, v in v031["objects"].items() if v != "imported"}
    assert parsed and all(v.startswith("parsed (") and ("transformer_engine" in v or "modelopt" in v)
                          for v in parsed.values()), parsed  # fmt: skip
    assert "megatron.bridge.training.gpt_step.forward_step" in parsed


def test_v031_dataset_reads_rpbs_rows_in_a_seeded_order_and_bridges_split_keeps_rpbs_keys(v031, work, moon_tok):
    ds = v031["dataset"]
    assert ds["rows"] == ROWS and ds["len"] == 2 * ROWS  # two epochs of samples
    orders = ds["orders"]
    assert orders["42"] != orders["43"]  # data.seed changes the order
    for order in orders.values():
        assert sorted(order[:ROWS]) == sorted(order[ROWS:]) == list(range(ROWS))  # each epoch every row once
    # Bridge's sampler gave a global batch of 4, its own split two micro-batches of 2, each with rpb's keys
    # taken off by ContextIterator (which set the anchor's context from them) and Bridge's left
    last = orders["43"]
    assert v031["micro_batches"]["samples"] == [last[0:2], last[2:4]]
    assert v031["micro_batches"]["keys"] == [["labels", "loss_mask", "position_ids", "tokens"]] * 2


def test_token_parity_bridges_dataset_under_4x_equals_rpbs_labelling_under_5(v031, work):
    import transformers

    assert transformers.__version__.startswith("5.")
    data = load_labelled(str(work / "data.jsonl"), load_tokenizer(str(work / "tok")), 256)
    here = {str(e.index): e.token_sha256 for e in data.examples}
    assert v031["dataset"]["token_sha256"] == here


def test_token_parity_holds_for_moonlights_kind_of_tokenizer(v031, work):
    """The remote tiktoken tokenizer (tests/moonshot_tokenizer.py) loaded under transformers 4.57 for Bridge's
    dataset and under transformers 5 (with rpb's import shim) for rpb's labelling: the same tokens and spans."""
    data = load_labelled(str(work / "data.jsonl"), load_tokenizer(str(work / "moon"), trust_remote_code=True), 256)
    here = {str(e.index): e.token_sha256 for e in data.examples}
    assert v031["moonshot"]["tokenizer"] == "TikTokenTokenizer" and len(here) == ROWS
    assert v031["moonshot"]["token_sha256"] == here
    assert here != {str(k): v for k, v in v031["dataset"]["token_sha256"].items()}  # another tokenizer's tokens


def test_v031_loss_function_returns_what_the_anchor_wraps(v031):
    # masked_next_token_loss on losses [2, 3, 9] with mask [1, 1, 0]: sum 5 over 2 tokens, reported as lm loss
    assert v031["loss"]["plain"] == [5.0, 2, ["lm loss"]]
    assert v031["loss"]["wrapped"] == v031["loss"]["plain"]  # a method without a loss passes it through


@pytest.mark.parametrize("which", ["0.3.1", "0.6.2"])
def test_each_lines_source_holds_what_rpb_uses(which, request):
    check_source_contract(request.getfixturevalue("v031" if which == "0.3.1" else "v062"))


def test_v062_finds_the_sft_dataset_where_it_moved(v062, v031):
    assert v062["sft_dataset"]["module"] == "megatron/bridge/data/datasets/gpt_sft.py"
    assert v031["sft_dataset"]["module"] == "megatron/bridge/data/datasets/sft.py"
    assert v062["imports"] is False and all(v.startswith("parsed (Python 3.12") for v in v062["objects"].values())
    # nothing of 0.6.2 ran under rpb's transformers: its source was read (the transformers printed is rpb's)
    assert v062["transformers"].startswith("5.") and "dataset" not in v062


@pytest.mark.parametrize("which", ["0.3.1", "0.6.2"])
def test_each_wheels_metadata_is_its_pinned_line(which):
    meta = Parser().parsestr((next(line_folder(which).glob("megatron_bridge-*.dist-info")) / "METADATA").read_text())
    line = LINES[which]
    assert meta["Version"] == which
    assert SpecifierSet(meta["Requires-Python"]) == SpecifierSet(line.python)
    transformers = next(Requirement(r) for r in meta.get_all("Requires-Dist") if r.startswith("transformers"))
    assert transformers.specifier == SpecifierSet(line.transformers)
    rpb = next(
        Requirement(r) for r in (ROOT / "pyproject.toml").read_text().split('"') if r.startswith("transformers>=")
    )
    # only the newer line shares a transformers with rpb: v0.3.1 needs an environment of its own
    shared = [v for v in ("4.57.3", "5.8.0", "5.12.1", "5.24.0") if v in rpb.specifier and v in transformers.specifier]
    assert bool(shared) is (which == "0.6.2"), shared


def test_the_docs_table_of_objects_is_the_reports(v031, v062):
    """docs/megatron.md carries, per object rpb touches, how each line was checked."""
    text = (ROOT / "docs" / "megatron.md").read_text()
    for name in sorted(set(v031["objects"]) | set(v062["objects"])):
        row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"docs/megatron.md has no row for {name}"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:] == [v031["objects"].get(name, "absent"), v062["objects"].get(name, "absent")], name

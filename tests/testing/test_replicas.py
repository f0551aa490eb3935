"""``rpb.testing.replica``: every shipped family saved with its vendor's chat template and read back as rpb reads
a checkpoint; the names it answers to; the registry as docs/models.md documents it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rpb.models import load_causal_lm, load_tokenizer
from rpb.testing import FAMILIES, REPLICAS, replica
from rpb.testing.replicas import CONFIGS, build_replica, family_of, source
from rpb.testing.vendors import sources, template_text

#: the template each replica must carry, written from the vendors' releases: the checkpoint line's own where
#: vendored (OWN), else the stand-in docs/models.md names
EXPECTED = {
    "deepseek_v3": "deepseek_v3_1", "kimi_k2": "kimi_k2", "deepseek_v2_lite": "deepseek_v3_1",
    "qwen3_30b_a3b": "qwen3", "qwen1_5_moe_a2_7b": "qwen3", "mixtral_8x7b": "mixtral", "olmoe_1b_7b": "qwen3",
    "gpt_oss_20b": "gpt_oss", "glm4_5_air": "glm_4_6", "minimax_m2": "qwen3", "qwen3_5_moe": "qwen3",
}  # fmt: skip
OWN = {"kimi_k2", "qwen3_30b_a3b", "mixtral_8x7b", "gpt_oss_20b", "glm4_5_air"}
DOC = Path(__file__).parents[2] / "docs" / "models.md"


def org(hub_id: str) -> str:
    return hub_id.split("/", 1)[0]


@pytest.mark.parametrize("name", REPLICAS)
def test_each_replica_carries_its_vendor_template_and_loads_as_a_checkpoint(name, replica):
    """The session's replica (built through ``rpb.testing.replica``): rpb's own loaders read the folder, its
    template is the vendored file byte for byte, and every token id has an embedding row."""
    assert name in EXPECTED, f"{name}: a new replica; add its vendor's template to EXPECTED"
    folder = replica(name)
    tok = load_tokenizer(str(folder))
    assert tok.chat_template == template_text(EXPECTED[name])
    assert (FAMILIES[name].stand_in is None) == (name in OWN)
    if name in OWN:  # the template comes from the checkpoint's own vendor
        assert org(sources()[f"{EXPECTED[name]}.jinja"]["checkpoint"]) == org(source(name)["checkpoint"])
    model = load_causal_lm(str(folder))
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                                   tokenize=False)  # fmt: skip
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert min(ids) >= 0 and max(ids) < len(tok)


def test_a_family_is_named_by_its_stem_its_hub_id_or_that_ids_last_part():
    for name in ("gpt_oss_20b", "openai/gpt-oss-20b", "GPT-OSS-20B"):
        assert family_of(name).name == "gpt_oss_20b"
    assert family_of("Qwen/Qwen3.5-35B-A3B").name == "qwen3_5_moe"
    with pytest.raises(ValueError, match=r"no shipped replica 'llama'.*minimax_m2 \(MiniMaxAI/MiniMax-M2\)"):
        family_of("llama")
    assert {p.stem for p in CONFIGS.glob("*.json")} - {"SOURCES"} == set(REPLICAS)


def test_a_replica_without_a_folder_goes_to_a_new_temporary_one(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = replica("mistralai/Mixtral-8x7B-v0.1", seed=3)
    assert folder.parent == tmp_path and folder.name.startswith("rpb-replica-mixtral_8x7b-")
    tok = load_tokenizer(str(folder))
    assert tok.chat_template == template_text("mixtral")
    saved = load_causal_lm(str(folder)).state_dict()
    built = build_replica("mixtral_8x7b", vocab_size=len(tok), seed=3).state_dict()
    assert saved.keys() == built.keys() and all(torch.equal(saved[k], built[k]) for k in saved)
    again = replica("mixtral_8x7b", tmp_path / "mine" / "deeper")  # a folder of the caller's, made if missing
    assert again == tmp_path / "mine" / "deeper" and (again / "config.json").is_file()


def test_the_documented_table_is_the_registry():
    text = DOC.read_text()
    table = text[text.index("### A replica of your own") :]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| `(\w+)` \|([^|]*)\|$", table, flags=re.M)
    documented = {name: (checkpoint.strip(), template, why.strip()) for name, checkpoint, template, why in rows}
    assert documented == {
        n: (source(n)["checkpoint"], f.template, f.stand_in or "") for n, f in FAMILIES.items()
    }  # fmt: skip

"""Loading models and tokenizers: named errors for what cannot be loaded, one list of dtypes, the pad id."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rpb.errors import ArgumentError
from rpb.models import DTYPES, ModelLoadError, load_base_model, load_causal_lm, load_tokenizer, pad_id_of, torch_dtype


def test_what_cannot_be_loaded_is_named(tmp_path):
    for load in (load_tokenizer, load_causal_lm, lambda p: load_base_model(p, device="cpu")):
        with pytest.raises(ModelLoadError, match=str(tmp_path / "missing")):
            load(str(tmp_path / "missing"))


@pytest.mark.parametrize("name", ["/no/such/model", "./runs/missing", "~/missing-model-folder", "runs/base/final"])
def test_a_local_folder_that_does_not_exist_is_said_so_not_a_repo_id_form(name):
    """transformers answers a missing local path with 'Repo id must be in the form ...': rpb says which folder."""
    for load in (load_tokenizer, load_causal_lm, lambda p: load_base_model(p, device="cpu")):
        with pytest.raises(ModelLoadError, match=f"no folder {name} \\(a local path; a hub id is 'org/name'\\)"):
            load(name)


def test_dtypes_are_one_list():
    assert {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16} == DTYPES
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ArgumentError, match="float64"):
        torch_dtype("float64")


def word_tokenizer(pad: str | None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose vocabulary puts "<pad>" at id 3 and "<unk>" at 2, away from the fallback 0."""
    vocab = {"a": 0, "b": 1, "<unk>": 2, "<pad>": 3}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token=pad)


def check_pad_id(moon_tok) -> None:
    """The pad id is the id the vocabulary gives the pad token string; 0 only when there is no pad token."""
    assert pad_id_of(word_tokenizer("<pad>")) == 3  # the id written in word_tokenizer's vocabulary
    assert pad_id_of(word_tokenizer("b")) == 1  # any token may serve as pad: its own id, not a fixed one
    # Moonlight's test tokenizer: "<|pad|>" is the first entry of its vocabulary
    assert moon_tok.backend_tokenizer.token_to_id("<|pad|>") == 0 and pad_id_of(moon_tok) == 0
    assert pad_id_of(word_tokenizer(None)) == 0  # no pad token: the fallback

    class NoPad:
        pad_token_id = None

    assert pad_id_of(NoPad()) == 0


def test_pad_id_falls_back_to_zero(moon_tok):
    check_pad_id(moon_tok)


@pytest.mark.parametrize(
    "bug",
    [
        lambda tok: 0,  # padding with 0 whatever the tokenizer says
        lambda tok: tok.pad_token_id,  # no fallback: None reaches the batch
        lambda tok: getattr(tok, "unk_token_id", 0) if tok.pad_token_id is None else tok.pad_token_id,  # unk
    ],
    ids=["always_zero", "no_fallback", "unk_fallback"],
)
def test_mutant_pad_id_is_caught(bug, moon_tok, monkeypatch):
    monkeypatch.setattr(f"{__name__}.pad_id_of", bug)
    with pytest.raises(AssertionError):
        check_pad_id(moon_tok)


def with_config(model_dir, tmp_path, **changes):
    """A copy of ``model_dir`` whose config.json has ``changes`` (weights untouched)."""
    import json
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def no_weights_read(monkeypatch):
    """Any weight load fails the test: refusals must come before."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    for cls in (transformers.AutoModel, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", refuse)


@pytest.mark.parametrize(
    ("arch", "changes", "named"),
    [
        ("moonlight", {"scoring_func": "softmax"}, "scoring_func='softmax': transformers' deepseek_v3 class ignores"),
        ("moonlight", {"topk_method": "greedy"}, "topk_method='greedy'"),
        ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob=True: transformers' deepseek_v2 class ignores it and "
                                                   "never renormalises"),
        ("moonlight", {"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8'"),
        ("replica:minimax_m2", {"use_routing_bias": False},
         "use_routing_bias=False: transformers' minimax_m2 class ignores it"),
    ],
)  # fmt: skip
def test_what_the_native_class_would_run_otherwise_is_refused_before_any_weight(
    arch, changes, named, save_tiny, replica, tmp_path, monkeypatch
):
    model_dir = replica(arch.removeprefix("replica:")) if arch.startswith("replica:") else save_tiny(arch)
    edited = with_config(model_dir, tmp_path, **changes)
    no_weights_read(monkeypatch)
    for load in (lambda p: load_causal_lm(p), lambda p: load_base_model(p, device="cpu")):
        with pytest.raises(ModelLoadError, match="refused before loading its weights") as err:
            load(str(edited))
        assert named in str(err.value)


def test_the_published_routing_values_are_the_implemented_ones():
    """Every vendored checkpoint's config as it ships (rpb/testing/configs) passes."""
    import json

    from transformers import AutoConfig

    from rpb.adapters import get_adapter
    from rpb.adapters.aliases import register_model_aliases
    from rpb.adapters.hf import unimplemented_routing

    register_model_aliases()
    from rpb.testing.replicas import CONFIGS, REPLICAS

    for name in REPLICAS:
        published = json.loads((CONFIGS / f"{name}.json").read_text())
        published = {k: v for k, v in published.items() if k != "model_type"} | {"_type": published["model_type"]}
        config = AutoConfig.for_model(published.pop("_type"), **published)
        assert unimplemented_routing(config, get_adapter(config.model_type)) == [], name
    # and a value off what the class does is named
    wrong = AutoConfig.for_model("deepseek_v3", scoring_func="softmax", topk_method="noaux_tc")
    assert unimplemented_routing(wrong, get_adapter("deepseek_v3")) == [
        "scoring_func='softmax': transformers' deepseek_v3 class ignores it and scores every expert with a sigmoid "
        "('sigmoid')"
    ]


def test_validate_reads_a_quantized_checkpoints_routers_as_they_are(save_tiny, tmp_path, monkeypatch):
    """rpb validate fingerprints the router tensors alone: a quantized checkpoint needs no dequantizing."""
    from rpb.adapters import checkpoint_routers_sha256

    plain = save_tiny("moonlight")
    edited = with_config(plain, tmp_path, quantization_config={"quant_method": "fp8"})
    no_weights_read(monkeypatch)
    assert checkpoint_routers_sha256(edited).routers_sha256 == checkpoint_routers_sha256(plain).routers_sha256

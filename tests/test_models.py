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

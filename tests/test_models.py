"""Loading models and tokenizers: named errors for what cannot be loaded, one list of dtypes, the pad id."""

from __future__ import annotations

import pytest
import torch

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


def test_pad_id_falls_back_to_zero(moon_tok):
    assert pad_id_of(moon_tok) == moon_tok.pad_token_id

    class NoPad:
        pad_token_id = None

    assert pad_id_of(NoPad()) == 0

"""Moonlight's remote tokenizer (tiktoken BPE behind transformers' slow-tokenizer API, loaded through
``auto_map``) under the transformers rpb runs on: it imports only with rpb's shim, it encodes as tiktoken does
with the Kimi pattern and puts the special tokens where Moonlight does, and rpb labels conversations on it
exactly and collects a prior with it. The remote module is a stand-in written for these tests
(tests/fixtures/moonshot; tests/moonshot_tokenizer.py builds the directory)."""

from __future__ import annotations

import itertools
import json

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from rpb.data import load_labelled
from rpb.models import load_tokenizer
from rpb.prior import SPAN_A, SPAN_Q
from tests.conftest import write_rows
from tests.moonshot_tokenizer import SPECIALS, moonshot_tokenizer_dir, standin_pattern

Q1, A1, Q2, A2, SYSTEM, R2 = "What is 2+2?", "It is 4.", "And 3+3?", "Six.", "Answer briefly.", "Three doubled."
TEXTS = ["What is 2+2? It is 4.", "HTTPServer's CamelCase, don't we'll 12345678", "专家路由 mixture\n\n  indented",
         "<|im_user|>user<|im_middle|>hi<|im_end|>", "ÉCOLE normale", ""]  # fmt: skip


@pytest.fixture(scope="module")
def moon_dir(tmp_path_factory):
    return moonshot_tokenizer_dir(tmp_path_factory.mktemp("moonshot") / "moonshot-tok")


def test_transformers_5_cannot_import_the_vendors_code_without_rpbs_shim(tmp_path, monkeypatch):
    import importlib

    from transformers import AutoTokenizer

    tokenization_gpt2 = importlib.import_module("transformers.models.gpt2.tokenization_gpt2")

    monkeypatch.delattr(tokenization_gpt2, "bytes_to_unicode", raising=False)  # as transformers 5 ships it
    path = moonshot_tokenizer_dir(tmp_path / "moonshot-noshim")
    with pytest.raises(ImportError, match="bytes_to_unicode"):
        AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    try:
        tok = load_tokenizer(str(path), trust_remote_code=True)
    except Exception as err:  # a failure to load is this test's finding, not an error in it
        pytest.fail(f"rpb could not load the remote tokenizer: {err}")
    assert type(tok).__name__ == "TikTokenTokenizer" and not tok.is_fast  # the vendor's class, slow


def test_it_encodes_as_tiktoken_with_the_kimi_pattern_and_moonlights_special_ids(moon_dir):
    tok = load_tokenizer(str(moon_dir), trust_remote_code=True)
    ranks = load_tiktoken_bpe(str(moon_dir / "tiktoken.model"))
    config = json.loads((moon_dir / "tokenizer_config.json").read_text())
    specials = {t["content"]: int(i) for i, t in config["added_tokens_decoder"].items()}
    reference = tiktoken.Encoding("reference", pat_str=standin_pattern(), mergeable_ranks=ranks,
                                  special_tokens=specials)  # fmt: skip
    for text in TEXTS:
        expected = reference.encode(text, allowed_special="all")
        assert tok(text, add_special_tokens=False)["input_ids"] == expected, text
        assert tok.encode(text) == expected and tok.decode(expected) == text
    assert any(len(reference.decode_single_token_bytes(i)) > 1 for i in reference.encode(TEXTS[0]))  # merges ran
    first = len(ranks)
    assert {t: tok.convert_tokens_to_ids(t) - first for t in SPECIALS.values()} == {t: k for k, t in SPECIALS.items()}
    assert (tok.bos_token_id, tok.eos_token_id) == (first, first + 1)  # 163584 and 163585 on the real ranks


def _runs(tok, example) -> dict[int, list[str]]:
    out = {SPAN_Q: [], SPAN_A: []}
    for span, run in itertools.groupby(zip(example.input_ids, example.span_ids, strict=True), key=lambda x: x[1]):
        if span in out:
            out[span].append(tok.decode([i for i, _ in run]))
    return out


def test_conversations_on_it_are_labelled_exactly(moon_dir, tmp_path):
    """Kimi-K2's template as shipped: one turn, two turns, a system prompt, and a think block in the content
    (which that template renders as it is: the reasoning, then the answer, all A)."""
    tok = load_tokenizer(str(moon_dir), trust_remote_code=True)
    think = f"<think>\n{R2}\n</think>\n\n{A2}"
    conversations = [
        [("user", Q1), ("assistant", A1)],
        [("user", Q1), ("assistant", A1), ("user", Q2), ("assistant", A2)],
        [("system", SYSTEM), ("user", Q1), ("assistant", A1)],
        [("user", Q2), ("assistant", think)],
    ]
    rows = [{"messages": [{"role": r, "content": c} for r, c in conv]} for conv in conversations]
    data = load_labelled(str(write_rows(tmp_path / "d.jsonl", rows)), tok, 4096)
    for conv, example in zip(conversations, data.examples, strict=True):
        got = _runs(tok, example)
        assert got[SPAN_Q] == [c for r, c in conv if r == "user"]
        expected_a = [c.removeprefix("<think>\n") for r, c in conv if r == "assistant"]  # its opening stays structural
        assert got[SPAN_A] == expected_a


def test_a_prior_is_collected_with_it(moon_dir, tmp_path):
    from rpb.collect import collect
    from rpb.testing.models import build_tiny_model

    tok = load_tokenizer(str(moon_dir), trust_remote_code=True)
    model_dir = tmp_path / "model"
    build_tiny_model("moonlight", vocab_size=len(tok)).save_pretrained(model_dir)
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in ((Q1, A1), (Q2, A2), (SYSTEM, Q1))]  # fmt: skip
    data = write_rows(tmp_path / "d.jsonl", rows)
    prior = collect(str(model_dir), data, tmp_path / "p.safetensors", top_k=2, max_seq_len=256,
                    tokenizer_id=str(moon_dir), trust_remote_code=True, progress=False)  # fmt: skip
    assert prior.metadata["tokenizer"] == str(moon_dir) and prior.num_rows == len(rows)
    # Kimi-K2's template puts each content between special tokens, so its tokens are tiktoken's of it alone
    alone = [[len(tok.encode(q)), len(tok.encode(a))] for q, a in ((Q1, A1), (Q2, A2), (SYSTEM, Q1))]
    assert prior.span_tokens.tolist() == alone

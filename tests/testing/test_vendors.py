"""The vendors' tokenizers of ``rpb.testing.vendors``: one token per byte of text, one per vendor marker, the
template as vendored; what Q / A labelling does with each template is tests/data/test_template_vendors.py's."""

from __future__ import annotations

import pytest

from rpb.testing.vendors import TEMPLATES, VENDORS, template_text, vendor_tokenizer


def test_every_vendored_template_has_its_tokens():
    assert set(VENDORS) == {p.stem for p in TEMPLATES.glob("*.jinja")}


@pytest.mark.parametrize("name", sorted(VENDORS))
def test_a_vendor_tokenizer_reads_bytes_and_markers(name):
    tok = vendor_tokenizer(name)
    assert tok.chat_template == template_text(name)
    text = "héllo, 2+2"
    assert len(tok(text, add_special_tokens=False)["input_ids"]) == len(text.encode("utf-8"))
    bos, eos, extra = VENDORS[name]
    for marker in [t for t in (bos, eos) if t] + extra:
        ids = tok(marker, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.decode(ids) == marker, marker


def test_an_unknown_template_is_refused_with_the_vendored_names():
    with pytest.raises(ValueError, match=r"no vendored chat template 'llama3'.*gpt_oss"):
        vendor_tokenizer("llama3")

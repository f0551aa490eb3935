"""The vendors' own chat templates (rpb/testing/templates, verbatim): exact Q / A spans on one turn, two
turns and a system prompt; reasoning rows in their three shapes labelled by the rule of docs/data.md (the
expected labels written out from each template's source); the refusals; a clock-reading template."""

from __future__ import annotations

import hashlib
import itertools
import re

import pytest

from rpb.data import ChatTemplate, DataError, load_labelled
from rpb.data.dataset import label_row
from rpb.data.errors import RowProblem
from rpb.data.jsonl import MessagesRow
from rpb.prior import SPAN_A, SPAN_Q, STRUCTURAL
from rpb.testing.vendors import TEMPLATES, VENDORS, sources, template_text, vendor_tokenizer
from tests.conftest import write_rows

Q1, A1, Q2, A2, SYSTEM = "What is 2+2?", "It is 4.", "And 3+3?", "Six.", "Answer briefly."
R1, R2 = "Two and two make four.", "Three doubled."
CASES = {
    "one turn": [("user", Q1), ("assistant", A1)],
    "two turns": [("user", Q1), ("assistant", A1), ("user", Q2), ("assistant", A2)],
    "system prompt": [("system", SYSTEM), ("user", Q1), ("assistant", A1)],
}
#: (template, keyword arguments): Qwen3 and GLM with thinking on and off (GLM's off appends '/nothink' to a user turn)
SWITCHED = ("qwen3", "glm_4_6")
RENDERINGS = [(name, {}) for name in VENDORS if name not in SWITCHED] + [
    (name, {"enable_thinking": on}) for name in SWITCHED for on in (True, False)
]


def runs(tok, ids, spans) -> dict[int, list[str]]:
    """Decoded text of every run of Q-labelled and of A-labelled tokens, in order."""
    out = {SPAN_Q: [], SPAN_A: [], STRUCTURAL: []}
    for span, run in itertools.groupby(zip(ids, spans, strict=True), key=lambda x: x[1]):
        out[span].append(tok.decode([i for i, _ in run], skip_special_tokens=False))
    return out


def label(tok, messages, **kwargs):
    template = ChatTemplate(tok, kwargs.pop("template_kwargs", None), **kwargs)
    ids, spans = label_row(template, MessagesRow(tuple(messages)), 8192)
    return runs(tok, ids, spans), template


def test_the_vendored_templates_are_the_named_files():
    named = sources()
    assert sorted(named) == sorted(p.name for p in TEMPLATES.glob("*.jinja"))
    for name, where in named.items():
        data = (TEMPLATES / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == where["sha256"] and len(data) == where["bytes"], name
        assert re.fullmatch(r"[0-9a-f]{40}", where["commit"]) and where["repository"].count("/") == 1
    assert b"\r\n" in (TEMPLATES / "kimi_k2.jinja").read_bytes()  # kept as shipped, CRLF and all


@pytest.mark.parametrize(
    ("name", "kwargs", "case"),
    # Mixtral's system prompt is refused by its template: test_mixtral_refuses_a_system_turn
    [(n, k, c) for n, k in RENDERINGS for c in CASES if (n, c) != ("mixtral", "system prompt")],
    ids=lambda v: str(v) if v else "",
)
def test_plain_conversations_span_exactly(name, kwargs, case):
    messages = [{"role": r, "content": c} for r, c in CASES[case]]
    got, _ = label(vendor_tokenizer(name), messages, template_kwargs=kwargs)
    assert got[SPAN_Q] == [c for r, c in CASES[case] if r == "user"]
    assert got[SPAN_A] == [c for r, c in CASES[case] if r == "assistant"]


def test_mixtral_refuses_a_system_turn(tmp_path):
    """Mixtral-8x7B-Instruct's template raises on any role order but user / assistant alternating."""
    tok = vendor_tokenizer("mixtral")
    rows = [{"messages": [{"role": r, "content": c} for r, c in CASES[case]]} for case in CASES]
    with pytest.raises(DataError) as err:
        load_labelled(write_rows(tmp_path / "d.jsonl", rows), tok, 4096)
    (only,) = err.value.errors
    assert (only.line, only.kind) == (3, "template-refuses")
    assert "(system, user, assistant): Conversation roles must alternate" in only.message


def test_gpt_oss_injects_its_own_system_text_which_stays_structural():
    """gpt-oss's template writes its own system message (identity, knowledge cutoff, date, reasoning effort) and
    turns the row's system prompt into a developer message: all of it structure, nothing Q or A."""
    tok = vendor_tokenizer("gpt_oss")
    messages = [{"role": r, "content": c} for r, c in CASES["system prompt"]]
    got, template = label(tok, messages, date="2026-03-04", template_kwargs={"reasoning_effort": "high"})
    structure = "".join(got[STRUCTURAL])
    assert "You are ChatGPT, a large language model trained by OpenAI." in structure
    assert "Current date: 2026-03-04" in structure and "Reasoning: high" in structure
    assert f"<|start|>developer<|message|># Instructions\n\n{SYSTEM}\n\n<|end|>" in structure
    assert (got[SPAN_Q], got[SPAN_A]) == ([Q1], [A1])
    assert template.settings == {
        "chat_template_kwargs": {"reasoning_effort": "high"},
        "chat_template_date": "2026-03-04",
    }


def test_glm_thinking_off_appends_nothink_to_each_user_turn_as_structure():
    """GLM-4.5's line marks a user turn with '/nothink' when enable_thinking is false: rendered, never Q."""
    tok = vendor_tokenizer("glm_4_6")
    messages = [{"role": r, "content": c} for r, c in CASES["two turns"]]
    off, template = label(tok, messages, template_kwargs={"enable_thinking": False})
    on, _ = label(tok, messages, template_kwargs={"enable_thinking": True})
    assert (off[SPAN_Q], off[SPAN_A]) == (on[SPAN_Q], on[SPAN_A]) == ([Q1, Q2], [A1, A2])
    assert "".join(off[STRUCTURAL]).count("/nothink<|assistant|>") == 2 and "/nothink" not in "".join(on[STRUCTURAL])
    assert template.settings["chat_template_kwargs"] == {"enable_thinking": False}


# --------------------------------------------------------------------------- reasoning

SHAPES = ("think-tags", "reasoning_content", "harmony thinking", "harmony channels")


def reasoning_conversation(shape: str) -> list[dict]:
    def turn(reasoning, answer):
        if shape == "think-tags":
            return [{"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{answer}"}]
        if shape == "reasoning_content":
            return [{"role": "assistant", "content": answer, "reasoning_content": reasoning}]
        if shape == "harmony thinking":
            return [{"role": "assistant", "content": answer, "thinking": reasoning}]
        return [{"role": "assistant", "channel": "analysis", "content": reasoning},
                {"role": "assistant", "channel": "final", "content": answer}]  # fmt: skip

    return [{"role": "user", "content": Q1}, *turn(R1, A1), {"role": "user", "content": Q2}, *turn(R2, A2)]


#: what each template renders of the two reasoning turns, read off its source; per shape (None: every shape)
EXPECTED_A = {
    # DeepSeek-V3.1: content.split('</think>', 1)[1] for every turn; the reasoning field is never read
    "deepseek_v3_1": {None: [A1, A2]},
    # Qwen3: the reasoning (field, or parsed out of the <think> block) only after the last user turn, as
    # '<think>\n' + reasoning + '\n</think>\n\n' + content
    "qwen3": {None: [A1, f"{R2}\n</think>\n\n{A2}"]},
    # Kimi-K2 (2025-07): the content as it is; no reasoning field read
    "kimi_k2": {"think-tags": [f"{R1}\n</think>\n\n{A1}", f"{R2}\n</think>\n\n{A2}"], None: [A1, A2]},
    # gpt-oss: the content as it is; 'thinking' (transformers aliases reasoning_content to it) as the analysis
    # channel of the last turn only
    "gpt_oss": {
        "think-tags": [f"{R1}\n</think>\n\n{A1}", f"{R2}\n</think>\n\n{A2}"],
        None: [A1, f"{R2}<|end|><|start|>assistant<|channel|>final<|message|>{A2}"],
    },
    # GLM-4.5 line: like Qwen3, the reasoning (field, or parsed out of the think block) only after the last user
    # turn, as '\n<think>' + reasoning.strip() + '</think>' + '\n' + content.strip(); '\n<think></think>' otherwise
    "glm_4_6": {None: [A1, f"{R2}</think>\n{A2}"]},
}
#: reasoning turns each template leaves out, per shape (None: every shape)
DROPPED = {"deepseek_v3_1": {None: 2}, "qwen3": {None: 1}, "kimi_k2": {"think-tags": 0, None: 2},
           "gpt_oss": {"think-tags": 0, None: 1}, "glm_4_6": {None: 1}}  # fmt: skip


@pytest.mark.parametrize("name", EXPECTED_A)
def test_reasoning_rows_are_labelled_by_the_rule(name):
    tok = vendor_tokenizer(name)
    for shape in SHAPES:
        got, template = label(tok, reasoning_conversation(shape))
        assert got[SPAN_Q] == [Q1, Q2], shape
        assert got[SPAN_A] == EXPECTED_A[name].get(shape, EXPECTED_A[name][None]), shape
        dropped = DROPPED[name].get(shape, DROPPED[name][None])
        assert template.reasoning.as_dict() == {"turns": 2, "dropped_turns": dropped, "rows_dropped": int(dropped > 0)}


def test_the_template_switch_is_passed_and_deepseek_v3_1_drops_reasoning_either_way():
    tok = vendor_tokenizer("deepseek_v3_1")
    prompt = ChatTemplate(tok, {"thinking": True}).apply([{"role": "user", "content": Q1}], True)
    assert prompt.endswith("<｜Assistant｜><think>")  # thinking mode's generation prompt: the switch reached it
    got, template = label(tok, reasoning_conversation("think-tags"), template_kwargs={"thinking": True})
    assert got[SPAN_A] == [A1, A2] and template.reasoning.dropped == 2


def test_a_template_rewrite_is_named_with_what_it_did():
    """DeepSeek-V3.1 keeps what follows the first </think> of any content, not only of a leading think block."""
    tok = vendor_tokenizer("deepseek_v3_1")
    content = "Close a tag with </think> like this."
    with pytest.raises(RowProblem) as err:
        label(tok, [{"role": "user", "content": Q1}, {"role": "assistant", "content": content}])
    assert err.value.kind == "template-mismatch" and err.value.field == "messages[1].content"
    assert f"rewrites the content of message 1: where the row has {content!r} it renders ' like this.'" in str(
        err.value
    )


# --------------------------------------------------------------------------- the clock


def test_a_clock_reading_template_renders_the_recorded_day(tmp_path, monkeypatch):
    """gpt-oss renders strftime_now('%Y-%m-%d'): collected one day and trained another, the tokens agree when
    training renders the day the collection recorded, and would not otherwise (same length, other tokens)."""
    import datetime as real_datetime

    from transformers.utils import chat_template_utils

    def freeze(day: str):
        frozen = real_datetime.datetime.fromisoformat(day)

        class Clock(real_datetime.datetime):
            @classmethod
            def now(cls, tz=None):
                return frozen

        class Today(real_datetime.date):
            @classmethod
            def today(cls):
                return frozen.date()

        monkeypatch.setattr(chat_template_utils, "datetime", Clock)
        monkeypatch.setattr("rpb.data.template.datetime.date", Today)

    tok = vendor_tokenizer("gpt_oss")
    data = write_rows(tmp_path / "d.jsonl", [{"messages": [{"role": r, "content": c} for r, c in CASES["one turn"]]}])
    freeze("2026-01-31")
    collected = load_labelled(data, tok, 4096)
    assert collected.template_settings["chat_template_date"] == "2026-01-31"
    freeze("2026-12-01")
    trained = load_labelled(data, tok, 4096, date=collected.template_settings["chat_template_date"])
    unpinned = load_labelled(data, tok, 4096)
    assert trained.examples[0].input_ids == collected.examples[0].input_ids
    assert len(unpinned.examples[0].input_ids) == len(collected.examples[0].input_ids)
    assert unpinned.examples[0].input_ids != collected.examples[0].input_ids
    assert "Current date: 2026-12-01" in tok.decode(unpinned.examples[0].input_ids)
    assert ChatTemplate(vendor_tokenizer("qwen3")).settings["chat_template_date"] is None  # reads no clock


def test_every_vendor_tokenizer_carries_the_template_as_shipped():
    for name in VENDORS:
        assert vendor_tokenizer(name).chat_template == template_text(name)


# --------------------------------------------------------------------------- end to end


def test_distilled_reasoning_rows_collect_and_train_on_deepseek_v3_1(tmp_path, capsys):
    """A file of reasoning rows on DeepSeek-V3.1's template: collected (the dropped reasonings said once and
    recorded), trained 2 steps; another template switch at training or validation is refused."""
    import json

    from rpb.anchors.verify import PriorMismatchError
    from rpb.collect import collect
    from rpb.testing.models import build_tiny_model
    from rpb.train.config import load_config
    from rpb.train.run import run_training
    from rpb.train.validate import validate_artifact

    tok = vendor_tokenizer("deepseek_v3_1")
    model_dir = tmp_path / "model"
    build_tiny_model("moonlight", vocab_size=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows = [{"messages": reasoning_conversation(shape)} for shape in SHAPES]
    data = write_rows(tmp_path / "reasoning.jsonl", rows)
    prior = tmp_path / "prior.safetensors"
    meta = collect(str(model_dir), data, prior, top_k=2, max_seq_len=512, progress=False).metadata
    assert meta["schema_version"] == 4 and meta["chat_template_kwargs"] == {} and meta["chat_template_date"] is None
    assert meta["reasoning"] == {"turns": 8, "dropped_turns": 8, "rows_dropped": 4}
    assert capsys.readouterr().err.count("does not render the reasoning of 8 of 8 assistant turn(s)") == 1

    common = [f"model={model_dir}", f"data_jsonl={data}", f"prior={prior}", "train.max_steps=2",
              "train.batch_size=2", "train.calibrate_rows=0", "anchor.method=rpb"]  # fmt: skip
    out = run_training(load_config(None, [*common, f"output_dir={tmp_path / 'run'}"]), progress=False)
    record = json.loads((out / "rpb_run.json").read_text())
    assert record["global_step"] == 2 and record["reasoning"] == meta["reasoning"]
    with pytest.raises(PriorMismatchError, match="chat_template_kwargs"):
        run_training(load_config(None, [*common, f"output_dir={tmp_path / 'other'}",
                                        "data.chat_template_kwargs.thinking=true"]), progress=False)  # fmt: skip
    assert validate_artifact(prior, expected_template_kwargs={}).ok
    report = validate_artifact(prior, expected_template_kwargs={"thinking": True})
    assert [p for p in report.problems if p.startswith("chat_template_kwargs: the prior was collected with {}")]

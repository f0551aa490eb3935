"""End-to-end through the ``rpb`` command: collect, validate, render, refusals, atomic writes."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from rpb.cli import main
from rpb.collect import collect
from rpb.prior import artifact as artifact_module
from rpb.testing.data import conversations, write_jsonl
from tests.conftest import qa, write_rows


@pytest.fixture
def data(tmp_path):
    return write_jsonl(conversations(12, seed=3), tmp_path / "train.jsonl")


def collect_args(model, data, out, *extra):
    return [
        "collect",
        "--model",
        str(model),
        "--data-jsonl",
        str(data),
        "--out-path",
        str(out),
        "--top-k",
        "2",
        "--max-seq-len",
        "256",
        *extra,
    ]


def test_collect_then_validate(save_tiny, data, tmp_path, capsys):
    out = tmp_path / "prior.safetensors"
    assert main(collect_args(save_tiny("moonlight"), data, out, "--batch-size", "5")) == 0
    captured = capsys.readouterr()
    assert "row/s" in captured.err and "tok_s=" in captured.err  # progress: rows/s and tokens/s
    assert main(["validate", str(out), "--data-jsonl", str(data), "--expected-model", str(save_tiny("moonlight"))]) == 0
    meta = artifact_module.read_metadata(out)
    assert meta["model_type"] == "deepseek_v3" and meta["num_rows"] == 12 and meta["top_k"] == 2
    assert meta["routed_positions"] == "all-positions-of-truncated-sequence"
    for text in ("What is", "Sort the list", "Reverse"):  # no conversation text is stored
        assert text.encode() not in out.read_bytes()


def test_batch_size_does_not_change_the_prior(save_tiny, data, tmp_path):
    a = collect(str(save_tiny("moonlight")), data, tmp_path / "a.safetensors", 2, 256, batch_size=1, progress=False)
    b = collect(str(save_tiny("moonlight")), data, tmp_path / "b.safetensors", 2, 256, batch_size=7, progress=False)
    torch.testing.assert_close(a.prior_qa, b.prior_qa, atol=1e-5, rtol=0)


def test_top_k_must_match_the_model(save_tiny, data, tmp_path, capsys):
    out = tmp_path / "prior.safetensors"
    args = collect_args(save_tiny("moonlight"), data, out)
    args[args.index("--top-k") + 1] = "6"
    assert main(args) == 2
    assert "--top-k 6 does not match the model's own top-k (num_experts_per_tok=2)" in capsys.readouterr().err
    assert not out.exists()


def test_unsupported_model_names_supported_types(tmp_path, moon_tok, data, capsys):
    dense = tmp_path / "llama"
    cfg = LlamaConfig(
        vocab_size=len(moon_tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(cfg).save_pretrained(dense)
    moon_tok.save_pretrained(dense)
    assert main(collect_args(dense, data, tmp_path / "p.safetensors")) == 2
    err = capsys.readouterr().err
    assert "no router adapter for model_type 'llama'" in err
    assert "deepseek_v3" in err and "qwen3_moe" in err and "--adapter" in err and "register_adapter" in err


def test_adapter_override_and_wrong_adapter(save_tiny, data, tmp_path, capsys):
    # a Qwen3-MoE checkpoint routed with the OLMoE facts: the router class differs, so it fails loudly
    assert main(collect_args(save_tiny("qwen3_moe"), data, tmp_path / "p.safetensors", "--adapter", "olmoe")) == 2
    assert "expects OlmoeTopKRouter" in capsys.readouterr().err


def test_model_code_is_never_run_and_tokenizer_code_only_with_the_flag(save_tiny, data, tmp_path, capsys):
    ckpt = tmp_path / "moonlight-remote"
    shutil.copytree(save_tiny("moonlight"), ckpt)
    # like Moonlight: the checkpoint ships modeling code (here one that must never run) ...
    (ckpt / "modeling_remote.py").write_text("raise RuntimeError('remote modeling code was executed')\n")
    config = json.loads((ckpt / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_remote.Model", "AutoModelForCausalLM": "modeling_remote.Model"}
    (ckpt / "config.json").write_text(json.dumps(config))
    # ... and a slow tokenizer of its own, without offset mapping
    for f in ckpt.glob("tokenizer*.json"):
        f.unlink()
    from tests.extra_tokenizers import CharSlowTokenizer

    CharSlowTokenizer().save_pretrained(ckpt)
    (ckpt / "tokenization_remote.py").write_text("from tests.extra_tokenizers import CharSlowTokenizer\n")
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": ["tokenization_remote.CharSlowTokenizer", None]}
    tok_config["tokenizer_class"] = "CharSlowTokenizer"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok_config))

    out = tmp_path / "prior.safetensors"
    assert main(collect_args(ckpt, data, out, "--no-progress")) == 2  # tokenizer code needs the flag
    assert not out.exists()
    capsys.readouterr()
    assert main(collect_args(ckpt, data, out, "--no-progress", "--trust-remote-code")) == 0
    fast = tmp_path / "fast.safetensors"
    assert main(collect_args(save_tiny("moonlight"), data, fast, "--no-progress")) == 0
    # same model weights and the same labels from the slow tokenizer: the same prior
    torch.testing.assert_close(load_file(out)["prior_qa"], load_file(fast)["prior_qa"], atol=1e-6, rtol=0)


def test_interrupted_write_leaves_no_artifact(save_tiny, data, tmp_path, monkeypatch):
    out = tmp_path / "prior.safetensors"

    def crash(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial bytes")
        raise KeyboardInterrupt

    monkeypatch.setattr(artifact_module, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        collect(str(save_tiny("moonlight")), data, out, 2, 256, progress=False)
    assert list(tmp_path.iterdir()) == [data]  # neither the artifact nor a temporary file


def test_render_then_collect_equals_messages_form(save_tiny, tmp_path, capsys):
    raw = write_rows(
        tmp_path / "raw.jsonl",
        [
            {"question": "What is 3 + 4?", "answer": "7"},
            {"system": "Be terse.", "question": "Sort [2, 1].", "answer": "[1, 2]"},
        ],
    )
    rendered = tmp_path / "rendered.jsonl"
    assert main(["render", "--tokenizer", str(save_tiny("moonlight")), "--in", str(raw), "--out", str(rendered)]) == 0
    rows = [json.loads(line) for line in rendered.read_text().splitlines()]
    assert rows[0]["input"].endswith("<|im_assistant|>assistant<|im_middle|>") and rows[0]["output"] == "7<|im_end|>"
    messages = write_rows(
        tmp_path / "messages.jsonl",
        [
            qa("What is 3 + 4?", "7"),
            {"messages": [{"role": "system", "content": "Be terse."}, *qa("Sort [2, 1].", "[1, 2]")["messages"]]},
        ],
    )
    model = str(save_tiny("moonlight"))
    a = collect(model, rendered, tmp_path / "a.safetensors", 2, 256, progress=False)
    b = collect(model, messages, tmp_path / "b.safetensors", 2, 256, progress=False)
    torch.testing.assert_close(a.prior_qa, b.prior_qa, atol=0, rtol=0)


def test_render_reports_bad_rows(save_tiny, tmp_path, capsys):
    raw = write_rows(tmp_path / "raw.jsonl", [{"question": "q"}, "not json", {"question": 1, "answer": "a"}])
    out = tmp_path / "rendered.jsonl"
    assert main(["render", "--tokenizer", str(save_tiny("moonlight")), "--in", str(raw), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{raw}:1: missing-field [answer]" in err
    assert f"{raw}:2: malformed-json" in err
    assert f"{raw}:3: non-string-field [question]" in err
    assert not out.exists()


def test_adapter_routes_an_unregistered_model_type(save_tiny, data, tmp_path, monkeypatch, capsys):
    import dataclasses

    from rpb.adapters import ADAPTERS

    monkeypatch.setitem(ADAPTERS, "mixtral_like", dataclasses.replace(ADAPTERS["mixtral"], model_type="mixtral_like"))
    monkeypatch.delitem(ADAPTERS, "mixtral")
    out = tmp_path / "p.safetensors"
    assert main(collect_args(save_tiny("mixtral"), data, out, "--no-progress")) == 2
    assert "no router adapter for model_type 'mixtral'" in capsys.readouterr().err
    assert main(collect_args(save_tiny("mixtral"), data, out, "--no-progress", "--adapter", "mixtral_like")) == 0
    meta = artifact_module.read_metadata(out)
    assert (meta["model_type"], meta["adapter"]) == ("mixtral", "mixtral_like")


def test_bfloat16_weights_keep_router_math_in_float32(save_tiny, data, tmp_path):
    model = str(save_tiny("qwen3_moe"))
    fp32 = collect(model, data, tmp_path / "a.safetensors", 2, 256, dtype="float32", progress=False)
    bf16 = collect(model, data, tmp_path / "b.safetensors", 2, 256, dtype="bfloat16", progress=False)
    assert bf16.prior_qa.dtype == torch.float32 and bf16.metadata["dtype"] == "bfloat16"
    torch.testing.assert_close(bf16.prior_qa.sum(-1), torch.ones_like(bf16.prior_qa.sum(-1)), atol=1e-5, rtol=0)
    torch.testing.assert_close(bf16.prior_qa, fp32.prior_qa, atol=3e-2, rtol=0)  # bf16 activations, same routing


def test_routers_fingerprint_tells_checkpoints_apart_and_ignores_load_dtype(save_tiny, data, tmp_path):
    a = collect(str(save_tiny("moonlight")), data, tmp_path / "a.safetensors", 2, 256, progress=False)
    b = collect(str(save_tiny("moonlight")), data, tmp_path / "b.safetensors", 2, 256, dtype="bfloat16", progress=False)
    c = collect(str(save_tiny("moonlight", seed=1)), data, tmp_path / "c.safetensors", 2, 256, progress=False)
    assert a.metadata["routers_sha256"] == b.metadata["routers_sha256"]
    assert a.metadata["model_config_sha256"] == c.metadata["model_config_sha256"]
    assert a.metadata["routers_sha256"] != c.metadata["routers_sha256"]


def test_named_errors_exit_2_with_their_message_and_bugs_exit_1_with_a_traceback(
    save_tiny, data, tmp_path, monkeypatch, capsys
):
    # a problem with the input: its message alone, exit 2
    missing = tmp_path / "nowhere.jsonl"
    assert main(collect_args(save_tiny("moonlight"), missing, tmp_path / "p.safetensors")) == 2
    err = capsys.readouterr().err
    assert f"rpb collect: {missing}: no such file" in err and "Traceback" not in err
    assert main(collect_args(tmp_path / "no-model", data, tmp_path / "p.safetensors")) == 2
    err = capsys.readouterr().err
    assert "cannot load tokenizer" in err and "Traceback" not in err
    # --debug shows where it came from
    assert main([*collect_args(save_tiny("moonlight"), missing, tmp_path / "p.safetensors"), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "no such file" in err

    # anything else is a bug: exit 1, with the traceback that says where
    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr("rpb.collect.collect", broken)
    assert main(collect_args(save_tiny("moonlight"), data, tmp_path / "p.safetensors")) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'a bug'" in err and "in broken" in err


def test_collect_counts_the_rows_cut_by_max_seq_len_in_the_log_and_the_prior(save_tiny, tmp_path, caplog, monkeypatch):
    """Rows built longer than --max-seq-len (their tokens counted through the tokenizer's own template); the
    chunks label their rows again (nothing kept from the scan here), and the count stays the rows'."""
    from rpb.collect import record

    monkeypatch.setattr(record, "KEEP_TOKENS", 0)
    model = save_tiny("moonlight")
    short = [qa("What is 1 + 1?", "2"), qa("Name a colour.", "Blue."), qa("Hi", "Hello")]
    long = [qa("Say it often.", "again and again " * 40), qa("Count.", " ".join(str(i) for i in range(80)))]
    tok = AutoTokenizer.from_pretrained(model)
    tokens = [
        len(tok(tok.apply_chat_template(r["messages"], tokenize=False), add_special_tokens=False)["input_ids"])
        for r in (*short, *long)
    ]
    assert max(tokens[:3]) < 128 < min(tokens[3:])
    data = write_rows(tmp_path / "rows.jsonl", [long[0], short[0], short[1], long[1], short[2]])
    out = tmp_path / "prior.safetensors"
    args = collect_args(model, data, out, "--no-progress", "--chunk-rows", "2")
    args[args.index("--max-seq-len") + 1] = "128"
    with caplog.at_level("WARNING"):
        assert main(args) == 0
    assert artifact_module.read_metadata(out).get("truncated_rows") == 2
    assert "2 of 5 row(s) are longer than max_seq_len=128 tokens" in caplog.text


def test_a_plugin_that_fails_to_load_is_named_and_the_core_commands_still_run(tmp_path, monkeypatch, capsys):
    from importlib.metadata import EntryPoint

    import rpb.cli

    broken = EntryPoint(name="gone", value="rpb_no_such_plugin.cli:add_commands", group="rpb.commands")
    monkeypatch.setattr(rpb.cli, "entry_points", lambda group: [broken] if group == "rpb.commands" else [])
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "collect" in out and "demo" not in out
    assert "gone = rpb_no_such_plugin.cli:add_commands failed to load" in " ".join(out.split())
    assert main(["demo", "--out", str(tmp_path)]) == 2  # asked for: said, not swallowed
    err = capsys.readouterr().err
    assert "No module named 'rpb_no_such_plugin'" in err and "rpb demo: no such command" in err
    assert main(["validate", str(tmp_path / "missing.safetensors")]) == 1  # a core command runs as before
    assert "not a readable safetensors file" in capsys.readouterr().err

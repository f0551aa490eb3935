"""``rpb collect --from-routes``: a prior from routes in vLLM's layout equals the frequency prior computed by hand from
the same model's own routers (the family's hand-written rule, tests/test_routing.py), on a DeepSeek-V3 replica whose
first decoder layers are dense; and every refusal, each naming its row."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rpb.adapters import find_moe_layers, get_adapter
from rpb.calibrate import calibrate
from rpb.cli import main
from rpb.collect import collect
from rpb.collect.from_routes import RoutesMismatchError, collect_from_routes
from rpb.collect.hf_routes import write_routes
from rpb.data import load_labelled
from rpb.experts.run import run_experts
from rpb.models import load_causal_lm, load_tokenizer
from rpb.prior.artifact import METADATA_KEY, load_artifact, read_metadata
from rpb.prior.checks import file_problems
from rpb.replay.routefile import load_routes, save_routes
from rpb.testing import replica as build_replica
from rpb.testing.data import conversations, write_jsonl
from rpb.train.validate import validate_artifact
from tests.test_routing import reference_route

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LEN = 256


@pytest.fixture(scope="module")
def routed(replica, tmp_path_factory):
    """A DeepSeek-V3 replica, five rows, their routes in vLLM's layout (rpb routes) and the prior from them."""
    tmp = tmp_path_factory.mktemp("from-routes")
    model_dir = replica("deepseek_v3")
    data = write_jsonl(conversations(5, seed=3), tmp / "rows.jsonl")
    routes = tmp / "routes.safetensors"
    write_routes(str(model_dir), data, routes, MAX_LEN, batch_size=1)
    prior = collect_from_routes(str(model_dir), data, routes, tmp / "prior.safetensors", MAX_LEN, progress=False)
    return model_dir, data, routes, prior, tmp


def hand_frequency(model_dir, data, max_len: int = MAX_LEN) -> torch.Tensor:
    """``prior_NSLE`` by hand: each row forwarded alone, each router's logits taken from its own output and
    ranked by the family's hand-written rule; per span, the count of each expert's choices over tokens x k."""
    model = load_causal_lm(str(model_dir)).eval()
    facts = get_adapter(model.config.model_type)
    layers = find_moe_layers(model, facts)
    examples = load_labelled(str(data), load_tokenizer(str(model_dir)), max_len).examples
    seen = {}
    hooks = [
        m.router.register_forward_hook(lambda mod, args, out, pos=pos: seen.__setitem__(pos, (args, out)))
        for pos, m in enumerate(layers)
    ]
    E = layers[0].router.weight.shape[0]
    out = torch.zeros(len(examples), 2, len(layers), E, dtype=torch.float64)
    with torch.no_grad():
        for i, ex in enumerate(examples):
            model(input_ids=torch.tensor([ex.input_ids]))
            spans = torch.tensor(ex.span_ids)
            for pos, m in enumerate(layers):
                args, output = seen[pos]
                logits_TE = output[0] if isinstance(output, tuple) else output
                block_bias = args[1] if len(args) > 1 else None
                ids_TK, _ = reference_route(
                    m.router, logits_TE.float(), torch.zeros_like(logits_TE.float()), block_bias
                )
                for s in (0, 1):
                    chosen = ids_TK[spans == s]
                    for e in chosen.reshape(-1).tolist():
                        out[i, s, pos, e] += 1
                    out[i, s, pos] /= chosen.numel()  # tokens x k
    for h in hooks:
        h.remove()
    return out


def test_a_prior_from_vllm_layout_routes_is_the_hand_frequency_prior(routed):
    model_dir, data, routes, prior, tmp = routed
    assert prior.metadata["prior_kind"] == "frequency" and prior.metadata["schema_version"] == 4
    assert prior.metadata["moe_layers"][0] > 0  # the replica's first layers are dense
    expected = hand_frequency(model_dir, data)
    assert torch.allclose(prior.prior_qa.double(), expected, atol=1e-6)
    assert torch.allclose(prior.prior_qa.sum(-1), torch.ones(prior.prior_qa.shape[:3]), atol=1e-5)
    # the route file is vLLM's layout: one route per row token, every decoder layer, the dense ones left 0
    rf = load_routes(routes)
    config = load_causal_lm(str(model_dir)).config
    dense = [i for i in range(config.num_hidden_layers) if i not in prior.metadata["moe_layers"]]
    assert rf.routes_RXK.shape[1:] == (config.num_hidden_layers, config.num_experts_per_tok)
    assert dense and int(rf.routes_RXK[:, dense].abs().sum()) == 0
    examples = load_labelled(str(data), load_tokenizer(str(model_dir)), MAX_LEN).examples
    for i, ex in enumerate(examples):
        assert rf.tokens(i) == ex.input_ids and rf.routes(i).shape[0] == len(ex)
    # and the HF forward's frequency prior is the same, as are the metadata that tie the prior to its model
    hf = collect(str(model_dir), data, tmp / "hf.safetensors", top_k=config.num_experts_per_tok, max_seq_len=MAX_LEN,
                 prior_kind="frequency", progress=False)  # fmt: skip
    assert torch.equal(hf.prior_qa, prior.prior_qa)
    for key in ("routers_sha256", "model_config_sha256", "data_sha256", "chat_template_sha256", "moe_layers"):
        assert hf.metadata[key] == prior.metadata[key], key


def rewritten(rf, path, tokens=None, routes=None, **meta):
    """A copy of route file ``rf`` with rows' tokens or routes replaced ({row: value})."""
    tokens = {**{i: rf.tokens(i) for i in range(rf.num_rows)}, **(tokens or {})}
    routes = {**{i: rf.routes(i).numpy() for i in range(rf.num_rows)}, **(routes or {})}
    keep = {k: rf.metadata[k] for k in ("engine", "routers_sha256", "model", "data_sha256")}
    save_routes(path, [tokens[i] for i in range(rf.num_rows)], [routes[i] for i in range(rf.num_rows)], **(keep | meta))
    return path


def refused(routed, path, *needles):
    model_dir, data, _, _, tmp = routed
    out = tmp / "refused.safetensors"
    with pytest.raises(RoutesMismatchError) as err:
        collect_from_routes(str(model_dir), data, path, out, MAX_LEN, progress=False)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()  # nothing written
    return str(err.value)


def test_refused_shifted_tokens_a_short_route_count_and_every_problem_at_once(routed):
    _, _, routes, _, tmp = routed
    rf = load_routes(routes)
    shifted = rf.tokens(2)[1:] + rf.tokens(2)[-1:]
    refused(routed, rewritten(rf, tmp / "shifted.safetensors", tokens={2: shifted}), "row 2 (rows.jsonl line 3)",
            "first differing position 0")  # fmt: skip
    short = rf.routes(1).numpy()[:-1]  # prefix caching, or a request cut short: a token without its route
    n = len(rf.tokens(1))
    refused(routed, rewritten(rf, tmp / "short.safetensors", routes={1: short}), "row 1 (rows.jsonl line 2)",
            f"{n - 1} routes for the row's {n} tokens")  # fmt: skip
    both = rewritten(rf, tmp / "both.safetensors", tokens={2: shifted}, routes={1: short})
    text = refused(routed, both, "2 problem(s)", "row 1 ", "row 2 ")
    assert text.index("row 1 ") < text.index("row 2 ")


def test_refused_ids_out_of_range_and_a_wrong_top_k(routed):
    _, _, routes, prior, tmp = routed
    rf = load_routes(routes)
    moe = prior.metadata["moe_layers"]
    bad = rf.routes(0).numpy().copy()
    bad[3, moe[0], 0] = prior.metadata["num_experts"]
    refused(routed, rewritten(rf, tmp / "range.safetensors", routes={0: bad}), "row 0 ", "outside [0, ")
    narrow = {i: rf.routes(i).numpy()[:, :, :1] for i in range(rf.num_rows)}
    refused(routed, rewritten(rf, tmp / "topk.safetensors", routes=narrow), "top-1 ids per layer")


def test_refused_routes_of_another_model(routed, tmp_path):
    _, data, _, _, _ = routed
    other = build_replica("deepseek_v3", tmp_path / "other", seed=1)  # the same family, other weights
    routes = tmp_path / "other.safetensors"
    write_routes(str(other), data, routes, MAX_LEN, batch_size=1)
    refused(routed, routes, "routes of another model", "routers_sha256")


def test_sglang_routes_with_fused_shared_columns_give_the_same_prior(routed, tmp_path):
    """SGLang's output as its tokenizer manager sends it (base64 of flat int32), from a build that kept a fused
    shared expert's column after the top-k (id num_experts), saved with the documented lines."""
    model_dir, data, routes, prior, _ = routed
    rf = load_routes(routes)
    E, X = prior.metadata["num_experts"], rf.routes_RXK.shape[1]
    tokens, saved = [], []
    for i in range(rf.num_rows):
        wide = np.concatenate([rf.routes(i).numpy(), np.full((len(rf.tokens(i)), X, 1), E)], axis=-1)
        payload = base64.b64encode(wide.astype("<i4").tobytes())  # meta_info["routed_experts"]
        # the lines docs/collect.md gives: decode, shape [tokens of the request - 1, decoder layers, width]
        decoded = np.frombuffer(base64.b64decode(payload), dtype="<i4").reshape(len(rf.tokens(i)), X, -1)
        tokens.append(rf.tokens(i))
        saved.append(decoded)
    path = tmp_path / "sglang.safetensors"
    save_routes(path, tokens, saved, engine="sglang")
    out = tmp_path / "prior.safetensors"
    got = collect_from_routes(str(model_dir), data, path, out, MAX_LEN, progress=False, fused_shared_experts=1)
    assert torch.equal(got.prior_qa, prior.prior_qa)
    assert got.metadata["routes_engine"] == "sglang"


def test_the_command_line(routed, tmp_path, capsys):
    model_dir, data, routes, prior, _ = routed
    out = tmp_path / "cli.safetensors"
    args = ["collect", "--model", str(model_dir), "--data-jsonl", str(data), "--max-seq-len", str(MAX_LEN)]
    assert main([*args, "--out-path", str(out), "--from-routes", str(routes), "--no-progress"]) == 0
    assert "(frequency prior)" in capsys.readouterr().out
    assert torch.equal(load_artifact(out).prior_qa, prior.prior_qa)
    assert main([*args, "--out-path", str(tmp_path / "x.safetensors"), "--from-routes", str(routes),
                 "--prior-kind", "probability"]) != 0  # fmt: skip
    assert "engines return no router probabilities" in capsys.readouterr().err
    assert main([*args, "--out-path", str(tmp_path / "y.safetensors")]) != 0
    assert "--top-k is required" in capsys.readouterr().err


def test_every_reader_says_the_prior_kind(routed, tmp_path, caplog):
    """validate, calibrate and experts read the kind and say it; a schema-4 prior of an unknown kind is refused."""
    model_dir, data, _, _, tmp = routed
    path = tmp / "prior.safetensors"
    assert "prior kind frequency (an engine's selection frequency" in validate_artifact(path, data).format()
    report = calibrate(str(model_dir), path, data, out=tmp_path / "cal", betas=[0.5], rows=3, progress=False)
    assert report["prior_kind"] == "frequency" and "(frequency)" in (tmp_path / "cal" / "calibrate.md").read_text()
    choice = run_experts(str(path), str(tmp_path / "experts.json"), top_n=2, progress=False)
    assert choice.provenance["prior_kind"] == "frequency"
    assert any("frequency prior" in r.getMessage() and "selection share" in r.getMessage() for r in caplog.records)
    meta = read_metadata(path) | {"prior_kind": "counts"}
    bad = tmp_path / "bad.safetensors"
    save_file(load_file(path), str(bad), metadata={METADATA_KEY: json.dumps(meta), "format": "pt"})
    problems = file_problems(bad, load_artifact(bad))
    assert "metadata: field 'prior_kind' is 'counts', expected one of ['probability', 'frequency']" in problems

"""``rpb calibrate`` against a selection written out by hand, on a grouped DeepSeek-V3 model with a
randomised expert-correction bias.

The hand selection below is DeepSeek-V3's routing as the transformers source writes it: sigmoid
scores of (logits + bias), plus the expert bias, groups ranked by the sum of their two best scores,
losing groups masked out, then top-k; gates are the sigmoid of the unbiased logits at the chosen
experts, renormalised (+1e-20) and scaled. It never calls rpb. It first reproduces the native router
bit for bit at beta 0; then, with the eq. 3 bias computed by hand, it gives both displacements:
counterfactual (the bias on the unbiased forward's logits, one layer at a time) and propagated (a
forward in which hooks of this file replace every router's output with the hand selection).
"""

from __future__ import annotations

import json

import pytest
import torch

import rpb.calibrate.run
from rpb.anchors import PriorMismatchError
from rpb.calibrate import calibrate, rule
from rpb.cli import main
from rpb.collect import collect
from rpb.data import load_labelled
from rpb.errors import ArgumentError
from rpb.models import load_base_model, load_tokenizer
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.models import ARCHITECTURES

ARCH = "deepseek_v3_grouped"
CFG = ARCHITECTURES[ARCH][1]
E, K, GROUPS, KEEP = CFG["n_routed_experts"], CFG["num_experts_per_tok"], CFG["n_group"], CFG["topk_group"]
BETAS = [0.0, 0.5, 2.0]
EPS, C = 0.05, 5.0

pytestmark = pytest.mark.usefixtures("one_thread")


def hand_select(z_TE: torch.Tensor, bias_TE: torch.Tensor, expert_bias_E: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 selection, written out: returns the chosen expert ids [T, K]."""
    choice_TE = torch.sigmoid((z_TE + bias_TE).float()) + expert_bias_E
    per = E // GROUPS
    groups_TGp = choice_TE.view(-1, GROUPS, per)
    group_score_TG = groups_TGp.topk(2, dim=-1).values.sum(-1)
    kept_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(
        1, group_score_TG.topk(KEEP, dim=-1).indices, True
    )
    masked_TE = choice_TE.masked_fill(~kept_TG.repeat_interleave(per, dim=1), float("-inf"))
    return masked_TE.topk(K, dim=-1, sorted=False).indices


def hand_gates(z_TE: torch.Tensor, ids_TK: torch.Tensor, scaling: float) -> torch.Tensor:
    g_TK = torch.sigmoid(z_TE.float()).gather(1, ids_TK)
    return g_TK / (g_TK.sum(-1, keepdim=True) + 1e-20) * scaling


def hand_bias(pi_E: torch.Tensor) -> torch.Tensor:
    """Eq. 3: b = log q - mean log q, q = clamp(pi, eps/E, C/E) renormalised."""
    q = pi_E.double().clamp(EPS / E, C / E)
    log_q = (q / q.sum()).log()
    return (log_q - log_q.mean()).float()


def as_sets(ids_TK: torch.Tensor) -> list[frozenset]:
    return [frozenset(row) for row in ids_TK.tolist()]


@pytest.fixture(scope="module")
def case(tmp_path_factory, save_tiny):
    tmp = tmp_path_factory.mktemp("calibrate")
    data = write_jsonl(conversations(10, seed=4), tmp / "train.jsonl")
    model = save_tiny(ARCH)
    prior = tmp / "prior.safetensors"
    collect(str(model), data, prior, top_k=K, max_seq_len=128, progress=False)
    return model, data, prior, tmp


def forward_with(base, routers, ids, replace=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each router's (logits, chosen ids) in one forward; ``replace(layer, module, out)`` may give the
    router a new output, which the model then uses (and which is what gets recorded)."""
    seen: list = [None] * len(routers)

    def hook_for(layer):
        def hook(module, args, out):
            if replace is not None:
                out = replace(layer, module, out)
            seen[layer] = (out[0].detach(), out[2].detach())
            return out

        return hook

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(routers)]
    with torch.no_grad():
        base(input_ids=ids)
    for h in handles:
        h.remove()
    return seen


def row_bias(pi: torch.Tensor, row: int, span_T: torch.Tensor, layer: int, beta: float) -> torch.Tensor:
    rows = [hand_bias(pi[row, s, layer]) if s >= 0 else torch.zeros(E) for s in span_T.tolist()]
    return beta * torch.stack(rows)


def count_changed(content_T: torch.Tensor, chosen: list[frozenset], native: list[frozenset]) -> int:
    return sum(c and a != b for c, a, b in zip(content_T.tolist(), chosen, native, strict=True))


def by_hand(model_dir, data, prior) -> dict[str, dict[float, list[float]]]:
    """Both displacements per beta and layer, over content tokens, row by row (batch of one)."""
    from safetensors.torch import load_file

    base, _ = load_base_model(str(model_dir), device="cpu")
    routers = [m for m in base.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
    pi = load_file(prior)["prior_qa"]
    examples = load_labelled(data, load_tokenizer(str(model_dir)), 128).examples
    changed = {kind: {b: [0] * len(routers) for b in BETAS} for kind in ("counterfactual", "propagated")}
    content_total = [0] * len(routers)
    for ex in examples:
        ids, span_T = torch.tensor([ex.input_ids]), torch.tensor(ex.span_ids)
        content_T = span_T >= 0
        seen = forward_with(base, routers, ids)
        native = [as_sets(seen[layer][1]) for layer in range(len(routers))]
        for layer, router in enumerate(routers):
            z_TE, expert_bias = seen[layer][0], router.e_score_correction_bias
            # the hand selection is the native router, bit for bit, at beta 0
            assert as_sets(hand_select(z_TE, torch.zeros_like(z_TE), expert_bias)) == native[layer]
            content_total[layer] += int(content_T.sum())
            for beta in BETAS:
                chosen = as_sets(hand_select(z_TE, row_bias(pi, ex.index, span_T, layer, beta), expert_bias))
                changed["counterfactual"][beta][layer] += count_changed(content_T, chosen, native[layer])
        for beta in BETAS:  # every router's output replaced by the hand selection (content tokens only)

            def replace(layer, module, out, beta=beta, row=ex.index, span_T=span_T, content_T=content_T):
                z_TE, gates_TK, ids_TK = out
                mine = hand_select(z_TE, row_bias(pi, row, span_T, layer, beta), module.e_score_correction_bias)
                ids_TK = torch.where(content_T[:, None], mine, ids_TK)
                gates = hand_gates(z_TE, ids_TK, module.routed_scaling_factor).to(gates_TK.dtype)
                return z_TE, torch.where(content_T[:, None], gates, gates_TK), ids_TK

            biased = forward_with(base, routers, ids, replace)
            for layer in range(len(routers)):
                changed["propagated"][beta][layer] += count_changed(content_T, as_sets(biased[layer][1]), native[layer])
    return {
        kind: {b: [n / d for n, d in zip(per[b], content_total, strict=True)] for b in BETAS}
        for kind, per in changed.items()
    }


def test_both_displacements_equal_the_hand_selection(case):
    model, data, prior, tmp = case
    report = calibrate(str(model), prior, data, out=tmp / "out", betas=BETAS, rows=10, batch_size=1, progress=False)
    expected = by_hand(model, data, prior)
    for kind, key in (("counterfactual", "displacement_counterfactual"), ("propagated", "displacement")):
        for beta in BETAS:
            got = report[key]["layers"][f"{beta:g}"]["both"]
            assert got == pytest.approx(expected[kind][beta], abs=1e-12), (kind, beta)
    assert expected["counterfactual"][2.0][0] > 0.2  # the bias does move choices here
    assert expected["propagated"][2.0][1] != expected["counterfactual"][2.0][1]  # later layers see biased ones
    d = report["displacement"]
    assert d["layers"]["0"]["both"] == [0.0, 0.0] and d["mean_ci"]["0"]["both"] == [0.0, 0.0]
    lo, hi = d["layers_ci"]["2"]["both"][0]
    assert lo <= d["layers"]["2"]["both"][0] <= hi and lo < hi
    assert report["group_displacement"]["mean"]["2"]["both"] > 0 and report["sample_rows"] == list(range(10))
    written = json.loads((tmp / "out" / "calibrate.json").read_text())
    assert written["recommended_beta"] == report["recommended_beta"] in BETAS
    assert (tmp / "out" / "calibrate.png").stat().st_size > 5000 and "recommended beta" in (
        tmp / "out" / "calibrate.md"
    ).read_text()


#: candidates around this model's crossing: counterfactual means (both) ~0.21, 0.41, 0.48, 0.53, 0.65; the A span
#: alone crosses one half a beta earlier (~0.56 at 1.2), so a rule fed the A means recommends 1.0, not 1.2
RULE_BETAS = [0.5, 1.0, 1.2, 1.4, 2.0]


def by_hand_rule(mean_by_beta: dict[float, float]) -> float:
    """docs/calibrate.md's rule: the largest candidate, in increasing order, before the first whose mean
    counterfactual displacement exceeds one half; 0 when the smallest already does."""
    chosen = 0.0
    for beta in sorted(mean_by_beta):
        if mean_by_beta[beta] > 0.5:
            return chosen
        chosen = beta
    return chosen


def check_recommendation(out) -> float:
    """calibrate.json's recommended beta is the rule applied to its counterfactual displacement of content tokens
    (both spans), averaged over MoE layers here; returns it."""
    written = json.loads((out / "calibrate.json").read_text())
    cf = written["displacement_counterfactual"]
    means = {}
    for beta in written["betas"]:
        per_layer = cf["layers"][f"{beta:g}"]["both"]
        assert len(per_layer) == len(written["moe_layers"])
        means[beta] = sum(per_layer) / len(per_layer)
        assert cf["mean"][f"{beta:g}"]["both"] == pytest.approx(means[beta], abs=1e-12)
    expected = by_hand_rule(means)
    assert written["recommended_beta"] == expected, f"recommended {written['recommended_beta']}, the rule {expected}"
    return expected


@pytest.fixture(scope="module")
def recommended(case):
    model, data, prior, tmp = case
    calibrate(str(model), prior, data, out=tmp / "rule", betas=RULE_BETAS, rows=10, progress=False)
    return tmp / "rule"


def test_the_recommendation_is_the_rule_on_the_counterfactual_means(recommended):
    beta = check_recommendation(recommended)
    assert RULE_BETAS[0] < beta < RULE_BETAS[-1]  # neither trivially the first nor the last candidate


def test_mutant_rule_fed_the_answer_span_is_caught(case, tmp_path, monkeypatch):
    """The bug: calibrate hands the rule the A span's counterfactual means instead of both spans'."""
    build = rpb.calibrate.run.build_report

    def mutant(counter, betas, *args):
        report = build(counter, betas, *args)
        cf = report["displacement_counterfactual"]["mean"]
        return report | {"recommended_beta": rule.recommend_beta({b: cf[f"{b:g}"]["A"] for b in betas})}

    monkeypatch.setattr(rpb.calibrate.run, "build_report", mutant)
    model, data, prior, _ = case
    calibrate(str(model), prior, data, out=tmp_path, betas=RULE_BETAS, rows=10, progress=False)
    with pytest.raises(AssertionError, match=r"recommended 1\.0, the rule 1\.2"):
        check_recommendation(tmp_path)


def test_a_sample_reads_only_its_rows_and_is_seeded(case):
    model, data, prior, _ = case
    a = calibrate(str(model), prior, data, betas=[1.0], rows=4, seed=3, progress=False)
    b = calibrate(str(model), prior, data, betas=[1.0], rows=4, seed=3, progress=False)
    assert a == b and len(a["sample_rows"]) == 4 and a["sample_rows"] == sorted(a["sample_rows"])
    assert (
        a["sample_rows"]
        != calibrate(str(model), prior, data, betas=[1.0], rows=4, seed=4, progress=False)["sample_rows"]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--betas", ""], "at least one beta"),
        (["--betas", "0.5,-1"], "must be >= 0"),
        (["--betas", "nan,1"], "NaN"),
        (["--betas", "1,1"], "each beta once"),
        (["--rows", "0"], "--rows: must be >= 1"),
        (["--rows", "11"], "has only 10 rows"),
    ],
)
def test_bad_inputs_are_refused_by_name(case, args, message, capsys):
    model, data, prior, tmp = case
    argv = [
        "calibrate",
        "--model",
        str(model),
        "--prior",
        str(prior),
        "--data-jsonl",
        str(data),
        "--out",
        str(tmp / "bad"),
        "--no-progress",
        *args,
    ]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp / "bad" / "calibrate.json").exists()


def test_the_prior_is_checked_against_the_whole_file_first(case, tmp_path):
    model, data, prior, _ = case
    edited = tmp_path / "edited.jsonl"
    edited.write_text(data.read_text() + data.read_text().splitlines()[0] + "\n")
    with pytest.raises(PriorMismatchError, match="num_rows"):
        calibrate(str(model), prior, edited, betas=[1.0], rows=2, progress=False)
    with pytest.raises(ArgumentError):
        calibrate(str(model), prior, data, betas=[], rows=2, progress=False)

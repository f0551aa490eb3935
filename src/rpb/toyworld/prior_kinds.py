"""Frequency against probability prior on the toy world's trained bases, per MoE layer: how far apart the two
priors are, how much of each the clip lifts, how far each one's bias moves the base's own choice at the same beta
(``rpb calibrate`` on each), and on how many tokens the two biases choose different experts.

Shape legend: N = rows, S = spans, L = MoE layers, E = experts, T = one row's tokens, K = top-k.

``python -m rpb.toyworld.prior_kinds RUN OUT`` reads the ``beta-frequency`` grid's run folder ``RUN`` (each base's
data and both priors; made there if missing) and writes ``OUT/prior_kinds.json`` and ``OUT/prior_kinds.md``, the
table docs/collect.md quotes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rpb.adapters import find_moe_layers, router_spec
from rpb.adapters.hf import expert_bias_of
from rpb.calibrate import calibrate
from rpb.collect.clip import clipped_shares
from rpb.collect.rows import label_rows, scan_rows
from rpb.data import ChatTemplate
from rpb.fileio import write_json_atomic, write_text_atomic
from rpb.models import load_base_model, load_tokenizer
from rpb.observe.hooks import on_router_calls
from rpb.prior import log_prior_bias
from rpb.prior.checks import load_prior
from rpb.routing import select

#: the betas compared (the frequency grid's)
BETAS = (0.25, 1.0)
#: rows of calibrate's seeded sample (its default), on which displacement and disagreement are measured
ROWS = 256


def prior_tvd(prob_NSLE: torch.Tensor, freq_NSLE: torch.Tensor) -> torch.Tensor:
    """``tvd_L``: total variation distance between the two priors' rows, averaged over rows and spans."""
    return 0.5 * (prob_NSLE.double() - freq_NSLE.double()).abs().sum(-1).mean(dim=(0, 1))


@torch.inference_mode()
def disagreement(
    model_dir: str, data, max_seq_len: int, rows: list[int], bias_a: torch.Tensor, bias_b: torch.Tensor, betas
) -> dict[str, list[float]]:
    """``{beta: share_L}``: of the content tokens of ``rows``, the share whose top-k under ``beta * bias_a``
    differs from that under ``beta * bias_b`` (each ``[N, S, L, E]``, the token's own row and span), the family's
    own selection (expert-correction bias and groups included); one forward of each row serves every beta."""
    model, facts = load_base_model(model_dir)
    layers = find_moe_layers(model, facts)
    template = ChatTemplate(load_tokenizer(model_dir))
    examples = label_rows(scan_rows(data, template, max_seq_len), template, max_seq_len, rows)
    differ, total = {b: torch.zeros(len(layers)) for b in betas}, 0
    logits: dict[int, torch.Tensor] = {}  # each MoE layer's router logits of the row just forwarded
    for ex in examples:
        with on_router_calls(layers, lambda call: logits.__setitem__(call.pos, call.read()[0].detach())):
            model(input_ids=torch.tensor([ex.input_ids]), use_cache=False)
        span_T = torch.tensor(ex.span_ids)
        content = span_T >= 0
        total += int(content.sum())
        for pos, layer in enumerate(layers):
            spec, expert_bias = router_spec(layer.router, facts), expert_bias_of(layer, facts)
            z_TE = logits[pos][content].float()
            spans = span_T[content]
            for beta in betas:
                chosen = [
                    select(z_TE, spec, beta * b[ex.index, spans, pos], expert_bias).sort(dim=-1).values
                    for b in (bias_a, bias_b)
                ]
                differ[beta][pos] += (chosen[0] != chosen[1]).any(dim=-1).sum()
    return {f"{b:g}": (differ[b] / max(total, 1)).tolist() for b in betas}


def compare(study, post_set: str, rows: int = ROWS, seed: int = 0) -> dict:
    """The comparison on one base and set (``study``: a ``Study`` of the frequency grid)."""
    paths = {kind: study.prior(post_set, kind) for kind in ("probability", "frequency")}
    priors = {kind: load_prior(p) for kind, p in paths.items()}
    prob, freq = priors["probability"].prior_qa, priors["frequency"].prior_qa
    base, data = str(study.base()), study.data(post_set)
    calibrated = {
        kind: calibrate(base, p, data, betas=list(BETAS), rows=rows, seed=seed, batch_size=64, progress=False)
        for kind, p in paths.items()
    }
    sample = calibrated["probability"]["sample_rows"]
    biases = {kind: log_prior_bias(a.prior_qa) for kind, a in priors.items()}
    return {
        "base": study.base_seed,
        "set": post_set,
        "moe_layers": priors["frequency"].metadata["moe_layers"],
        "rows": int(prob.shape[0]),
        "sample_rows": len(sample),
        "tvd": prior_tvd(prob, freq).tolist(),
        "clipped_share": {kind: clipped_shares(a.prior_qa).mean(dim=0).tolist() for kind, a in priors.items()},
        "displacement": {
            kind: {f"{b:g}": c["displacement"]["layers"][f"{b:g}"]["both"] for b in BETAS}
            for kind, c in calibrated.items()
        },
        "disagreement": disagreement(base, data, study.post.max_seq_len, sample, *biases.values(), BETAS),
    }


def table(comparisons: list[dict]) -> str:
    """The markdown table docs/collect.md quotes: one row per base, set and MoE layer."""
    lines = [
        "| base | set | layer | TVD(prob, freq) | clipped: prob / freq | displaced at 0.25: prob / freq | "
        "displaced at 1: prob / freq | top-k differs at 0.25 / 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        for i, layer in enumerate(c["moe_layers"]):
            clip = " / ".join(f"{100 * c['clipped_share'][k][i]:.0f}%" for k in ("probability", "frequency"))
            moved = [
                " / ".join(f"{100 * c['displacement'][k][f'{b:g}'][i]:.0f}%" for k in ("probability", "frequency"))
                for b in BETAS
            ]
            differs = " / ".join(f"{100 * c['disagreement'][f'{b:g}'][i]:.0f}%" for b in BETAS)
            lines.append(
                f"| {c['base']} | {c['set']} | {layer} | {c['tvd'][i]:.3f} | {clip} | {moved[0]} | {moved[1]} | "
                f"{differs} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from rpb.toyworld.grids.beta_frequency import GRID as FREQUENCY_GRID
    from rpb.toyworld.study.across import studies

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="the beta-frequency grid's run folder (rpb experiment --out)")
    parser.add_argument("out", help="where to write prior_kinds.json and prior_kinds.md")
    args = parser.parse_args(argv)
    found = [
        compare(st, s) for st in studies(FREQUENCY_GRID, Path(args.run), progress=False) for s in FREQUENCY_GRID.sets
    ]
    write_json_atomic(Path(args.out) / "prior_kinds.json", found)
    write_text_atomic(Path(args.out) / "prior_kinds.md", table(found))
    print(table(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``rpb retention --revert-routers``: load the two models (a LoRA / PEFT post model merged first), measure every
variant on every domain (``rpb.retention.revert``) and write report.json, report.md and revert.png.

The first ``--domain`` is the training domain and the report says so. ``--data-jsonl`` stays the routing data:
its rows are measured like a domain's (the overlap shows the routing went back) but are no domain of the figure.
"""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from rpb.adapters import find_moe_layers, get_adapter
from rpb.data import load_labelled
from rpb.errors import ArgumentError
from rpb.fileio import output_folder
from rpb.models import load_causal_lm, load_tokenizer, pad_id_of, resolve_device
from rpb.retention.revert import (
    BASE,
    POST,
    REVERSED,
    REVERTED,
    Pair,
    answer_budget,
    generate_domain,
    measure_domain,
    variants,
)
from rpb.retention.run import RoutingMismatchError, check_comparable, select_rows

SCHEMA = "rpb_revert"
#: each interval of the report: (variant, the variant it is taken against), NLL of the first minus the second
DELTAS = {"delta_nll": (REVERTED, POST), "delta_nll_reverse": (REVERSED, BASE)}
#: the routing data's name in the report (no domain may take it)
ROUTING = "routing data"


def parse_domains(specs: list[str]) -> dict[str, str]:
    """``NAME=PATH`` pairs, in the order given; every malformed or repeated one named at once."""
    problems, domains = [], {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            problems.append(f"{spec!r} is not NAME=PATH")
        elif name in domains or name == ROUTING:
            problems.append(f"domain {name!r} given twice" if name in domains else f"{ROUTING!r} is reserved")
        else:
            domains[name] = path
    if problems:
        raise ArgumentError("--domain: " + "; ".join(problems))
    if not domains:
        raise ArgumentError("--revert-routers needs at least one --domain NAME=PATH (the first: the training domain)")
    return domains


def load_post(post: str, base: str, dtype: str):
    """The post-trained causal LM; a PEFT adapter folder (``adapter_config.json``) is put on ``base`` and merged,
    so no wrapper's factors move a router after the revert."""
    if not (Path(post) / "adapter_config.json").is_file():
        return load_causal_lm(post, dtype)
    try:
        from peft import PeftModel
    except ImportError as err:  # pragma: no cover - the peft extra is installed by make
        raise ArgumentError(f"{post} is a PEFT adapter: pip install 'rpb[peft]' to merge it") from err
    return PeftModel.from_pretrained(load_causal_lm(base, dtype), post).merge_and_unload()


def load_pair(base: str, post: str, dtype: str, device: str, shared_gates: bool, adapter: str | None = None) -> Pair:
    models = [load_causal_lm(base, dtype), load_post(post, base, dtype)]
    types = [m.config.get_text_config().model_type for m in models]
    if types[0] != types[1]:
        raise RoutingMismatchError(f"the base is a {types[0]!r} model, the post model a {types[1]!r} one")
    facts = get_adapter(adapter or models[0].config.model_type)
    where = resolve_device(device)
    models = [m.to(where).eval() for m in models]
    layers = [find_moe_layers(m, facts) for m in models]
    described = [
        {
            "moe_layers": [m.layer_index for m in lay],
            "num_experts": int(lay[0].router.weight.shape[0]),
            "top_k": int(getattr(m.config.get_text_config(), facts.top_k_config)),
        }
        for m, lay in zip(models, layers, strict=True)
    ]
    check_comparable(*described)
    return Pair(models[0], models[1], layers[0], layers[1], facts, shared_gates)


def run_revert(
    base: str,
    post: str,
    domains: dict[str, str | Path],
    out_dir: str | Path,
    data_jsonl: str | Path | None = None,
    reverse: bool = False,
    generate: bool = False,
    max_new_tokens: int | None = None,
    shared_gates: bool = False,
    max_rows: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    max_seq_len: int = 2048,
    dtype: str = "float32",
    device: str = "auto",
    tokenizer: str | None = None,
    adapter: str | None = None,
    progress: bool = True,
    chat_template_kwargs: dict | None = None,
    resamples: int = 2000,
) -> dict:
    """The revert test (module docstring); writes report.json, report.md and revert.png into ``out_dir`` (published
    whole) and returns the report. ``domains``: name -> JSONL, the first the training domain."""
    from rpb.retention.revert_report import delta_interval, write_revert

    if not domains:
        raise ArgumentError("the revert needs at least one domain (the first: the training domain)")
    sets = {name: Path(path) for name, path in domains.items()}
    if data_jsonl is not None:
        sets[ROUTING] = Path(data_jsonl)
    option = {n: f"--domain {n}={p}" for n, p in sets.items()} | {ROUTING: f"--data-jsonl {sets.get(ROUTING)}"}
    missing = [f"{option[n]}: no such file" for n, p in sets.items() if not p.is_file()]
    if missing:  # every one at once, before any model or tokenizer loads
        raise ArgumentError("the revert's data files:\n  " + "\n  ".join(missing))
    tok = load_tokenizer(tokenizer or base)
    labelled = {n: load_labelled(p, tok, max_seq_len, chat_template_kwargs) for n, p in sets.items()}  # every bad row
    pair = load_pair(base, post, dtype, device, shared_gates, adapter)
    names, pad = variants(reverse), pad_id_of(tok)
    report = {
        "schema": SCHEMA,
        "schema_version": 1,
        "base": str(base),
        "post": str(post),
        "training_domain": next(iter(domains)),
        "variants": list(names),
        "shared_gates": shared_gates,
        "generate": generate,
        "max_rows": max_rows,
        "seed": seed,
        "resamples": resamples,
        **next(iter(labelled.values())).template_settings,
        "sets": {},
    }
    total = sum(len(select_rows(d.num_rows, max_rows, seed)) for d in labelled.values()) * len(names)
    with tqdm(total=total, unit="row", desc="revert", disable=not progress) as bar:
        for name, data in labelled.items():
            rows = select_rows(data.num_rows, max_rows, seed)
            examples = [data.examples[i] for i in rows]
            figures = measure_domain(pair, examples, names, batch_size, pad, _Scaled(bar, len(names)))
            entry = {"path": str(sets[name]), "rows": len(rows), "answer_tokens": figures[POST].answer_tokens}
            if generate and name != ROUTING:
                budget = max_new_tokens or answer_budget(examples)
                generate_domain(pair, tok, examples, names, figures, budget, batch_size, pad)
                entry["max_new_tokens"] = budget
            entry["variants"] = {v: f.summary() for v, f in figures.items()}
            for key, (v, reference) in DELTAS.items():
                if v in figures:
                    entry[key] = delta_interval(figures[v].nll_rows, figures[reference].nll_rows, resamples, seed)
            report["sets"][name] = entry
    with output_folder(out_dir, _owned) as out:
        write_revert(report, out)
    return report


class _Scaled:
    """Counts a batch's rows once per variant on the shared bar."""

    def __init__(self, bar, times: int):
        self.bar, self.times = bar, times

    def update(self, n: int) -> None:
        self.bar.update(n * self.times)


def _owned(name: str) -> bool:
    return name in ("report.json", "report.md", "revert.png")

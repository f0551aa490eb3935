"""Data mixing (``data.mix``): rows of other JSONL files take the places of some of the training file's rows.

The number of training rows, and so of steps, stays the training file's. Each extra file gives ``round(share x N)``
rows (N: the training file's rows), drawn without replacement by a generator seeded with ``data.seed``; they take
the places of as many training-file rows, drawn the same way, and every other row keeps its place. The order is
written down whole (``MixedData.record``, in ``rpb_run.json``): position p of the mixed data is row ``order[p][1]``
of source ``order[p][0]`` (0: the training file; i: the i-th extra file). A mixed row trains like any other row.

A prior (or a route file) covers one data file, row by row; a run that reads one cannot take mixed rows, and the
configuration refuses it (``rpb.train.config.validate``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rpb.data.dataset import Example, LabelledData
from rpb.errors import ConfigError


@dataclass(frozen=True)
class MixSource:
    """One extra file of ``data.mix``: its path and the share of the training rows it takes."""

    path: str
    share: float


def mix_problems(items: list[dict], where: str = "data.mix") -> list[str]:
    """Every problem of ``data.mix``'s entries (``{path: ..., share: ...}``), each named by its field."""
    out = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            out.append(f"{at}: expected a mapping with path and share, got {item!r}")
            continue
        unknown = sorted(set(item) - {"path", "share"})
        if unknown:
            out.append(f"{at}: unknown key(s) {unknown} (known: path, share)")
        path, share = item.get("path"), item.get("share")
        if not isinstance(path, str) or not path:
            out.append(f"{at}.path: required, a JSONL file")
        elif not Path(path).is_file():
            out.append(f"{at}.path: {path} does not exist")
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share < 1:
            out.append(f"{at}.share: a fraction of the training rows in (0, 1), got {share!r}")
    shares = [i.get("share") for i in items if isinstance(i, dict)]
    if all(isinstance(s, int | float) for s in shares) and sum(shares) >= 1:
        out.append(f"{where}: the shares add up to {sum(shares):g}; the training file must keep some of its rows")
    return out


def mix_sources(items: list[dict]) -> list[MixSource]:
    problems = mix_problems(items)
    if problems:
        raise ConfigError("data.mix", problems)
    return [MixSource(i["path"], float(i["share"])) for i in items]


@dataclass
class MixedData:
    """The mixed rows in their order (each ``Example.index`` its position) and the record of where each came from."""

    examples: list[Example]
    record: dict


def _draw(n: int, k: int, generator: torch.Generator) -> list[int]:
    """``k`` of ``range(n)`` without replacement, in the order drawn."""
    return torch.randperm(n, generator=generator)[:k].tolist()


def mix(main: LabelledData, extras: list[tuple[MixSource, LabelledData]], seed: int) -> MixedData:
    """The training file's rows with ``extras``' rows in the places drawn (module docstring). An extra file with
    fewer rows than its share asks for is refused, every such file named."""
    n = main.num_rows
    takes = [round(source.share * n) for source, _ in extras]
    short = [
        f"{source.path}: share {source.share:g} of {n} rows asks for {k} rows, the file has {data.num_rows}"
        for (source, data), k in zip(extras, takes, strict=True)
        if k > data.num_rows
    ]
    if sum(takes) >= n:  # the shares add up to under 1, but each is rounded
        short.append(f"the shares take {sum(takes)} of the training file's {n} rows; it must keep some")
    if short:
        raise ConfigError("data.mix", short)
    generator = torch.Generator().manual_seed(seed)
    places = _draw(n, sum(takes), generator)  # the training-file rows the mixed rows replace
    order = [(0, e.index) for e in main.examples]
    rows: list[Example] = list(main.examples)
    start = 0
    for i, ((_, data), k) in enumerate(zip(extras, takes, strict=True), start=1):
        for place, pick in zip(places[start : start + k], _draw(data.num_rows, k, generator), strict=True):
            rows[place] = data.examples[pick]
            order[place] = (i, data.examples[pick].index)
        start += k
    examples = [Example(p, e.input_ids, e.span_ids) for p, e in enumerate(rows)]
    order_json = [list(o) for o in order]
    record = {
        "seed": seed,
        "rows": n,
        "sources": [{"path": main.path, "sha256": main.sha256, "rows": n - sum(takes)}]
        + [
            {"path": data.path, "sha256": data.sha256, "share": source.share, "rows": k}
            for (source, data), k in zip(extras, takes, strict=True)
        ],
        "order_sha256": hashlib.sha256(json.dumps(order_json).encode()).hexdigest(),
        "order": order_json,
    }
    return MixedData(examples, record)

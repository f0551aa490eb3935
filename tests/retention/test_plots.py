"""Retention figures and Markdown from a synthetic report: files exist, images carry content, numbers render."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from rpb.retention.markdown import render_markdown, write_markdown
from rpb.retention.plots import community_order, plot_coactivation, plot_layer_bars, plot_utilization

E = 12
LAYERS = [1, 2, 4]  # model layer indices of the MoE layers (layer 3 dense)
# Two communities, interleaved in expert id so the plot has to reorder them.
LABELS_E = np.arange(E) % 2


def _coactivation(rng: np.random.Generator) -> np.ndarray:
    same_EE = LABELS_E[:, None] == LABELS_E[None, :]
    w_EE = np.where(same_EE, 0.2, 0.02) * rng.uniform(0.5, 1.5, size=(E, E))
    w_EE = (w_EE + w_EE.T) / 2
    np.fill_diagonal(w_EE, 0.0)
    return w_EE


def _report(pair: bool = True) -> dict:
    rng = np.random.default_rng(0)
    layers = []
    for layer in LAYERS:
        row = {
            "layer": layer,
            "entropy_base_bits": float(rng.uniform(3.0, 3.58)),
            "communities_base": 2,
            "modularity_base": float(rng.uniform(0.2, 0.5)),
        }
        if pair:
            row |= {k: float(rng.uniform(0.0, 0.3)) for k in ("tvd", "jsd", "tvd_q", "jsd_q", "tvd_a", "jsd_a")}
            row |= {k: float(rng.uniform(0.6, 1.0)) for k in ("topk_overlap", "topk_overlap_q", "topk_overlap_a")}
            row |= {
                "entropy_post_bits": float(rng.uniform(3.0, 3.58)),
                "communities_post": 3,
                "modularity_post": float(rng.uniform(0.2, 0.5)),
                "nmi": float(rng.uniform(0.4, 1.0)),
            }
        layers.append(row)
    if pair:
        layers[1]["modularity_post"] = math.nan  # e.g. a graph without edges
    keys = [k for k in layers[0] if k != "layer"]
    return {
        "schema": "rpb_retention",
        "schema_version": 1,
        "base": "models/base",
        "post": "runs/rpb/final" if pair else None,
        "data": "data/eval.jsonl",
        "rows": 40,
        "tokens": {"all": 12345, "Q": 4000, "A": 8345},
        "top_k": 2,
        "num_experts": E,
        "moe_layers": LAYERS,
        "seed": 7,
        "resolution": 1.0,
        "layers": layers,
        "mean": {k: float(np.nanmean([r[k] for r in layers])) for k in keys},
    }


def _assert_picture(path: Path) -> None:
    assert path.is_file()
    img = imread(path)
    h, w = img.shape[:2]
    assert w > 300 and h > 200
    colours = np.unique(img.reshape(-1, img.shape[-1]), axis=0)
    assert len(colours) > 20, "image is (nearly) a single colour"


@pytest.fixture
def pictures(tmp_path) -> dict[str, str]:
    rng = np.random.default_rng(1)
    util_base_LE = rng.dirichlet(np.ones(E), size=len(LAYERS))
    util_post_LE = torch.from_numpy(rng.dirichlet(np.ones(E), size=len(LAYERS)))  # torch input accepted too
    report = _report()
    images = {
        "utilization": plot_utilization(util_base_LE, util_post_LE, LAYERS, tmp_path / "utilization.png"),
        "layers": plot_layer_bars(report, tmp_path / "layers.png"),
        "coactivation_layer2": plot_coactivation(
            _coactivation(rng), _coactivation(rng), LABELS_E, 2, tmp_path / "coactivation_layer2.png"
        ),
    }
    return {name: str(p) for name, p in images.items()}


def test_plots_write_nontrivial_pngs(pictures, tmp_path):
    for p in pictures.values():
        _assert_picture(Path(p))


def test_single_model_plots(tmp_path):
    rng = np.random.default_rng(2)
    report = _report(pair=False)
    _assert_picture(plot_utilization(rng.dirichlet(np.ones(E), size=3), None, LAYERS, tmp_path / "u.png"))
    _assert_picture(plot_coactivation(_coactivation(rng), None, torch.from_numpy(LABELS_E), 4, tmp_path / "c.png"))
    _assert_picture(plot_layer_bars(report, tmp_path / "b.png"))


def test_a_wide_layer_labels_its_largest_communities_only(tmp_path, monkeypatch):
    """384 experts in 139 communities (129 isolated, as a short run leaves them): 40 labelled, the largest."""
    import rpb.retention.plots as plots

    sizes = {1000 + i: 30 - i for i in range(10)} | {i: 1 for i in range(129)}
    labels_E = np.concatenate([np.full(n, c) for c, n in sizes.items()])
    np.random.default_rng(0).shuffle(labels_E)
    assert labels_E.shape == (384,)
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or Path(path))
    plot_coactivation(np.ones((384, 384)), None, labels_E, 0, tmp_path / "c.png")
    ax = figures[0].axes[0]
    # ties among the isolated ones go to the first in community order (smallest label)
    expected = [f"c{i}" for i in range(30)] + [f"c{1000 + i}" for i in range(10)]
    assert [t.get_text() for t in ax.get_xticklabels()] == expected == [t.get_text() for t in ax.get_yticklabels()]
    assert "139 base communities" in figures[0].get_suptitle()


def test_community_order_sorts_by_label_then_id():
    assert community_order([1, 0, 1, 0, 2]).tolist() == [1, 3, 0, 2, 4]
    assert community_order(LABELS_E).tolist() == [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11]


def test_plot_shape_errors(tmp_path):
    with pytest.raises(ValueError, match="layer labels"):
        plot_utilization(np.full((3, E), 1 / E), None, [1, 2], tmp_path / "u.png")
    with pytest.raises(ValueError, match="community labels"):
        plot_coactivation(np.zeros((E, E)), None, [0, 1], 0, tmp_path / "c.png")


def _links(md: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)


def test_markdown_pair(pictures, tmp_path):
    report = _report()
    md_path = write_markdown(report, pictures, tmp_path / "report.md")
    md = md_path.read_text(encoding="utf-8")

    assert "`models/base`" in md and "`runs/rpb/final`" in md and "`data/eval.jsonl`" in md
    assert "12,345 tokens (4,000 question, 8,345 answer)" in md
    assert "top-2 of 12 experts" in md and "resolution 1" in md and "seed 7" in md
    assert "## Summary" in md and "## Per layer" in md
    header = (
        "| layer | TVD | JSD | TVD Q | TVD A | overlap | overlap Q | overlap A | NMI | modularity base"
        " | modularity post | communities base | communities post |"
    )
    assert header in md

    for row in report["layers"]:
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {row['layer']} | "))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == format(row["tvd"], ".4f")
        assert cells[5] == format(row["topk_overlap"], ".4f")
        assert cells[8] == format(row["nmi"], ".4f")
        assert cells[-2:] == ["2", "3"]
    nan_line = next(ln for ln in md.splitlines() if ln.startswith(f"| {LAYERS[1]} | "))
    assert "| n/a |" in nan_line
    mean = report["mean"]
    for key in ("tvd", "jsd_q", "topk_overlap_a", "nmi", "entropy_base_bits", "entropy_post_bits", "modularity_post"):
        assert format(mean[key], ".4f") in md, key
    for term in ("TVD", "JSD", "top-k overlap", "NMI", "Louvain", "bits"):
        assert term in md

    links = _links(md)
    assert len(links) == 3
    assert "![Expert co-activation, layer 2](" in md
    for link in links:
        assert not Path(link).is_absolute()
        assert (md_path.parent / link).is_file()


def test_markdown_single_model(tmp_path):
    report = _report(pair=False)
    report["layers"][0]["modularity_base"] = math.nan
    md = render_markdown(report, {"layers": "layers.png"})
    assert "post-trained" not in md and "TVD" not in md and "NMI" not in md
    assert "| layer | entropy (bits) | communities | modularity |" in md
    first = report["layers"][0]
    assert f"| {first['layer']} | {first['entropy_base_bits']:.4f} | 2 | n/a |" in md
    assert _links(md) == ["layers.png"]

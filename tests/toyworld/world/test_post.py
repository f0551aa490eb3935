"""Shipped bases: found by recipe, checked against their pin, copied into the cache with the pinned sha256;
``--from-scratch`` (``shipped=False``) pretrains instead, replacing a cached copy of a shipped base. And the
repository's own shipped bases hash to their pins and record the recipe they pin."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from rpb.data import file_sha256
from rpb.toyworld.world import post as world
from rpb.toyworld.world.base import BaseRecipe, pretrain
from rpb.toyworld.world.post import BaseMismatchError, ensure_base, shipped_base

TINY = BaseRecipe(
    hidden_size=32,
    num_hidden_layers=2,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    intermediate_size=64,
    batch_size=8,
    max_steps=2,
    pool=64,
)


@pytest.fixture(scope="module")
def shipped_root(tmp_path_factory) -> Path:
    """A bases folder as the repository ships it: base0/ pretrained elsewhere, pinned in bases.json."""
    root = tmp_path_factory.mktemp("bases")
    pretrain(TINY, root / "base0", progress=False, eval_per_domain=1)
    pin = {
        "recipe": asdict(TINY),
        "weights_sha256": file_sha256(root / "base0" / "model.safetensors"),
        "machine": "elsewhere",
        "threads": 1,
    }
    (root / "bases.json").write_text(json.dumps({"base0": pin}))
    return root


def test_the_shipped_base_is_found_by_its_recipe(shipped_root):
    assert shipped_base(TINY, shipped_root) == shipped_root / "base0"
    assert shipped_base(replace(TINY, seed=1), shipped_root) is None
    assert shipped_base(TINY, shipped_root / "nowhere") is None


def test_an_imported_base_pins_the_shipped_sha256(shipped_root, tmp_path, monkeypatch):
    monkeypatch.setattr(world, "SHIPPED_BASES", shipped_root)
    monkeypatch.setattr(world, "pretrain", lambda *a, **k: pytest.fail("a shipped base was pretrained again"))
    where, record = ensure_base(TINY, tmp_path)
    pinned = json.loads((shipped_root / "bases.json").read_text())["base0"]["weights_sha256"]
    assert file_sha256(where / "model.safetensors") == pinned
    assert record["shipped"] == str(shipped_root / "base0")
    assert json.loads((where / "recipe.json").read_text()) == record  # the cache says where it came from
    assert ensure_base(TINY, tmp_path) == (where, record)  # cached now


def test_from_scratch_pretrains_even_over_a_cached_copy_of_the_shipped_base(shipped_root, tmp_path, monkeypatch):
    monkeypatch.setattr(world, "SHIPPED_BASES", shipped_root)
    ensure_base(TINY, tmp_path)
    where, record = ensure_base(TINY, tmp_path, shipped=False)
    assert "shipped" not in record and record["steps"] == TINY.max_steps
    assert "shipped" not in json.loads((where / "recipe.json").read_text())


def test_a_shipped_base_that_does_not_hash_to_its_pin_is_refused(shipped_root, tmp_path):
    bad = tmp_path / "bases"
    (bad / "base0").mkdir(parents=True)
    for f in (shipped_root / "base0").iterdir():
        (bad / "base0" / f.name).write_bytes(f.read_bytes())
    pins = json.loads((shipped_root / "bases.json").read_text())
    pins["base0"]["weights_sha256"] = "0" * 64
    (bad / "bases.json").write_text(json.dumps(pins))
    with pytest.raises(BaseMismatchError, match=r"model\.safetensors: sha256"):
        shipped_base(TINY, bad)


def test_the_repositorys_shipped_bases_hash_to_their_pins():
    pins_file = world.SHIPPED_BASES / "bases.json"
    if not pins_file.is_file():
        pytest.skip("no shipped bases in this checkout")
    for name, pin in json.loads(pins_file.read_text()).items():
        folder = world.SHIPPED_BASES / name
        assert file_sha256(folder / "model.safetensors") == pin["weights_sha256"], name
        record = json.loads((folder / "recipe.json").read_text())
        assert record["recipe"] == pin["recipe"] and record["threads"] == pin["threads"]
        assert shipped_base(BaseRecipe(**{**pin["recipe"], "text_ops": tuple(pin["recipe"]["text_ops"])})) == folder

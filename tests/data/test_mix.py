"""``data.mix``: extra files' rows take the places of training rows; the order is recorded, every row once."""

import hashlib
import json
import re
from collections import Counter

import pytest
import torch
from transformers import TrainerCallback

from rpb.data import load_labelled
from rpb.data.mix import MixSource, mix, mix_problems
from rpb.errors import ConfigError
from rpb.testing.data import write_jsonl
from rpb.train.config import load_config
from rpb.train.dryrun import DryRunError, dry_run
from rpb.train.run import run_training
from tests.conftest import qa, write_rows


@pytest.fixture(scope="module")
def files(tmp_path_factory, moon_tok):
    """A training file of 20 rows and two extra files (10 and 5 rows), each row's question naming its file."""
    tmp = tmp_path_factory.mktemp("mix")
    paths = {}
    for name, n in (("main", 20), ("math", 10), ("code", 5)):
        paths[name] = write_rows(tmp / f"{name}.jsonl", [qa(f"{name} question {i}?", f"{name} {i}") for i in range(n)])
    labelled = {name: load_labelled(p, moon_tok, 128) for name, p in paths.items()}
    return paths, labelled


def _mixed(files, seed=42, shares=(0.2, 0.15)):
    paths, labelled = files
    extras = [(MixSource(str(paths[n]), s), labelled[n]) for n, s in zip(("math", "code"), shares, strict=True)]
    return mix(labelled["main"], extras, seed)


def test_the_mixed_rows_take_the_places_drawn_and_every_row_appears_once(files):
    _, labelled = files
    mixed = _mixed(files)
    order = [tuple(o) for o in mixed.record["order"]]
    assert len(mixed.examples) == len(order) == 20  # the training file's rows: the steps do not change
    assert len(set(order)) == 20, "no row twice"
    # round(0.2 x 20) = 4 rows of math, round(0.15 x 20) = 3 of code, in the places of 7 training rows
    assert Counter(source for source, _ in order) == {0: 13, 1: 4, 2: 3}
    assert [s["rows"] for s in mixed.record["sources"]] == [13, 4, 3]
    names = ("main", "math", "code")
    for position, (source, row) in enumerate(order):
        example = mixed.examples[position]
        assert example.index == position
        expected = labelled[names[source]].examples[row]
        assert (example.input_ids, example.span_ids) == (expected.input_ids, expected.span_ids)
        if source == 0:
            assert row == position, "a training row that stays keeps its place"
    assert mixed.record["order_sha256"] == hashlib.sha256(json.dumps(mixed.record["order"]).encode()).hexdigest()
    for seed in range(40):  # whatever the draw: 7 distinct places, every row once
        order = [tuple(o) for o in _mixed(files, seed=seed).record["order"]]
        assert len(set(order)) == 20 and Counter(s for s, _ in order) == {0: 13, 1: 4, 2: 3}, seed


def test_the_draw_follows_the_seed_alone(files):
    assert _mixed(files).record == _mixed(files).record
    assert _mixed(files, seed=7).record["order"] != _mixed(files).record["order"]


def test_the_replaced_places_are_the_documented_draw_and_move_with_the_seed(files):
    """docs/training.md: the places are drawn without replacement with data.seed, then each file's rows the same
    way, file after file. Written out here with torch.randperm, one generator per seed; over 40 seeds every
    training row is replaced some time, so no place is kept from the draw (the first rows always, say)."""
    replaced = Counter()
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        places = torch.randperm(20, generator=g)[:7].tolist()
        picks = [(1, r) for r in torch.randperm(10, generator=g)[:4].tolist()]
        picks += [(2, r) for r in torch.randperm(5, generator=g)[:3].tolist()]
        expected = [[0, p] for p in range(20)]
        for place, pick in zip(places, picks, strict=True):
            expected[place] = list(pick)
        order = _mixed(files, seed=seed).record["order"]
        assert order == expected, seed
        replaced.update(p for p, (source, _) in enumerate(order) if source != 0)
    assert sorted(replaced) == list(range(20)), "a training row never replaced in 40 draws"
    assert max(replaced.values()) < 40, "a place replaced whatever the seed"


def test_a_file_shorter_than_its_share_is_refused_by_name(files):
    with pytest.raises(ConfigError, match=r"code\.jsonl: share 0\.3 of 20 rows asks for 6 rows, the file has 5"):
        _mixed(files, shares=(0.2, 0.3))


def test_shares_that_round_up_to_every_training_row_are_refused(files):
    """Three shares of 0.3 of 5 rows round to 2 rows each: 6 places asked of 5."""
    paths, labelled = files
    extras = [(MixSource(str(paths["math"]), 0.3), labelled["math"])] * 3
    with pytest.raises(ConfigError, match="the shares take 6 of the training file's 5 rows; it must keep some"):
        mix(labelled["code"], extras, 0)


def test_every_problem_of_the_entries_is_named_at_once(files, tmp_path):
    paths, _ = files
    found = mix_problems(
        [
            {"path": str(paths["math"]), "share": 0.6},
            {"path": str(tmp_path / "none.jsonl"), "share": 1.5, "weight": 2},
            {"share": 0.5},
            "code.jsonl",
        ]
    )
    assert found == [
        "data.mix[1]: unknown key(s) ['weight'] (known: path, share)",
        f"data.mix[1].path: {tmp_path / 'none.jsonl'} does not exist",
        "data.mix[1].share: a fraction of the training rows in (0, 1), got 1.5",
        "data.mix[2].path: required, a JSONL file",
        "data.mix[3]: expected a mapping with path and share, got 'code.jsonl'",
        "data.mix: the shares add up to 2.6; the training file must keep some of its rows",
    ]


def _config(model, data, out, *overrides):
    return [f"model={model}", f"data_jsonl={data}", f"output_dir={out}", "train.max_seq_len=128", "anchor.method=sft",
            *overrides]  # fmt: skip


def test_a_method_that_reads_a_prior_refuses_a_mix(files, save_tiny, tmp_path):
    paths, _ = files
    prior = tmp_path / "prior.safetensors"
    prior.write_bytes(b"")
    args = _config(save_tiny("moonlight"), paths["main"], tmp_path / "out", "anchor.method=rpb", f"prior={prior}",
                   f"data.mix=[{{path: {paths['math']}, share: 0.2}}]")  # fmt: skip
    with pytest.raises(ConfigError, match=r"data\.mix: anchor\.method 'rpb' reads a prior"):
        load_config(None, args)


class TrainedRows(TrainerCallback):
    """The input ids and labels of every training forward, read by a forward pre-hook on the Trainer's model."""

    def __init__(self):
        self.forwards: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.hook = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def read(module, a, kw):
            self.forwards.append((kw["input_ids"].detach().clone(), kw["labels"].detach().clone()))

        self.hook = model.register_forward_pre_hook(read, with_kwargs=True)

    def on_train_end(self, args, state, control, **kwargs):
        self.hook.remove()


@pytest.fixture(scope="module")
def mixed_run(files, save_tiny, tmp_path_factory):
    """One epoch of 20 mixed rows in batches of 4 (5 steps): the positions of each batch, read from the collator,
    and the ids and labels of each training forward."""
    from rpb.data import batches

    paths, _ = files
    out = tmp_path_factory.mktemp("mixed-run") / "out"
    positions: list[list[int]] = []
    collate = batches.AnchorCollator.__call__

    def recording(self, features):
        positions.append([f["sample_index"] for f in features])
        return collate(self, features)

    trained = TrainedRows()
    mix_arg = f"data.mix=[{{path: {paths['math']}, share: 0.2}}, {{path: {paths['code']}, share: 0.15}}]"
    steps = ["train.max_steps=5", "train.batch_size=4", "train.save_every=0", "train.log_every=1"]
    cfg = load_config(None, _config(save_tiny("moonlight"), paths["main"], out, *steps, mix_arg))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batches.AnchorCollator, "__call__", recording)
        run_training(cfg, progress=False, callbacks=[trained])
    return out, positions, trained.forwards


def test_a_run_trains_every_mixed_row_once_an_epoch_and_records_the_order(files, mixed_run):
    """The batches' positions, read from the collator, are each position once, and rpb_run.json holds the order
    that maps them to their files."""
    out, positions, _ = mixed_run
    seen = [p for batch in positions for p in batch]
    record = json.loads((out / "rpb_run.json").read_text())["data_mix"]
    assert record == _mixed(files).record
    assert sorted(seen) == list(range(20)), "every mixed row once in the epoch"
    sources = Counter(record["order"][p][0] for p in seen)
    assert sources == {0: 13, 1: 4, 2: 3}
    losses = [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines() if '"loss"' in line]
    assert losses and all(torch.isfinite(torch.tensor(v)) for v in losses)


def test_each_position_trains_the_tokens_of_the_row_its_record_names(moon_tok, mixed_run):
    """The record could name the mixed rows while the model trains the training file's own: each forward's rows
    are decoded here and must read the question and the trained answer of the row ``order[p]`` names (each row's
    text names its file and its row)."""
    out, positions, forwards = mixed_run
    order = json.loads((out / "rpb_run.json").read_text())["data_mix"]["order"]
    names = ("main", "math", "code")
    assert len(forwards) == 5 and len(positions) >= 5
    mixed_trained = 0
    for batch, (ids_BS, labels_BS) in zip(positions, forwards, strict=False):
        assert ids_BS.shape[0] == len(batch)
        for position, ids_S, labels_S in zip(batch, ids_BS, labels_BS, strict=True):
            source, row = order[position]
            name = names[source]
            text = moon_tok.decode(ids_S.tolist())  # right padding after the row: the question stays whole
            answer = moon_tok.decode(labels_S[labels_S != -100].tolist())
            assert f"<|im_middle|>{name} question {row}?<|im_end|>" in text, (position, order[position], text)
            assert re.fullmatch(rf"{name} {row}<\|im_end\|>", answer), (position, order[position], answer)
            mixed_trained += source != 0
    assert mixed_trained == 7, "the 7 mixed rows trained"


def test_the_dry_run_labels_the_mixed_files_and_says_what_it_takes(files, save_tiny, tmp_path):
    paths, _ = files
    bad = write_jsonl([{"messages": [{"role": "user", "content": "q"}]}] * 3, tmp_path / "bad.jsonl")
    model = save_tiny("moonlight")
    one = f"data.mix=[{{path: {paths['math']}, share: 0.2}}]"
    ok = dry_run(None, _config(model, paths["main"], tmp_path / "o", one))
    assert "data.mix: 4 of " in ok.summary() and ok.mixed["order"] == _mixed_one(files)
    with pytest.raises(DryRunError, match=r"data\.mix\[0\]\.path: .*bad\.jsonl"):
        dry_run(None, _config(model, paths["main"], tmp_path / "o", f"data.mix=[{{path: {bad}, share: 0.1}}]"))


def _mixed_one(files):
    paths, labelled = files
    return mix(labelled["main"], [(MixSource(str(paths["math"]), 0.2), labelled["math"])], 42).record["order"]

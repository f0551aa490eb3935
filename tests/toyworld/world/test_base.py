"""The toy world's base-model recipe at miniature size, and its exact-match scorer."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rpb.testing.models import tiny_config
from rpb.testing.tokenizers import moonlight_tokenizer
from rpb.toyworld.world.base import (
    BaseRecipe,
    encode_tasks,
    exact_match,
    greedy_answers,
    pretrain,
    training_batch,
    training_pool,
)
from rpb.toyworld.world.tasks import DOMAINS, Task, sample


def test_training_pool_is_balanced_and_deterministic():
    pool = training_pool(400, seed=3)
    assert [sum(t.domain == d for t in pool) for d in DOMAINS] == [100] * 4
    assert pool == training_pool(400, seed=3)


def test_miniature_recipe_trains_saves_and_reports(tmp_path):
    recipe = BaseRecipe(
        hidden_size=32,
        num_hidden_layers=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        intermediate_size=64,
        batch_size=8,
        max_steps=6,
        pool=64,
    )
    record = pretrain(recipe, tmp_path, progress=False, eval_per_domain=4)
    again = pretrain(recipe, tmp_path / "again", progress=False, eval_per_domain=4)
    assert again["final_loss"] == record["final_loss"]  # step-based schedule: deterministic
    assert record["steps"] == 6 and torch.isfinite(torch.tensor(record["final_loss"]))
    assert set(record["heldout_exact_match"]) == set(DOMAINS)
    saved = json.loads((tmp_path / "recipe.json").read_text())
    assert saved["steps"] == 6 and saved["threads"] == torch.get_num_threads()
    model = AutoModelForCausalLM.from_pretrained(tmp_path)  # a plain HF checkpoint
    assert model.config.n_routed_experts == 8 and not any(m._forward_hooks for m in model.modules())
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))


class Oracle(torch.nn.Module):
    """Stands in for a model: 'generates' the given answers (or wrong ones) after the prompt."""

    def __init__(self, tokenizer, answers):
        super().__init__()
        self.tokenizer, self.answers, self.dummy = tokenizer, answers, torch.nn.Parameter(torch.zeros(1))

    def generate(self, input_ids, attention_mask, **kwargs):
        ends = [self.tokenizer(a + "<|im_end|>", add_special_tokens=False)["input_ids"] for a in self.answers]
        width = max(len(e) for e in ends)
        pad = self.tokenizer.pad_token_id
        tails = torch.tensor([e + [pad] * (width - len(e)) for e in ends])
        return torch.cat([input_ids, tails], dim=1)


def test_exact_match_scores_decoded_answers():
    tok = moonlight_tokenizer()
    tasks = [Task("math", "rev 12+34=", "64"), Task("code", "sort 3 1 2", "1 2 3")]
    assert exact_match(Oracle(tok, ["64", "1 2 3"]), tok, tasks) == 1.0
    assert exact_match(Oracle(tok, ["64", "1 2 4"]), tok, tasks) == 0.5


def test_exact_match_restores_the_tokenizer_and_train_mode_even_when_generation_fails():
    tok = moonlight_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_config("moonlight", len(tok))).train()

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory, say")

    model.generate = broken
    with pytest.raises(RuntimeError, match="out of memory"):
        exact_match(model, tok, [Task("math", "rev 1+2=", "3")])
    assert tok.padding_side == "right" and model.training


# ---- the fast path (rpb_sorted experts, packed rows) against the reference path ----------------------


@pytest.fixture(scope="module")
def two_paths():
    """The full-size base architecture, one set of random weights, loaded on each path's kernels; 64 rows of
    the real pretraining pool."""
    from dataclasses import replace

    tokenizer, recipe = moonlight_tokenizer(), BaseRecipe()
    torch.manual_seed(0)
    config = tiny_config("moonlight", len(tokenizer), **recipe.model_overrides())
    weights = AutoModelForCausalLM.from_config(config).state_dict()
    models = {}
    for path in ("reference", "fast"):
        r = replace(recipe, kernels=path)
        kernel = {"experts_implementation": r.experts_implementation} if r.experts_implementation else {}
        models[path] = AutoModelForCausalLM.from_config(config, **kernel)
        models[path].load_state_dict(weights)
    rows = encode_tasks(tokenizer, training_pool(256, seed=0, params=recipe.domain_params()))[::4]
    return tokenizer, recipe, models, rows


def test_fast_and_reference_paths_give_the_same_pretraining_loss(two_paths):
    from dataclasses import replace

    from rpb.anchors import AnchorConfig, install_anchor

    tokenizer, recipe, models, rows = two_paths
    losses = {}
    for path, model in models.items():
        model.train()
        handle = install_anchor(model, AnchorConfig(method="lbl", lbl_coef=recipe.lbl_coef))
        batch = training_batch(rows, tokenizer.pad_token_id, replace(recipe, kernels=path))
        keys = batch.pop("rpb_sample_index"), batch.pop("rpb_span")
        packed = "position_ids" in batch
        with handle.step(*keys, batch.get("attention_mask")):
            lm = model(**batch, use_cache=False).loss
            losses[path] = (float(lm), float(lm + handle.loss()), packed, batch["input_ids"].numel())
        handle.remove()
    (lm_r, total_r, packed_r, n_r), (lm_f, total_f, packed_f, n_f) = losses["reference"], losses["fast"]
    assert not packed_r and packed_f and n_f < 0.8 * n_r  # the fast path packs: fewer positions, same tokens
    assert abs(lm_f - lm_r) < 1e-4 and abs(total_f - total_r) < 1e-4


def test_pretraining_takes_the_same_first_step_on_both_paths(tmp_path):
    from dataclasses import replace

    recipe = BaseRecipe(
        hidden_size=32,
        num_hidden_layers=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        intermediate_size=64,
        batch_size=16,
        max_steps=1,
        pool=64,
    )
    first = {
        k: pretrain(replace(recipe, kernels=k), tmp_path / k, progress=False, eval_per_domain=1)["final_loss"]
        for k in ("reference", "fast")
    }
    assert abs(first["fast"] - first["reference"]) < 1e-5


def test_fast_and_reference_paths_generate_the_same_tokens(two_paths):
    tokenizer, recipe, models, _ = two_paths
    params = recipe.domain_params()
    tasks = [t for d in DOMAINS for t in sample(d, 6, seed=1, split="heldout", **params.get(d, {}))]
    answers = {path: greedy_answers(model, tokenizer, tasks, batch_size=12) for path, model in models.items()}
    assert answers["fast"] == answers["reference"]
    assert len(set(answers["fast"])) > 1  # not one degenerate answer everywhere

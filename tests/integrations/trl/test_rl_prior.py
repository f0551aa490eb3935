"""RPB in GRPO on a tiny Qwen3-MoE: the training forward selects on z + beta * b with each prompt token's own
(sample, span) and the row's A prior on the completion (tests/hand_routing.py, the rule written out); the
rollouts stay bias-free; R2 replays the biased first forward; what cannot be labelled is refused."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rpb.anchors import AnchorConfig
from rpb.collect import collect
from rpb.data import load_labelled
from rpb.errors import ConfigError
from rpb.integrations.trl import GRPOTrainer, prepare_grpo
from rpb.models import load_tokenizer
from rpb.prior.artifact import load_artifact
from rpb.testing.data import conversations, write_jsonl
from tests.hand_routing import hand_select, token_bias
from tests.integrations.trl.test_grpo import full_forward_topk, grpo_args, reward

pytestmark = pytest.mark.usefixtures("one_thread")

BETA = 8.0
MAX_LEN = 192


@pytest.fixture(scope="module")
def rl_data(save_tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl-prior")
    model_dir = save_tiny("qwen3_moe")
    data = write_jsonl(conversations(8, seed=3), tmp / "prompts.jsonl")
    prior = tmp / "prior.safetensors"
    collect(str(model_dir), data, prior, top_k=2, max_seq_len=MAX_LEN, progress=False)
    return model_dir, data, prior


def rpb_trainer(rl_data, tmp_path, **overrides):
    model_dir, data, prior = rl_data
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    tok = load_tokenizer(str(model_dir))
    tok.padding_side = "left"
    handle, dataset = prepare_grpo(model, tok, str(data), AnchorConfig(method="rpb", beta=BETA), str(prior))
    args = grpo_args(tmp_path, **{"max_steps": 1, "learning_rate": 0.0, **overrides})
    return GRPOTrainer(model, reward, args, dataset, processing_class=tok, anchor=handle), handle, tok


def capture_training(trainer):
    """Per training forward: the micro-batch, and per MoE layer the router's logits and the experts it chose."""
    seen, logits, experts = [], {}, {}
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda batch: seen.append(prepare(batch)) or seen[-1]
    hooks = []

    def keep_logits(pos):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                logits.setdefault(pos, output[0].detach().clone())

        return hook

    def keep_experts(pos):
        def hook(module, args):
            if torch.is_grad_enabled():
                experts.setdefault(pos, args[1].detach().clone())

        return hook

    for pos, m in enumerate(trainer.replay.layers):
        exp = trainer.model.get_submodule(m.name.rpartition(".")[0] + ".experts")
        hooks.append(m.router.register_forward_hook(keep_logits(pos)))
        hooks.append(exp.register_forward_pre_hook(keep_experts(pos)))
    return seen, logits, experts, hooks


def engine_without_routes(prompts, trainer):
    """A rollout_func standing in for an engine that returns no routes (vLLM without route recording): TRL's own
    prompt tokens, four tokens sampled by the model itself, log-probabilities reported missing (None, as vLLM
    reports a NaN)."""
    prompt_ids = trainer._tokenize_prompts(prompts)[0]
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            seq = trainer.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=4,
                                         min_new_tokens=4, do_sample=True, pad_token_id=0)  # fmt: skip
        out["prompt_ids"].append(list(ids))
        out["completion_ids"].append(seq[0, len(ids) :].tolist())
        out["logprobs"].append([None] * 4)
    return out


@pytest.mark.parametrize("path", ["generate", "rollout_func", "continuous_batching"])
def test_the_training_forward_reads_each_tokens_row_and_span(path, rl_data, tmp_path):
    """On every generation path (rpb's recorded generate; an engine's rollout_func that returns no routes;
    transformers' paged continuous batching, which records none) the labels come from the tokens: an RPB run
    never trains without its bias."""
    # a paged cache sized for these few short rows: left to itself, transformers sizes it by the machine's memory
    # and zeroes gigabytes of static tensors first (24 s of this test's 30 on 2 cores)
    cb = {"num_blocks": 16, "max_batch_tokens": 256}
    paged = {"use_transformers_continuous_batching": True, "transformers_continuous_batching_config": cb}
    paged = paged if path == "continuous_batching" else {}
    trainer, handle, tok = rpb_trainer(rl_data, tmp_path, **paged)
    if path == "rollout_func":
        trainer.rollout_func = trainer._reading_routes(engine_without_routes)
    seen, logits, experts, hooks = capture_training(trainer)
    trainer.train()
    for h in hooks:
        h.remove()
    inputs = seen[0]
    assert "rpb_span_ids" in inputs and "rpb_sample_index" in inputs  # labelled, whatever path made the rollouts
    P = inputs["prompt_ids"].shape[1]
    mask_BS = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1).bool()
    # the rule, written from rpb's labelling of the file: the prompt's own labels, A on the completion
    examples = load_labelled(str(rl_data[1]), tok, MAX_LEN).examples
    span_BS = torch.full(mask_BS.shape, -1)
    for b, sample in enumerate(inputs["rpb_sample_index"].tolist()):
        p = int(inputs["prompt_mask"][b].sum())
        assert inputs["prompt_ids"][b, P - p :].tolist() == examples[sample].input_ids[:p]
        span_BS[b, P - p : P] = torch.tensor(examples[sample].span_ids[:p])
        span_BS[b, P : P + int(inputs["completion_mask"][b].sum())] = 1
    assert torch.equal(inputs["rpb_span_ids"], span_BS)
    assert (span_BS == 0).any() and (span_BS == 1).any()
    sample_T = torch.where(mask_BS, inputs["rpb_sample_index"][:, None], -1).reshape(-1)
    span_T = span_BS.reshape(-1)
    pi = load_artifact(str(rl_data[2])).prior_qa
    changed = 0
    for pos in range(len(trainer.replay.layers)):
        z_TE = logits[pos]
        want = hand_select(z_TE, token_bias(pi, pos, sample_T, span_T, BETA), 2)
        native = hand_select(z_TE, torch.zeros_like(z_TE), 2)
        got = [frozenset(r) for r in experts[pos].tolist()]
        for t in range(len(got)):
            if span_T[t] >= 0:
                assert got[t] == want[t], (pos, t)
                changed += got[t] != native[t]
            else:  # structural and padding tokens: the router's own choice
                assert got[t] == native[t], (pos, t)
    assert changed > 0, "beta 8 changed no selection: the check above showed nothing"
    if path != "generate":  # no routes on these paths: nothing to compare them with, and none made up
        assert "rpb_rollout_routes" not in inputs
        handle.remove()
        return
    # the rollouts were generated bias-free: their routes are the plain routers' own (learning rate 0)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    own = full_forward_topk(trainer.model, trainer.replay.layers, ids, mask_BS.long())
    routes = inputs["rpb_rollout_routes"]
    has = (routes >= 0).all(-1).all(-1)
    assert torch.equal(routes[has].sort(-1).values, own[has].sort(-1).values)
    handle.remove()


def test_r2_replays_the_biased_first_forward(rl_data, tmp_path):
    trainer, handle, _ = rpb_trainer(rl_data, tmp_path, replay="R2", num_iterations=2, max_steps=2)
    seen, _, _, hooks = capture_training(trainer)
    trainer.train()
    for h in hooks:
        h.remove()
    inputs = seen[0]
    first, rollout = inputs["rpb_first_routes"], inputs["rpb_rollout_routes"]
    has = (rollout >= 0).all(-1).all(-1) & (inputs["rpb_span_ids"] >= 0)
    # learning rate 0: rollout and first forward differ by the bias alone, which the first forward carries
    assert (first[has].sort(-1).values != rollout[has].sort(-1).values).any()
    handle.remove()


def test_a_prompt_rendered_otherwise_is_refused_naming_the_row(rl_data, tmp_path):
    trainer, handle, _ = rpb_trainer(rl_data, tmp_path)
    rows = trainer.train_dataset.to_list()
    for row in rows:
        row["rpb_input_ids"] = [*row["rpb_input_ids"][:3], row["rpb_input_ids"][3] + 1, *row["rpb_input_ids"][4:]]
    trainer.train_dataset = type(trainer.train_dataset).from_list(rows)
    with pytest.raises(ConfigError, match=r"rollout 0 \(row \d+\): TRL's prompt token 3"):
        trainer.train()
    handle.remove()


def test_a_row_not_ending_in_the_reference_answer_is_refused(rl_data, tmp_path):
    model_dir, data, _ = rl_data
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[2]["messages"].append({"role": "user", "content": "and then?"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = load_tokenizer(str(model_dir))
    with pytest.raises(ConfigError, match=r"bad.jsonl:3: \[messages\] the last message must be the assistant's"):
        prepare_grpo(model, tok, str(bad), AnchorConfig(method="sft"), max_seq_len=MAX_LEN)


def test_rpb_without_the_labelled_dataset_is_refused(rl_data, tmp_path):
    import datasets

    from rpb.anchors import install_anchor

    model_dir, _, prior = rl_data
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = load_tokenizer(str(model_dir))
    pi = load_artifact(str(prior)).prior_qa
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=BETA), prior=pi)
    plain = datasets.Dataset.from_list([{"prompt": "abc"}] * 4)
    with pytest.raises(ConfigError, match=r"build the dataset with rpb\.integrations\.trl\.prepare_grpo"):
        GRPOTrainer(model, reward, grpo_args(tmp_path), plain, processing_class=tok, anchor=handle)
    handle.remove()


def test_scoring_and_evaluation_stay_out_of_the_monitor_and_the_bias(rl_data, tmp_path):
    """Under RPB with R2 (TRL's old-log-prob forward and R2's own run inside the anchor's context): the monitor
    counts the training forwards' completion tokens alone; TRL scores the generation batch in chunks of the
    micro-batch size, the bias given chunk by chunk; evaluate() on a plain dataset (no rpb columns) routes freely:
    no replay, no bias, no error."""
    import datasets

    from rpb.monitor import attach_monitor

    trainer, handle, _ = rpb_trainer(rl_data, tmp_path, replay="R2", num_iterations=2, steps_per_generation=2,
                                     max_steps=2, logging_steps=100)  # fmt: skip
    callback = attach_monitor(trainer)
    seen, _, _, hooks = capture_training(trainer)
    forwards = []

    def before(module, args, kwargs):
        ids = kwargs["input_ids"]
        forwards.append([ids.shape[0], torch.is_grad_enabled(), "labels" in kwargs, None, None, module.training])

    def router(module, args, output):  # inside the forward: the contexts it runs under, and their size
        ctx = handle._context
        forwards[-1][3:5] = trainer.replay._active, None if ctx is None else ctx.num_tokens == output[0].shape[0]

    hooks.append(trainer.model.register_forward_pre_hook(before, with_kwargs=True))
    hooks.append(trainer.replay.layers[0].router.register_forward_hook(router))
    trainer.train()
    completion_tokens = sum(int(inputs["completion_mask"].sum()) for inputs in seen)
    window = callback.monitor.window.tokens
    assert window.tolist() == [float(completion_tokens)] * len(trainer.replay.layers)
    scoring = [f for f in forwards if f[2] and not f[1]]  # TRL's scoring forwards: labels, no gradients
    assert scoring and all(f[0] <= trainer.args.per_device_train_batch_size for f in scoring)
    assert all(f[4] for f in scoring)  # each chunk ran under the bias's context, made for its own rows
    rows = trainer.train_dataset.to_list()
    for eval_rows in (rows[:4], [{"prompt": r["prompt"]} for r in rows[:4]]):  # prepared, then plain
        forwards.clear()
        trainer.eval_dataset = datasets.Dataset.from_list(eval_rows)
        metrics = trainer.evaluate()
        assert "eval_loss" in metrics and forwards
        assert not any(f[3] or f[4] is not None for f in forwards)  # evaluation: no replay, no bias context
    for h in hooks:
        h.remove()
    handle.remove()


def test_the_reward_receives_each_rows_reference_answer_and_own_fields(rl_data, tmp_path):
    """TRL hands every column but the prompt to the reward functions: prepare_grpo keeps the row's reference
    answer (``reference_answer``) and its other fields, each with its own rollout's row."""
    model_dir, data, _ = rl_data
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    with_fields = tmp_path / "fields.jsonl"
    with_fields.write_text("".join(json.dumps({**r, "level": i % 3, "source": f"s{i}"}) + "\n" for i, r in
                                   enumerate(rows)))  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    tok = load_tokenizer(str(model_dir))
    tok.padding_side = "left"
    handle, dataset = prepare_grpo(model, tok, str(with_fields), AnchorConfig(method="sft"), max_seq_len=MAX_LEN)
    assert {"reference_answer", "level", "source"} <= set(dataset.column_names)
    assert dataset[2]["reference_answer"] == rows[2]["messages"][-1]["content"] and dataset[2]["level"] == 2
    received = []

    def reward_seeing(completions, **kwargs):
        received.extend(zip(kwargs["reference_answer"], kwargs["level"], kwargs["source"], kwargs["prompts"],
                            strict=True))  # fmt: skip
        return [0.0] * len(completions)

    trainer = GRPOTrainer(model, reward_seeing, grpo_args(tmp_path, max_steps=1), dataset, processing_class=tok,
                          anchor=handle)  # fmt: skip
    trainer.train()
    assert received
    for answer, level, source, prompt in received:
        i = int(source[1:])
        assert (answer, level, prompt) == (rows[i]["messages"][-1]["content"], i % 3, rows[i]["messages"][:-1])
    handle.remove()


def test_a_row_field_named_as_a_column_is_refused(rl_data, tmp_path):
    model_dir, data, _ = rl_data
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[1]["prompt"] = "mine"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: \[prompt\] a row's own field named as a column"):
        prepare_grpo(model, load_tokenizer(str(model_dir)), str(bad), AnchorConfig(method="sft"), max_seq_len=MAX_LEN)

"""The collected prior equals the mean, over exactly the Q and A tokens, of the transform of
the logits that each model's own router returns, for every supported family and both
transforms.

The reference side is independent of the collector: token ids are assembled piece by
piece from hand-written Moonlight markers (so the Q/A positions are known by
construction), each row runs alone and unpadded through the full causal LM, and the
router logits are captured by a forward hook on ``model.layers[i].mlp.gate`` (gpt-oss: ``mlp.router``).
"""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rpb.collect import collect
from rpb.testing.models import ARCHITECTURES
from tests.conftest import write_rows

SYSTEM = "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
TURN = {"user": "<|im_user|>user<|im_middle|>", "assistant": "<|im_assistant|>assistant<|im_middle|>"}
END = "<|im_end|>"
MARKERS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")

CONVERSATIONS = [
    [("user", "What is 17 + 25?"), ("assistant", "17 + 25 = 42.")],
    [("user", "Sort [3, 1, 2]."), ("assistant", "[1, 2, 3]"), ("user", "Now reverse it."), ("assistant", "[3, 2, 1]")],
    [("user", "Hi"), ("assistant", "Hello! How can I help you today?")],
    [("user", "Reverse the word 'router'."), ("assistant", "'retuor'")],
    [("user", "x"), ("assistant", "y")],
]
# model-layer indices of the MoE layers, from each config (first_k_dense_replace / mlp_only_layers)
EXPECTED_MOE_LAYERS = {
    "deepseek_v3": [1, 2],
    "deepseek_v2": [1, 2],
    "qwen3_moe": [1, 2],
    "glm4_moe": [1, 2],
    "kimi_k2": [1, 2],
}


def char_ids(tok, text):
    """Ids of ``text`` with the markers as single tokens and every other character alone."""
    ids, i = [], 0
    while i < len(text):
        marker = next((m for m in MARKERS if text.startswith(m, i)), None)
        piece = marker or text[i]
        ids.append(tok.convert_tokens_to_ids(piece))
        i += len(piece)
    return ids


def reference_tokens(tok, conversation):
    """Token ids and per-token span (0 Q, 1 A, -1 structural) assembled by hand."""
    ids, spans = char_ids(tok, SYSTEM), None
    spans = [-1] * len(ids)
    for role, content in conversation:
        for piece, span in ((TURN[role], -1), (content, 0 if role == "user" else 1), (END, -1)):
            piece_ids = char_ids(tok, piece)
            ids += piece_ids
            spans += [span] * len(piece_ids)
    return ids, spans


def router_probs_by_hand(logits, transform):
    z = logits.double()
    if transform == "softmax":
        e = torch.exp(z - z.max(dim=-1, keepdim=True).values)
        return e / e.sum(dim=-1, keepdim=True)
    s = 1 / (1 + torch.exp(-z))
    return s / s.sum(dim=-1, keepdim=True)


def expected_prior(model_dir, tok, transform):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    captured = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)  # gpt-oss: mlp.router
        if gate is not None and type(gate).__name__.endswith(("TopkRouter", "TopKRouter")):
            hooks.append(gate.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out[0])))
    rows = []
    with torch.no_grad():
        for conversation in CONVERSATIONS:
            ids, spans = reference_tokens(tok, conversation)
            captured.clear()
            model(input_ids=torch.tensor([ids]))
            spans = torch.tensor(spans)
            per_layer = []
            for i in sorted(captured):
                p = router_probs_by_hand(captured[i], transform)
                per_layer.append(torch.stack([p[spans == s].mean(dim=0) for s in (0, 1)]))
            rows.append(torch.stack(per_layer, dim=1))  # [2, L, E]
    for h in hooks:
        h.remove()
    return torch.stack(rows), sorted(captured)


@pytest.mark.parametrize("transform", ["softmax", "sigmoid-normalized"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_collected_prior_matches_router_logits(arch, transform, save_tiny, moon_tok, tmp_path):
    model_dir = save_tiny(arch)
    rows = [{"messages": [{"role": r, "content": c} for r, c in conv]} for conv in CONVERSATIONS]
    data = write_rows(tmp_path / "data.jsonl", rows)
    out = tmp_path / "prior.safetensors"
    top_k = ARCHITECTURES[arch][1]["num_experts_per_tok"]
    art = collect(
        str(model_dir),
        data,
        out,
        top_k=top_k,
        max_seq_len=512,
        router_transform=transform,
        batch_size=2,
        progress=False,
    )

    expected, moe_layers = expected_prior(model_dir, moon_tok, transform)
    model_type = ARCHITECTURES[arch][0]
    assert moe_layers == EXPECTED_MOE_LAYERS.get(model_type, [0, 1, 2])
    assert art.metadata["moe_layers"] == moe_layers
    on_disk = load_file(out)["prior_qa"]
    assert on_disk.shape == expected.shape == (len(CONVERSATIONS), 2, len(moe_layers), on_disk.shape[-1])
    torch.testing.assert_close(on_disk.double(), expected, atol=1e-5, rtol=0)
    counts = [[sum(len(c) for r, c in conv if r == role) for role in ("user", "assistant")] for conv in CONVERSATIONS]
    assert load_file(out)["span_tokens"].tolist() == counts

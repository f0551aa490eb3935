"""Training batches: labels on answers, per-token (sample, span) through padding and packing."""

import torch

from rpb.anchors import AnchorConfig, TokenContext, install_anchor
from rpb.data import Example
from rpb.data.batches import IGNORE_INDEX, AnchorCollator, ExampleDataset, token_keys
from rpb.prior import log_prior_bias
from rpb.testing.models import build_tiny_model

Q, A, S = 0, 1, -1
EXAMPLES = [
    Example(7, [10, 11, 12, 13, 14, 15, 16], [S, Q, Q, S, A, A, S]),
    Example(2, [20, 21, 22, 23, 24], [S, Q, S, A, S]),
    Example(5, [30, 31, 32, 33, 34, 35, 36, 37, 38], [S, Q, S, A, A, S, Q, S, A]),
]


def test_answer_labels_are_assistant_content_plus_turn_end():
    ds = ExampleDataset(EXAMPLES, "answer")
    X = IGNORE_INDEX
    assert ds[0]["labels"] == [X, X, X, X, 14, 15, 16]
    assert ds[1]["labels"] == [X, X, X, 23, 24]
    assert ds[2]["labels"] == [X, X, X, 33, 34, 35, X, X, 38]  # the last answer was truncated: no turn end
    assert ExampleDataset(EXAMPLES, "all")[1]["labels"] == [20, 21, 22, 23, 24]


def test_padding_carries_no_sample_and_no_span():
    batch = AnchorCollator(pad_id=0)([ExampleDataset(EXAMPLES)[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, 9)
    assert batch["rpb_sample_index"][1].tolist() == [2] * 5 + [-1] * 4
    assert batch["rpb_span"][1].tolist() == [S, Q, S, A, S] + [S] * 4
    assert batch["attention_mask"][1].tolist() == [1] * 5 + [0] * 4
    assert batch["labels"][1, 5:].tolist() == [IGNORE_INDEX] * 4


def test_packed_and_unpacked_batches_give_the_same_per_token_bias():
    features = [ExampleDataset(EXAMPLES)[i] for i in range(3)]
    plain = AnchorCollator(pad_id=0)(features)
    packed = AnchorCollator(pad_id=0, pack=True, max_len=12)(features)
    assert packed["input_ids"].shape[0] == 2  # 7 + 5 tokens in one row, 9 in the next
    assert packed["position_ids"][0].tolist() == list(range(7)) + list(range(5))
    assert "attention_mask" not in packed  # given a mask, transformers would let packed examples attend across
    assert token_keys(plain) == token_keys(packed)

    model = build_tiny_model("qwen3_moe", 64)
    pi = torch.softmax(torch.randn(8, 2, 2, 8), -1)
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=1.5), prior=pi)

    def per_token_bias(batch):
        ctx = TokenContext.from_batch(batch["rpb_sample_index"], batch["rpb_span"], batch.get("attention_mask"))
        tables = handle.prior.tables(ctx, torch.device("cpu"))
        bias_TLE = tables.bias_PLE[tables.pair_T] * tables.content_T[:, None, None]
        return bias_TLE[ctx.valid_T]

    got = per_token_bias(packed)
    torch.testing.assert_close(per_token_bias(plain), got, atol=0, rtol=0)
    # and it is beta * b[x, s] computed by hand for each token's own (sample, span)
    keys = token_keys(plain)
    expected = torch.stack([1.5 * log_prior_bias(pi[x, s]) if s >= 0 else torch.zeros(2, 8) for x, s in keys])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    handle.remove()


def test_padding_free_is_one_row_without_a_mask_and_no_label_crosses_examples():
    features = [ExampleDataset(EXAMPLES, "all")[i] for i in range(3)]
    batch = AnchorCollator(pad_id=0, padding_free=True)(features)
    assert "attention_mask" not in batch and batch["input_ids"].shape == (1, 21)
    assert batch["position_ids"][0].tolist() == list(range(7)) + list(range(5)) + list(range(9))
    assert token_keys(batch) == token_keys(AnchorCollator(pad_id=0)(features))
    # loss on every token: each example's first token would be predicted from the previous example's last
    X = IGNORE_INDEX
    assert batch["labels"][0].tolist() == [X, *range(11, 17), X, *range(21, 25), X, *range(31, 39)]
    packed = AnchorCollator(pad_id=0, pack=True, max_len=12)(features)
    assert packed["labels"][0].tolist() == [X, *range(11, 17), X, *range(21, 25)]

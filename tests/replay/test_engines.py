"""Engine routes into ``routes_SLK``: inputs built the way vLLM 0.34.0 and SGLang 0.5.23 build theirs (see the
module's docstring for where), compared with routes written out by hand, and every refusal."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from rpb.errors import ArgumentError
from rpb.replay.engines import SGLANG_FIELD, VLLM_FIELD, check_routes, routes_from_sglang, routes_from_vllm

# A DeepSeek-V3-like model: 4 decoder layers, the first dense (first_k_dense_replace = 1), 8 experts, top-2.
# A rollout of 4 tokens has 3 routed positions.
MODEL = {"moe_layers": [1, 2, 3], "top_k": 2, "num_experts": 8}
NUM_TOKENS = 4

#: routes over every decoder layer, as both engines lay them out: [position][decoder layer][k]; the dense layer 0
#: keeps the zeros its buffer was allocated with
ENGINE_ROWS = [
    [[0, 0], [3, 5], [7, 0], [1, 2]],
    [[0, 0], [6, 4], [2, 3], [5, 7]],
    [[0, 0], [1, 0], [4, 6], [3, 2]],
]
#: the same rollout's routes_SLK, written out: [position][MoE layer][k]
EXPECTED_SLK = [
    [[3, 5], [7, 0], [1, 2]],
    [[6, 4], [2, 3], [5, 7]],
    [[1, 0], [4, 6], [3, 2]],
]


def vllm_array(rows=ENGINE_ROWS, dtype=np.uint8) -> np.ndarray:
    """``CompletionOutput.routed_experts``: uint8 for at most 256 experts (routed_experts_capturer.py:84)."""
    return np.array(rows, dtype=dtype)


def vllm_server_string(array: np.ndarray) -> str:
    """The OpenAI server's field: ``numpy2base64`` (vllm/utils/serial_utils.py:67-71)."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def sglang_string(rows=ENGINE_ROWS) -> str:
    """``meta_info["routed_experts"]``: the int32 host tensor's raw bytes, base64 (detokenizer_manager.py:443)."""
    tensor = torch.tensor(rows, dtype=torch.int32)
    return base64.b64encode(tensor.numpy().tobytes()).decode("utf-8")


def sglang_decoded(text: str) -> np.ndarray:
    """SGLang's own ``extract_routed_experts_from_meta_info``: flat int32 (state_capturer/routed_experts.py:171)."""
    return np.frombuffer(base64.b64decode(text.encode("utf-8")), dtype=np.int32)


def expected() -> torch.Tensor:
    return torch.tensor(EXPECTED_SLK, dtype=torch.int64)


def from_vllm(value, **changes):
    kwargs = {**MODEL, "num_tokens": NUM_TOKENS, "name": "rollout 3", **changes}
    return routes_from_vllm(value, **kwargs)


def from_sglang(value, **changes):
    kwargs = {**MODEL, "num_tokens": NUM_TOKENS, "name": "rollout 3", **changes}
    return routes_from_sglang(value, **kwargs)


def refusal(call, *needles: str) -> str:
    """The refusal's message, checked to name the rollout and each needle."""
    with pytest.raises(ArgumentError) as caught:
        call()
    message = str(caught.value)
    assert "rollout 3" in message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# -- conversions -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [vllm_array(), vllm_array().tolist(), vllm_server_string(vllm_array())],
    ids=["numpy-uint8", "nested-list", "server-base64-npy"],
)
def test_vllm_drops_the_dense_layer(value):
    routes_SLK = from_vllm(value)
    assert routes_SLK.dtype == torch.int64
    assert torch.equal(routes_SLK, expected())


def test_vllm_uint16_above_256_experts():
    rows = [[[0, 0], [300, 5]], [[0, 0], [299, 256]]]
    routes_SLK = from_vllm(vllm_array(rows, np.uint16), num_tokens=3, moe_layers=[1], num_experts=301)
    assert torch.equal(routes_SLK, torch.tensor([[[300, 5]], [[299, 256]]]))


@pytest.mark.parametrize("decode", [False, True], ids=["meta-info-base64", "decoded-flat-int32"])
def test_sglang_drops_the_dense_layer(decode):
    text = sglang_string()
    routes_SLK = from_sglang(sglang_decoded(text) if decode else text)
    assert routes_SLK.dtype == torch.int64
    assert torch.equal(routes_SLK, expected())


def test_sglang_already_shaped():
    assert torch.equal(from_sglang(np.array(ENGINE_ROWS, dtype=np.int32)), expected())


def test_a_layer_axis_of_moe_layers_alone_is_taken_as_is():
    assert torch.equal(from_vllm(np.array(EXPECTED_SLK, dtype=np.uint8)), expected())
    assert torch.equal(from_sglang(sglang_string(EXPECTED_SLK)), expected())


def test_num_layers_when_the_last_layer_is_dense():
    # 4 decoder layers, MoE at 0 and 2; layers 1 and 3 dense (zeros)
    rows = [[[5, 1], [0, 0], [2, 7], [0, 0]], [[4, 6], [0, 0], [3, 0], [0, 0]]]
    want_SLK = torch.tensor([[[5, 1], [2, 7]], [[4, 6], [3, 0]]])
    got_vllm = from_vllm(vllm_array(rows), num_tokens=3, moe_layers=[0, 2], num_layers=4)
    got_sglang = from_sglang(sglang_string(rows), num_tokens=3, moe_layers=[0, 2], num_layers=4)
    assert torch.equal(got_vllm, want_SLK)
    assert torch.equal(got_sglang, want_SLK)
    # without num_layers the axis is read as 3 decoder layers or 2 MoE layers: neither fits
    refusal(lambda: from_vllm(vllm_array(rows), num_tokens=3, moe_layers=[0, 2]), "4 layers", VLLM_FIELD)
    refusal(lambda: from_sglang(sglang_string(rows), num_tokens=3, moe_layers=[0, 2]), "not a whole number")


def test_top_1_and_a_one_token_rollout():
    rows = [[[0], [6]], [[0], [2]]]
    assert torch.equal(from_vllm(vllm_array(rows), num_tokens=3, moe_layers=[1], top_k=1), torch.tensor([[[6]], [[2]]]))
    empty_SLK = from_sglang(sglang_string([]), num_tokens=1)
    assert empty_SLK.shape == (0, 3, 2)


# -- refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [ENGINE_ROWS + ENGINE_ROWS[:1], ENGINE_ROWS[:2]], ids=["one-more", "one-fewer"])
def test_a_route_count_other_than_tokens_less_one(rows):
    needles = (f"{len(rows)} routes for 4 tokens (expected 3", "prefix caching", "truncated")
    refusal(lambda: from_vllm(vllm_array(rows)), VLLM_FIELD, *needles)
    refusal(lambda: from_sglang(sglang_string(rows)), SGLANG_FIELD, *needles)


def test_a_layer_count_that_fits_neither_reading():
    rows = [[*r, [1, 2]] for r in ENGINE_ROWS]  # 5 layers
    refusal(lambda: from_vllm(vllm_array(rows)), VLLM_FIELD, "5 layers (expected 4 decoder layers, or the 3 MoE")


def test_a_top_k_that_does_not_fit():
    rows = [[[*ids, 0] for ids in r] for r in ENGINE_ROWS]
    refusal(lambda: from_vllm(vllm_array(rows)), VLLM_FIELD, "top-3 ids per layer (expected top-2)")


@pytest.mark.parametrize("bad, where", [(8, "8 at position 1, layer 2"), (-1, "-1 at position 1, layer 2")])
def test_an_expert_id_out_of_range(bad, where):
    rows = [[list(ids) for ids in r] for r in ENGINE_ROWS]
    rows[1][2] = [bad, 4]
    refusal(lambda: from_sglang(sglang_string(rows)), SGLANG_FIELD, "1 expert id(s) outside [0, 8)", where)
    if bad >= 0:
        refusal(lambda: from_vllm(vllm_array(rows)), VLLM_FIELD, "outside [0, 8)", where)


def test_a_dense_layer_listed_as_moe_repeats_ids():
    message = refusal(lambda: from_vllm(vllm_array(), moe_layers=[0, 1, 2, 3]), VLLM_FIELD, "3 row(s) repeating")
    assert "[0, 0] at position 0, layer 0" in message


def test_every_problem_of_a_rollout_at_once():
    rows = [[[*ids, 9] for ids in r] for r in ENGINE_ROWS[:2]]  # a row short, top-3, id 9 of 8
    message = refusal(lambda: from_vllm(vllm_array(rows)), VLLM_FIELD, "3 problem(s)")
    for needle in ("2 routes for 4 tokens", "top-3 ids per layer", "outside [0, 8)"):
        assert needle in message


@pytest.mark.parametrize(
    "value, needle",
    [
        (None, "enable_return_routed_experts off"),
        ("not base64!", "not base64"),
        (base64.b64encode(b"\x00\x01").decode(), "not a base64 .npy array"),
        (np.zeros((3, 4, 2), dtype=np.float32), "dtype float32, not integer"),
        ([[[1, 2]], [[1]]], "not a rectangular array"),
        (np.zeros((3, 8), dtype=np.uint8), "not [routes, layers, top_k]"),
        (vllm_server_string(np.array(["a"])), "dtype <U1, not integer"),
    ],
    ids=["none", "bad-base64", "not-npy", "float", "ragged", "2-d", "text-npy"],
)
def test_vllm_unreadable(value, needle):
    refusal(lambda: from_vllm(value), VLLM_FIELD, needle)


@pytest.mark.parametrize(
    "value, needle",
    [
        (None, "return_routed_experts off"),
        ("@@@@", "not base64"),
        (base64.b64encode(b"\x00" * 6).decode(), "holds 6 bytes, not whole int32 ids"),
        (sglang_decoded(sglang_string())[:-1], "holds 23 ids, not a whole number of rows of 4 layers x 2"),
    ],
    ids=["none", "bad-base64", "odd-bytes", "ragged-flat"],
)
def test_sglang_unreadable(value, needle):
    refusal(lambda: from_sglang(value), SGLANG_FIELD, needle)


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"moe_layers": [2, 1, 3]}, "not distinct non-negative indices in model order"),
        ({"moe_layers": []}, "moe_layers is empty"),
        ({"moe_layers": [1, 2, 3], "num_layers": 3}, "reach past the model's 3 decoder layers"),
        ({"top_k": 9}, "top_k 9 of num_experts 8"),
        ({"num_tokens": 0}, "num_tokens 0"),
    ],
)
def test_a_call_that_cannot_describe_the_model(changes, needle):
    refusal(lambda: from_vllm(vllm_array(), **changes), needle)


def test_check_routes_names_the_field_it_is_given():
    assert torch.equal(
        check_routes(np.array(ENGINE_ROWS), num_tokens=4, name="rollout 3", field="routes", **MODEL), expected()
    )
    call = lambda: check_routes(np.array(ENGINE_ROWS), num_tokens=5, name="rollout 3", field="my routes", **MODEL)  # noqa: E731
    refusal(call, "my routes", "3 routes for 5 tokens")


def test_fused_shared_expert_columns_after_the_top_k_are_dropped_when_given():
    """A build whose route buffer is top_k + num_fused_shared_experts wide (SGLang's device buffer): the extra
    column holds the shared expert's id (num_experts) or -1 (a capture of routed ids alone, padded)."""
    for fill in (8, -1):
        wide = np.concatenate([vllm_array(dtype=np.int32), np.full((3, 4, 1), fill, np.int32)], axis=-1)
        got = check_routes(wide, num_tokens=NUM_TOKENS, name="r", field="f", fused_shared_experts=1, **MODEL)
        assert got.tolist() == EXPECTED_SLK
        with pytest.raises(ArgumentError, match=r"top-3 ids per layer \(expected top-2\)"):  # not given: refused
            check_routes(wide, num_tokens=NUM_TOKENS, name="r", field="f", **MODEL)
    # a column holding a routed expert's id is no shared slot
    wide = np.concatenate([vllm_array(dtype=np.int32), np.full((3, 4, 1), 6, np.int32)], axis=-1)
    with pytest.raises(ArgumentError, match="hold routed experts' ids, not fused shared"):
        check_routes(wide, num_tokens=NUM_TOKENS, name="r", field="f", fused_shared_experts=1, **MODEL)
    with pytest.raises(ArgumentError, match=r"top-3 ids per layer \(expected top-2 \+ 2 fused shared\)"):
        check_routes(wide, num_tokens=NUM_TOKENS, name="r", field="f", fused_shared_experts=2, **MODEL)

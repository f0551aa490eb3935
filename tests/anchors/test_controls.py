"""The shuffled-prior controls' permutations and prior shuffle against hand-worked values."""

import itertools
from collections import Counter

import pytest
import torch

from rpb.anchors.controls import global_permutation, layer_permutations, shuffle_prior, within_community_permutation


def is_permutation(sigma_E):
    return sorted(sigma_E.tolist()) == list(range(sigma_E.numel()))


def test_within_community_permutation_properties():
    labels_E = torch.tensor([2, 0, 1, 0, 2, 2, 1, 0, 0, 2, 1, 3])
    sigma_E = within_community_permutation(labels_E, seed=11)
    assert is_permutation(sigma_E)
    assert torch.equal(labels_E[sigma_E], labels_E)
    assert sigma_E[11] == 11  # singleton community is a fixed point
    assert torch.equal(within_community_permutation(labels_E, seed=11), sigma_E)
    assert not torch.equal(within_community_permutation(labels_E, seed=12), sigma_E)


def test_within_community_permutation_is_uniform_inside_a_community():
    labels_E = torch.tensor([0, 1, 0, 1, 0])
    seen = Counter(tuple(within_community_permutation(labels_E, seed=s)[[0, 2, 4]].tolist()) for s in range(600))
    assert set(seen) == set(itertools.permutations([0, 2, 4]))
    assert all(60 < n < 140 for n in seen.values())  # 100 expected each


def test_global_permutation_properties():
    sigma_E = global_permutation(16, seed=5)
    assert is_permutation(sigma_E)
    assert torch.equal(global_permutation(16, seed=5), sigma_E)
    assert not torch.equal(global_permutation(16, seed=6), sigma_E)


def test_layer_permutations_within_and_global():
    labels_LE = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 0, 1, 0, 1, 0, 1], [0, 0, 1, 1, 0, 0, 1, 1]])
    sigma_LE = layer_permutations(labels_LE, 8, seed=4, mode="within")
    assert sigma_LE.shape == (3, 8)
    for labels_E, sigma_E in zip(labels_LE, sigma_LE, strict=True):
        assert is_permutation(sigma_E) and torch.equal(labels_E[sigma_E], labels_E)
    assert torch.equal(layer_permutations(labels_LE, 8, seed=4, mode="within"), sigma_LE)
    assert not torch.equal(layer_permutations(labels_LE, 8, seed=5, mode="within"), sigma_LE)
    # documented derivation: layer l draws from seed * 1_000_000 + l
    assert torch.equal(sigma_LE[2], within_community_permutation(labels_LE[2], 4_000_002))

    global_LE = layer_permutations(None, 8, seed=4, mode="global", num_layers=3)
    assert all(is_permutation(row) for row in global_LE)
    assert len({tuple(row.tolist()) for row in global_LE}) == 3  # layers get distinct streams
    assert torch.equal(global_LE[1], global_permutation(8, 4_000_001))
    assert torch.equal(layer_permutations(labels_LE, 8, seed=4, mode="global"), global_LE)


def test_layer_permutations_refuses_bad_arguments():
    with pytest.raises(ValueError, match="needs the base community labels"):
        layer_permutations(None, 8, seed=0, mode="within", num_layers=2)
    with pytest.raises(ValueError, match="unknown permutation mode"):
        layer_permutations(None, 8, seed=0, mode="local", num_layers=2)


def test_shuffle_prior_moves_mass_as_defined():
    # N = 1, S = 2, L = 2, E = 3
    pi_NSLE = torch.tensor([[[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]], [[0.2, 0.2, 0.6], [0.7, 0.2, 0.1]]]])
    sigma_LE = torch.tensor([[2, 0, 1], [0, 1, 2]])
    shuffled = shuffle_prior(pi_NSLE, sigma_LE)
    # layer 0: expert 0 -> 2, 1 -> 0, 2 -> 1, so pi' = (pi[1], pi[2], pi[0]); layer 1: identity
    expected = torch.tensor([[[[0.3, 0.2, 0.5], [0.1, 0.6, 0.3]], [[0.2, 0.6, 0.2], [0.7, 0.2, 0.1]]]])
    assert shuffled.shape == pi_NSLE.shape and shuffled.dtype == pi_NSLE.dtype
    assert torch.equal(shuffled, expected)
    assert torch.allclose(shuffled.sum(-1), pi_NSLE.sum(-1))
    assert shuffle_prior(pi_NSLE.double(), sigma_LE).dtype == torch.float64


def test_shuffle_prior_refuses_a_non_bijection():
    with pytest.raises(ValueError, match="permutation"):
        shuffle_prior(torch.rand(1, 2, 1, 3), torch.tensor([[0, 0, 1]]))


def test_transition_controls_permute_within_the_bases_transition_communities(save_tiny):
    """The within-transition controls' communities are the retention report's transition communities of
    the base on the same rows, and every permutation stays inside them."""
    from rpb.adapters import find_moe_layers, get_adapter
    from rpb.anchors.controls import base_transition_communities, layer_permutations
    from rpb.data import load_labelled
    from rpb.models import load_base_model, load_tokenizer
    from rpb.retention.communities import louvain
    from rpb.retention.run import collect_routing
    from rpb.testing.data import conversations, write_jsonl

    model_dir = save_tiny("qwen3_moe")
    data = write_jsonl(conversations(12, seed=2), model_dir.parent / "transitions.jsonl")
    tok = load_tokenizer(str(model_dir))
    examples = load_labelled(str(data), tok, 192).examples
    model, _ = load_base_model(str(model_dir), "float32", None, "cpu")
    layers = find_moe_layers(model, get_adapter(model.config.model_type))
    comm = base_transition_communities(model, layers, examples, seed=3, batch_size=5, pad_id=0)
    stats, _ = collect_routing([model], [layers], examples, 4, 0, progress=False, transitions=True)
    for pos in range(len(layers)):
        labels, _ = louvain(stats[0].transitions.graph(pos), seed=3, directed=True)
        assert torch.equal(comm.labels_LE[pos], labels)
    sigma = layer_permutations(comm.labels_LE, 8, seed=5, mode="within-transition")
    for pos in range(len(layers)):
        assert torch.equal(comm.labels_LE[pos][sigma[pos]], comm.labels_LE[pos])

"""Tiny, deterministic stand-ins for real checkpoints: MoE models of every supported family, replicas of
shipped checkpoints with their vendors' chat templates (``replica``), a Moonlight-style tokenizer and
synthetic conversations.

They are built locally from transformers configs and the ``tokenizers`` library, so the tests,
the benchmarks and the toy world never download anything, and once saved to a directory they go
through exactly the same ``from_pretrained`` loading path as real checkpoints.
"""

from rpb.testing.replicas import FAMILIES, REPLICAS, replica

__all__ = ["FAMILIES", "REPLICAS", "replica"]

"""Tiny, deterministic stand-ins for real checkpoints: tokenizers, MoE models and data.

They are built locally from transformers configs and the ``tokenizers`` library, so
the demo and the tests never download anything, and they go through exactly the same
``from_pretrained`` loading path as real checkpoints once saved to a directory.
"""

"""The paper's study in a box, small enough for a laptop CPU.

A synthetic world (``tasks``: four pretraining domains and two post-training sets of short,
exact-match question/answer pairs), a recipe for a tiny character-level MoE base model
pretrained on that world, and the experiment grid that post-trains it with each anchoring
method and measures in-domain gains, out-of-domain retention and routing retention.
"""

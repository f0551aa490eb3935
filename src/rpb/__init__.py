"""rpb: soft router anchoring for Mixture-of-Experts post-training.

Router Prior Bias (RPB) reads the frozen base model's routing over the training
conversations (the *prior*) and uses it to bias expert selection during
post-training, so that the inherited routing structure is held softly.
"""

__version__ = "0.1.0"

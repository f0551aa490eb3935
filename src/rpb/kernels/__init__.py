"""Faster kernels for the models rpb trains (importing this registers them with transformers)."""

from rpb.kernels.experts import NAME as SORTED_EXPERTS
from rpb.kernels.experts import TokenMask, registered, supports, token_mask

__all__ = ["SORTED_EXPERTS", "TokenMask", "registered", "supports", "token_mask"]

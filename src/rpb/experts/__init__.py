"""Expert selection from the task's routing (ESFT's gate and token measures), and training only those experts:
LoRA on the chosen experts of fused weights, or full fine-tuning of them alone (docs/experts.md)."""

from rpb.experts.choice import ExpertChoice, choose, gate_scores, read_choice, selection_ratio
from rpb.experts.masks import ExpertMask, mask_lora_to_experts, train_only_experts

__all__ = [
    "ExpertChoice",
    "ExpertMask",
    "choose",
    "gate_scores",
    "mask_lora_to_experts",
    "read_choice",
    "selection_ratio",
    "train_only_experts",
]

"""TRL's trainers with rpb: ``SFTTrainer`` with an anchor (``sft``), ``GRPOTrainer`` with the loss anchors and
routing replay (``grpo``). Install with ``pip install 'rpb[trl]'`` (torch pinned as a constraint, see the README)."""

from rpb.data.arrow import as_dataset
from rpb.integrations.trl.grpo import GRPOConfig, GRPOTrainer
from rpb.integrations.trl.rl_prior import prepare_grpo
from rpb.integrations.trl.sft import SFTConfig, SFTTrainer, prepare

__all__ = ["GRPOConfig", "GRPOTrainer", "SFTConfig", "SFTTrainer", "as_dataset", "prepare", "prepare_grpo"]

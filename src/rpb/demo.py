"""The embedded default run: a tiny Moonlight-shaped MoE, synthetic data, prior, validation.

Everything is built locally (no downloads) and saved to disk, so the collector loads
it through the same ``from_pretrained`` path as a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from rpb.collect import collect
from rpb.toy.data import conversations, write_jsonl
from rpb.toy.models import build_tiny_model
from rpb.toy.tokenizers import moonlight_tokenizer
from rpb.validate import validate_artifact

DEMO_MODEL = {"hidden_size": 64, "num_hidden_layers": 4, "n_routed_experts": 16, "num_experts_per_tok": 4}


def build_demo_base(out: Path, seed: int = 0) -> Path:
    """Save the tiny Moonlight-shaped base model and its tokenizer to ``out``."""
    tokenizer = moonlight_tokenizer()
    model = build_tiny_model("moonlight", vocab_size=len(tokenizer), seed=seed, **DEMO_MODEL)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run_demo(out_dir: str | Path = "rpb-demo", rows: int = 64, seed: int = 0, progress: bool = True) -> int:
    out = Path(out_dir)
    print(f"[1/3] building a tiny Moonlight-shaped MoE and tokenizer in {out / 'base'}")
    base = build_demo_base(out / "base", seed)
    data = write_jsonl(conversations(rows, seed), out / "data" / "train.jsonl")
    print(f"[2/3] collecting the routing prior over {rows} conversations ({data})")
    prior_path = out / "prior.safetensors"
    collect(
        str(base),
        data,
        prior_path,
        top_k=DEMO_MODEL["num_experts_per_tok"],
        max_seq_len=256,
        batch_size=16,
        progress=progress,
    )
    print(f"[3/3] validating {prior_path}")
    report = validate_artifact(prior_path, data_jsonl=data, expected_model=str(base))
    print(report.format())
    return 0 if report.ok else 1

"""GPU smoke test: the Moonlight recipe on Megatron-Bridge, scaled down to one GPU, with rpb and kl-to-base.

Prerequisites (rpb installs none of them): one CUDA GPU, a CUDA build of PyTorch, Transformer Engine,
and megatron-bridge of a tested line (0.3.1 or 0.6.2, docs/megatron.md), with rpb installed in that
environment (``pip install --no-deps /path/to/rpb`` and ``examples/moonlight/requirements-rpb.txt``).

    torchrun --nproc-per-node=1 examples/moonlight/smoke.py --work /tmp/rpb-smoke
    python examples/moonlight/smoke.py --work /tmp/rpb-smoke --dry-run   # CPU, no Bridge: CI runs this

1. A Moonlight-shaped model with the real routing settings (64 experts, top-6, sigmoid with the
   expert-correction bias, one group, 2 shared experts, scaling 2.446, first layer dense), scaled down
   to 4 layers of width 256, random weights, saved as an HF checkpoint with a character tokenizer;
   64 conversations; the prior over them (``rpb collect``).
2. The run's configuration: examples/moonlight/config.yaml with one GPU's parallelism, 10 steps,
   global batch 4, sequence length 256; validated as ``rpb megatron-check`` does.
   ``--dry-run`` stops here, after checking which prerequisites the machine lacks.
3. (GPU) The HF checkpoint in Megatron format (``AutoBridge.import_ckpt``) and Bridge's index files.
4. (GPU) For ``rpb`` and ``kl-to-base``: Bridge's ``finetune`` through rpb's glue with the scaled-down
   model's provider; at the first step, on every real router of the model, selection-only semantics
   are checked (the anchor changes which experts are chosen for some tokens; the chosen experts'
   weights are sigmoid(z) of the unbiased logits, normalised over the choice and scaled); after the
   run the routing figures Bridge logged to TensorBoard are printed.
The script exits non-zero on any failed check.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
METHODS = ("rpb", "kl-to-base")
MOONLIGHT_SCALED = {  # Moonlight-16B-A3B's config.json routing values; its sizes scaled down
    "n_routed_experts": 64, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "n_shared_experts": 2,
    "routed_scaling_factor": 2.446, "norm_topk_prob": True, "first_k_dense_replace": 1, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 4, "intermediate_size": 512, "moe_intermediate_size": 64, "kv_lora_rank": 64,
    "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
}  # fmt: skip
PREREQUISITES = {"CUDA": None, "transformer_engine": "Transformer Engine", "megatron.bridge": "megatron-bridge"}


def missing_prerequisites() -> list[str]:
    import torch

    out = [] if torch.cuda.is_available() else ["a CUDA GPU with a CUDA build of PyTorch"]
    out += [what for name, what in PREREQUISITES.items() if what and importlib.util.find_spec(name) is None]
    return out


def build_inputs(work: Path) -> tuple[Path, Path, Path]:
    """The scaled-down HF model and tokenizer, the data file and the prior (CPU)."""
    from rpb.collect import collect
    from rpb.testing.data import conversations, write_jsonl
    from rpb.testing.models import build_tiny_model
    from rpb.testing.tokenizers import moonlight_tokenizer

    hf, data, prior = work / "hf", work / "data" / "training.jsonl", work / "prior.safetensors"
    if not (hf / "config.json").is_file():
        tok = moonlight_tokenizer()
        build_tiny_model("moonlight", vocab_size=len(tok), seed=0, **MOONLIGHT_SCALED).save_pretrained(hf)
        tok.save_pretrained(hf)
    write_jsonl(conversations(64, seed=0), data)
    if not prior.is_file():
        collect(str(hf), data, prior, top_k=6, max_seq_len=256, progress=False)
    return hf, data, prior


def run_config(work: Path, hf: Path, prior: Path, method: str):
    from rpb.anchors import METHODS
    from rpb.integrations.megatron.config import load_megatron_config

    # the coefficient only for a method that reads one: a leftover is refused
    coefficient = {"lambda_": ["anchor.lambda=0.1"], "lbl_coef": ["anchor.lbl_coef=0.01"]}.get(
        METHODS[method].coefficient, []
    )
    overrides = [
        f"model.hf_id={hf}", f"model.pretrained_checkpoint={work / 'megatron'}", "model.trust_remote_code=false",
        "parallel.nodes=1", "parallel.gpus_per_node=1", "parallel.tensor=1", "parallel.expert=1",
        "parallel.sequence_parallel=false", "train.steps=10", "train.global_batch_size=4", "train.seq_length=256",
        "train.save_interval=10", f"train.output_dir={work / method}", f"data.root={work / 'data'}",
        "data.pad_to_multiple=8", f"prior={prior}", f"anchor.method={method}", *coefficient,
        "scheduler.lr_decay_iters=10", "scheduler.lr_warmup_iters=1",
    ]  # fmt: skip
    return load_megatron_config(HERE / "config.yaml", overrides)


def check_selection_only(handle, model) -> dict:
    """On every real router: a content micro-batch through the anchored router against the unbiased logits."""
    import torch

    from rpb.integrations.megatron.install import find_topk_routers

    report = {}
    for r in find_topk_routers(model):
        router = r.module
        hidden = router.weight.shape[1]
        gen = torch.Generator(device="cpu").manual_seed(r.pos)
        x = torch.randn(64, 1, hidden, generator=gen).to(router.weight.device, router.weight.dtype)
        handle.set_micro_batch(torch.zeros(1, 64, dtype=torch.long), torch.ones(1, 64, dtype=torch.long))
        router.train()
        with torch.no_grad():
            probs, routing_map = router(x)
            z = (x.reshape(-1, hidden).float() @ router.weight.float().T)
            bias = router.expert_bias.float() if getattr(router, "expert_bias", None) is not None else 0.0
            native = torch.zeros_like(routing_map).scatter_(1, (torch.sigmoid(z) + bias).topk(6, -1).indices, True)
        handle.clear()
        chosen_sig = torch.sigmoid(z) * routing_map
        gates = chosen_sig / chosen_sig.sum(-1, keepdim=True) * 2.446
        changed = float((routing_map != native).any(-1).float().mean())
        error = float((probs.float() - gates * routing_map).abs().max())
        report[r.name] = {"tokens_whose_choice_the_bias_changed": changed, "gate_error_vs_unbiased": error}
        if not routing_map.sum(-1).eq(6).all() or error > 2e-2:
            raise SystemExit(f"selection-only semantics fail on {r.name}: {report[r.name]}")
    if not any(v["tokens_whose_choice_the_bias_changed"] > 0 for v in report.values()):
        raise SystemExit(f"the bias changed no token's experts on any router: {report}")
    return report


def train(work: Path, hf: Path, prior: Path, method: str) -> None:
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.finetune import finetune

    from rpb.integrations.megatron import bridge

    cfg = run_config(work, hf, prior, method)
    prepared = bridge.prepare_data(cfg)
    provider = AutoBridge.from_hf_pretrained(str(hf)).to_megatron_provider(load_weights=False)
    container = bridge.build_container(cfg, model=provider)
    container.dataset = bridge.dataset_provider(cfg, prepared.data.examples, 0)

    class Smoke(bridge.AnchoredForwardStep):
        checked: dict | None = None

        def __call__(self, state, data_iterator, model, return_schedule_plan=False):
            if self.handle is None:
                self.handle = self.prepared.install(model, first_step=True)
                if method == "rpb":
                    Smoke.checked = check_selection_only(self.handle, model)
            return super().__call__(state, data_iterator, model, return_schedule_plan)

    step = Smoke(cfg, prepared)
    try:
        finetune(container, step)
    finally:
        if step.handle is not None:
            step.handle.remove()
    if Smoke.checked:
        print(json.dumps({"selection_only": Smoke.checked}, indent=1))
    print_figures(Path(cfg.train.output_dir) / "tensorboard", method)


def print_figures(logdir: Path, method: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith("moe/mean/") or "anchor loss" in t]
    if not tags:
        raise SystemExit(f"{method}: no routing figures in {logdir}")
    for tag in sorted(tags):
        print(f"{method} {tag}: " + " ".join(f"{e.value:.4g}" for e in acc.Scalars(tag)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, type=Path, help="a folder for the model, data, prior and runs")
    parser.add_argument("--dry-run", action="store_true", help="steps 1-2 on CPU and the prerequisites, then stop")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    hf, data, prior = build_inputs(args.work)
    for method in METHODS:
        cfg = run_config(args.work, hf, prior, method)
        print(f"{method}: configuration OK ({len(cfg.notes)} departures from the paper's setup, as expected)")
    missing = missing_prerequisites()
    if args.dry_run:
        print("prerequisites missing here: " + (", ".join(missing) or "none"))
        return 0
    if missing:
        print("cannot run: missing " + ", ".join(missing), file=sys.stderr)
        return 2
    from megatron.bridge import AutoBridge
    from megatron.bridge.data.datasets.utils import build_index_files

    if not (args.work / "megatron").is_dir():
        AutoBridge.import_ckpt(str(hf), str(args.work / "megatron"))
    build_index_files([str(data)], newline_int=10, workers=1)
    for method in METHODS:
        train(args.work, hf, prior, method)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU smoke test of training only the chosen experts on the Hugging Face path (``train.only_experts`` and
``lora.experts``), in the order ``rpb train`` runs it: the masks are installed while the model is on the CPU,
and the model moves to the GPU afterwards (the Trainer's ``model.to(device)``), in float32 and in bfloat16.

    python examples/hf/gpu_smoke.py                  # needs one CUDA GPU; exits 2 with a message without one
    python examples/hf/gpu_smoke.py --device cpu     # the same checks on the CPU (no device move)

For each tiny family (default: Moonlight-shaped DeepSeek-V3 with shared experts, gpt-oss with per-expert biases,
Qwen2-MoE with a shared-expert gate), each way (full fine-tuning, LoRA) and each dtype:

1. a seeded tiny model on the CPU; per MoE layer, two of the experts its router selects on the batch are chosen;
2. the masks installed on the CPU; the model moved to the device and dtype; two AdamW steps
   (learning rate 1e-2, weight decay 0.1: decay must stay off the unchosen experts too);
3. checked: every parameter slice of every unchosen expert (weights and biases) bit-identical; every chosen
   expert with a nonzero gradient in step 1 and moved (for LoRA: its merged weights).

The last line printed is one JSON object: ``{"ok": ..., "device": ..., "cases": [...]}``; the exit status is 0
when every case passed, 1 when one failed, 2 when the device is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

FAMILIES = ("moonlight", "gpt_oss", "qwen2_moe")
DTYPES = ("float32", "bfloat16")


def chosen_experts(model, facts, input_ids) -> dict[int, list[int]]:
    """Per MoE layer, the two lowest expert ids its router selects on ``input_ids`` (so each gets a gradient)."""
    import torch

    from rpb.adapters import find_moe_layers, router_output

    seen: dict[int, set] = {}
    layers = find_moe_layers(model, facts)
    hooks = [m.router.register_forward_hook(
        lambda mod, args, out, i=m.layer_index, m=m: seen.setdefault(i, set()).update(
            router_output(m, out)[2].flatten().tolist()))
        for m in layers]  # fmt: skip
    with torch.no_grad():
        model(input_ids=input_ids)
    for h in hooks:
        h.remove()
    return {i: sorted(ids)[:2] for i, ids in seen.items()}


def run_case(family: str, how: str, dtype: str, device: str) -> dict:
    import torch

    from rpb.adapters import get_adapter
    from rpb.experts import ExpertChoice, train_only_experts
    from rpb.experts.masks import check_choice, routed_expert_parameter
    from rpb.testing.models import build_tiny_model
    from rpb.train.lora import LoraSection, apply_lora

    model = build_tiny_model(family, vocab_size=64).train()
    facts = get_adapter(model.config.model_type)
    ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    choice = ExpertChoice(chosen_experts(model, facts, ids))
    num_experts = check_choice(model, choice, facts)
    mask = None
    if how == "full":
        mask = train_only_experts(model, choice, facts)  # on the CPU, as rpb train installs it
        run = model
    else:
        path = Path(tempfile.mkdtemp()) / "experts.json"
        path.write_text(choice.to_json())
        run = apply_lora(model, LoraSection(rank=4, attention=False, experts={"from": str(path)}), facts)
    run.to(device=device, dtype=getattr(torch, dtype))  # the Trainer's move: the parameters and their hooks stay
    routed = routed_expert_parameter(facts)
    before = {
        n.replace("base_layer.", ""): p.detach().to("cpu", copy=True)  # PEFT's wrappers: the merged names
        for n, p in model.named_parameters()
        if routed.search(n) and "lora_" not in n
    }
    optimizer = torch.optim.AdamW([p for p in run.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    if mask is not None:
        mask.restrict_decay(optimizer)
    ids = ids.to(device)
    grads = {}
    for step in range(2):
        optimizer.zero_grad()
        run(input_ids=ids, labels=ids).loss.backward()
        if step == 0:
            grads = {
                n.replace("base_layer.", ""): p.grad.detach().to("cpu", copy=True)
                for n, p in run.named_parameters()
                if p.grad is not None
            }
        optimizer.step()
    after_model = run.merge_and_unload() if how == "lora" else run
    after = {n: p.detach().to("cpu", copy=True) for n, p in after_model.named_parameters() if routed.search(n)}
    lora_targets = tuple(facts.expert_parameters)
    failures = []
    for name, old in before.items():
        layer = int(routed.search(name).group(1))
        keep = choice.mask(layer, num_experts)
        trained = how == "full" or name.endswith(lora_targets)
        for e in range(num_experts):
            same = torch.equal(old[e], after[name][e])
            if not keep[e] and not same:
                failures.append(f"{name}[{e}]: unchosen expert changed")
            elif keep[e] and trained and same:
                failures.append(f"{name}[{e}]: chosen expert did not move")
        if how == "full" and keep.any():
            g = grads.get(name)
            if g is None or any(not bool(g[e].abs().sum() > 0) for e in range(num_experts) if keep[e]):
                failures.append(f"{name}: a chosen expert had no gradient in step 1")
    return {"family": family, "how": how, "dtype": dtype, "ok": not failures, "failures": failures[:8]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), help=f"tiny families (default {FAMILIES})")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    args = parser.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device here (torch.cuda.is_available() is False); run it on a machine with a GPU "
              "and a CUDA build of PyTorch, or pass --device cpu for the CPU-side checks", file=sys.stderr)  # fmt: skip
        print(json.dumps({"ok": False, "device": args.device, "reason": "no CUDA device", "cases": []}))
        return 2
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    torch.manual_seed(0)
    cases = []
    for family in args.families:
        for how in ("full", "lora"):
            for dtype in args.dtypes:
                try:
                    cases.append(run_case(family, how, dtype, args.device))
                except Exception as e:  # a CUDA gradient times a CPU mask fails here: reported, not fatal
                    cases.append({"family": family, "how": how, "dtype": dtype, "ok": False,
                                  "failures": [f"{type(e).__name__}: {e}"[:300]]})  # fmt: skip
    for case in cases:
        status = "ok" if case["ok"] else "FAILED " + "; ".join(case["failures"])
        print(f"{case['family']:>10} {case['how']:>4} {case['dtype']:>8}: {status}")
    ok = all(c["ok"] for c in cases)
    print(json.dumps({"ok": ok, "device": name, "cases": cases}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

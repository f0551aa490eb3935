"""The check ``rpb train`` makes before its first step: how far its own bias moves the base's choice.

On a seeded sample of the training rows (the only rows with a prior), in eval mode, on the model as
loaded (the base), the counterfactual displacement at the run's own settings: the fraction of
content tokens whose selected expert set the installed anchor's ``prior_choice`` changes, layer by
layer, on the base's own logits. It is ``rpb calibrate``'s ``displacement_counterfactual`` at one
beta, measured by the very anchor that is about to train.
"""

from __future__ import annotations

import random

import torch

from rpb.anchors import AnchorHandle
from rpb.calibrate.measure import same_sets
from rpb.collect.collector import plan_batches
from rpb.data import Example, collate
from rpb.observe.trace import RouterTap, route_batch


def startup_displacement(
    handle: AnchorHandle, model, examples: list[Example], rows: int, seed: int, batch_size: int, pad_id: int
) -> list[float]:
    """Per MoE layer, the fraction of the sampled rows' content tokens the bias would move."""
    chosen = sorted(random.Random(seed).sample(range(len(examples)), min(rows, len(examples))))
    sample = [examples[i] for i in chosen]
    layers = [layer.moe for layer in handle.layers]
    changed, content = [0] * len(layers), [0] * len(layers)
    was_training = model.training
    model.eval()
    try:
        for positions in plan_batches([len(e) for e in sample], batch_size):
            batch = collate([sample[i] for i in positions], pad_id)
            mask_BT = batch["attention_mask"].bool()
            sample_BT = torch.where(mask_BT, batch["sample_index"][:, None], torch.tensor(-1))
            with RouterTap(layers) as tap:
                route_batch(model, batch)
            with handle.step(sample_BT, batch["span_ids"], batch["attention_mask"]) as ctx:
                for pos in range(len(layers)):
                    ids_TK, _ = handle.prior_choice(pos, tap.logits[pos], ctx)
                    keep = ctx.content_T.to(ids_TK.device)
                    changed[pos] += int((~same_sets(ids_TK, tap.topk_ids[pos]) & keep).sum())
                    content[pos] += int(keep.sum())
    finally:
        model.train(was_training)
    return [c / max(n, 1) for c, n in zip(changed, content, strict=True)]

"""The comparison anchors' terms written out from their definitions (docs/methods.md), in float64, for
tests to compare rpb's training wiring against; and a recorder of what a training run's routers saw.

One MoE layer's term, on the router input ``hidden_TH`` and weights ``weight_EH`` (softmax routers):
lbl = E * sum_e f_e P_e (transformers' form), kl-to-base = mean over valid tokens of
KL(p_base || p), logit-l2 = mean of ||(z - mean z) - (z_base - mean z_base)||^2, router-l2 =
||W - W_base||^2. The anchors average a term over MoE layers and multiply it by the coefficient.
Nothing here imports rpb.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _mean_valid(values_T: Tensor, valid_T: Tensor) -> Tensor:
    return values_T[valid_T].mean()


def lbl(hidden_TH: Tensor, weight_EH: Tensor, base_EH: Tensor, valid_T: Tensor, top_k: int) -> Tensor:
    probs_TE = torch.softmax(hidden_TH @ weight_EH.T, dim=-1)[valid_T]
    chosen_TE = torch.zeros_like(probs_TE).scatter_(1, probs_TE.topk(top_k, dim=-1).indices, 1.0)
    return probs_TE.shape[1] * (chosen_TE.mean(0) * probs_TE.mean(0)).sum()


def kl_to_base(hidden_TH: Tensor, weight_EH: Tensor, base_EH: Tensor, valid_T: Tensor, top_k: int) -> Tensor:
    log_p_TE = torch.log_softmax(hidden_TH @ weight_EH.T, dim=-1)
    log_base_TE = torch.log_softmax(hidden_TH @ base_EH.T, dim=-1)
    return _mean_valid((log_base_TE.exp() * (log_base_TE - log_p_TE)).sum(-1), valid_T)


def logit_l2(hidden_TH: Tensor, weight_EH: Tensor, base_EH: Tensor, valid_T: Tensor, top_k: int) -> Tensor:
    z_TE, base_TE = hidden_TH @ weight_EH.T, hidden_TH @ base_EH.T
    diff_TE = (z_TE - z_TE.mean(-1, keepdim=True)) - (base_TE - base_TE.mean(-1, keepdim=True))
    return _mean_valid(diff_TE.pow(2).sum(-1), valid_T)


def router_l2(hidden_TH: Tensor, weight_EH: Tensor, base_EH: Tensor, valid_T: Tensor, top_k: int) -> Tensor:
    return (weight_EH - base_EH).pow(2).sum()


TERMS = {"lbl": lbl, "kl-to-base": kl_to_base, "logit-l2": logit_l2, "router-l2": router_l2}


def term_gradient(method: str, hidden_TH, weight_EH, base_EH, valid_T, top_k: int) -> Tensor:
    """d term / d W for one layer, in float64."""
    w = weight_EH.double().clone().requires_grad_(True)
    value = TERMS[method](hidden_TH.double(), w, base_EH.double(), valid_T, top_k)
    (grad,) = torch.autograd.grad(value, w)
    return grad


class RouterRecorder:
    """Hooks on every router (``mlp.gate``) of a model: per training forward the router inputs, and per
    backward each router weight's gradient as accumulated so far (before any clipping); with
    ``every_parameter`` also the last accumulated gradient of every trainable parameter, by name."""

    def __init__(self, model: torch.nn.Module, every_parameter: bool = False):
        self.routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
        self.inputs: list[list[Tensor]] = [[] for _ in self.routers]
        self.grads: list[list[Tensor]] = [[] for _ in self.routers]
        self.last_grads: dict[str, Tensor] = {}
        self.hooks = []
        for pos, router in enumerate(self.routers):
            self.hooks.append(router.register_forward_hook(self._keep_input(pos)))
            self.hooks.append(router.weight.register_post_accumulate_grad_hook(self._keep_grad(pos)))
        if every_parameter:
            for name, p in model.named_parameters():
                if p.requires_grad:
                    self.hooks.append(p.register_post_accumulate_grad_hook(self._keep_last(name)))

    def _keep_last(self, name):
        def hook(p):
            self.last_grads[name] = p.grad.detach().clone()

        return hook

    def _keep_input(self, pos):
        def hook(module, args, output):
            if module.training and torch.is_grad_enabled():
                self.inputs[pos].append(args[0].detach().reshape(-1, args[0].shape[-1]).clone())

        return hook

    def _keep_grad(self, pos):
        return lambda weight: self.grads[pos].append(weight.grad.detach().clone())

    def remove(self):
        for h in self.hooks:
            h.remove()


def move_routers(model: torch.nn.Module, scale: float = 0.25) -> None:
    """Move every router off its weights by seeded noise (``scale`` x the weights' std). After an anchor has
    copied the base: at the base itself the distance terms and their gradients are 0."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.weight.add_(torch.randn(module.weight.shape, generator=gen) * scale * module.weight.std())


class Recorded:
    """What one training run's routers saw: inputs and gradients (``RouterRecorder``), their weights at the
    first step (float64), the batches as collated (the data loader collates one ahead), the output folder."""

    def __init__(self):
        self.rec: RouterRecorder | None = None
        self.start: list[Tensor] = []
        self.batches: list[dict] = []
        self.out = None

    def watch(self, model: torch.nn.Module, collate, every_parameter: bool = False):
        """Start recording ``model``; returns the collator to train with in place of ``collate``."""
        self.rec = RouterRecorder(model, every_parameter)
        self.start = [r.weight.detach().double().clone() for r in self.rec.routers]

        def keep(features):
            batch = collate(features)
            self.batches.append({k: v.clone() for k, v in batch.items()})
            return batch

        return keep


def check_term_in_gradient(method: str, run: Recorded, sft: Recorded, base_routers, coef: float, top_k: int) -> None:
    """Step 1 of two runs on the same seed: router gradient (anchored) - router gradient (sft) == the hand
    term's gradient, coefficient and mean over the MoE layers included. The last MoE router only: an earlier
    router's gates also move the later routers' inputs, so the later layers' terms reach it through the
    network. router-l2 reads the weights alone: every router."""
    num_layers = len(run.start)
    valid_T = run.batches[0]["attention_mask"].reshape(-1).bool()
    for pos in range(num_layers) if method == "router-l2" else [num_layers - 1]:
        assert torch.equal(run.rec.inputs[pos][0], sft.rec.inputs[pos][0])  # the same forward
        hand = coef / num_layers * term_gradient(method, run.rec.inputs[pos][0], run.start[pos],
                                                 base_routers[pos], valid_T, top_k)  # fmt: skip
        got = run.rec.grads[pos][0].double() - sft.rec.grads[pos][0].double()
        assert hand.abs().max() > 1e-3, "a vanishing hand gradient would tell nothing"
        assert (got - hand).abs().max() <= 1e-4 * hand.abs().max(), f"{method} router {pos}"

"""``rpb audit``: what a training set-up really does to the routers, found by running it.

Two optimizer steps on a few rows of the trainer's own data, through its own ``training_step`` (so its loss,
its anchor, TRL's auxiliary loss, PEFT's wrappers and any hook a user added all act) and an optimizer of its
own class and settings. Per MoE layer it reports:

* ``grad``: the norm of the gradient on the router's parameters (weight, bias, LoRA factors, a trainable copy)
  in step 2;
* ``moved``: the largest change of the router's *effective* logits (base plus any LoRA delta, or the copy that
  runs) on the hidden states it saw in step 1, after both steps;
* ``expert_bias``: the largest change of the expert-correction bias (families that have one);
* ``anchor_grad`` / ``aux_grad``: the router gradient of the anchor's loss term and of the model's native
  load-balancing loss, each found as the gradient with its coefficient minus the gradient with coefficient 0
  on the same batch, weights and random state;
* whether the anchor's term reaches the gradient at all is read from one more run of step 2 with its coefficient
  multiplied by ``REACH_SCALE``: a working term moves the gradient by that much more, a detached one by exactly
  nothing. Read at the run's own coefficient, a working ``kl-to-base`` one step from the base (at lambda 0.1 and
  a learning rate of 1e-6, a millionth of the LM gradient) could not be told from rounding;
* ``peft``: how PEFT wraps the router (LoRA on its weight by ``target_parameters``; a ``modules_to_save`` copy);
* ``biased``: the share of content tokens whose experts an rpb selection anchor changed.

The step-2 loss is split the same way (LM, anchor term, native auxiliary loss). ``Asked`` says what the set-up
means to do (router frozen or free, which anchor, whether a native auxiliary loss belongs): read from the model
as the user left it unless given (``rpb.monitor.asked``); every disagreement is a contradiction, and
``rpb audit`` exits 3 when there is one.

Nothing of the caller's is left changed: every parameter and buffer is put back bit for bit, the random state
too, and the trainer's state, optimizer, metrics and the anchor's counters are the audit's own copies. It runs
on the trainer's own model rather than a deep copy because hooks and callbacks users write close over their
model's modules: on a copy they would act on the original, so the audit would miss what they do and change
the user's model while it ran.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random

import torch

from rpb.adapters import MoELayer, RouterFacts, call_router, find_moe_layers, get_adapter, router_output
from rpb.adapters.hf import expert_bias_of
from rpb.errors import ArgumentError
from rpb.monitor.asked import asked_from_config, asked_from_model
from rpb.monitor.verdict import (
    FROZEN_ROUTERS_NOTE,
    Asked,
    AuditReport,
    LayerAudit,
    contradictions,
    frozen_without_hold,
    significant,
)
from rpb.observe.hooks import on_router_inputs

__all__ = ["AUX_COEFFICIENTS", "Asked", "AuditReport", "asked_from_config", "asked_from_model", "audit"]

#: attributes holding a native load-balancing coefficient (model heads, their configs, TRL's SFTTrainer)
AUX_COEFFICIENTS = ("router_aux_loss_coef",)
#: the anchor's coefficient is multiplied by this in the run that asks whether its term reaches the gradient
REACH_SCALE = 1e6


# ---- the run ----------------------------------------------------------------------------------------------


def audit(trainer, asked: Asked | None = None, rows: int = 4, adapter: str | None = None) -> AuditReport:
    """Two optimizer steps of ``trainer`` (an HF ``Trainer``, TRL's ``SFTTrainer``, rpb's ``AnchorTrainer``)
    on its first ``rows`` rows (rpb's ``GRPOTrainer``: one micro-batch of rollouts, generated once and trained
    on as it is); the caller's model, trainer and random state are left as they were. ``asked`` overrides what
    the model shows was asked (``asked_from_model``)."""
    model, handle = trainer.model, getattr(trainer, "anchor", None)
    facts = handle.facts if handle is not None else get_adapter(adapter or _unwrapped(model).config.model_type)
    layers = [lay.moe for lay in handle.layers] if handle is not None else find_moe_layers(model, facts)
    asked = asked or asked_from_model(model, layers, handle)
    with _left_as_found(trainer, model, handle) as run:
        batch = _first_batch(run, rows)
        run.create_optimizer()
        optimizer = run.optimizer
        inputs = _router_inputs(layers, lambda: run.training_step(model, dict(batch)))  # step 1's forward
        before = [_effective_logits(m, facts, h) for m, h in zip(layers, inputs, strict=True)]
        bias_before = [None if (b := expert_bias_of(m, facts)) is None else b.detach().float().clone() for m in layers]
        _step(run, model, optimizer)
        _zero(model)
        # step 2, four times on the same weights, buffers and random state: with and without each term. The
        # buffers and the routers' parameters are put back before each: a hook may move them in the forward
        found = {}
        rng = _rng_state()
        kept = [(t, t.detach().clone()) for _, t in model.named_buffers()]
        kept += [(p, p.detach().clone()) for m in layers for p in (m.wrapper or m.router).parameters()]
        scaled = handle is not None and handle.method.loss is not None and handle.method.coefficient is not None
        runs = ((False, False, 1.0), (True, False, 1.0), (False, True, 1.0))
        runs += ((True, True, REACH_SCALE),) if scaled else ()
        for anchor_on, aux_on, scale in (*runs, (True, True, 1.0)):  # the full step last: its gradients are kept
            _set_rng_state(rng)
            with torch.no_grad():
                for t, value in kept:
                    t.copy_(value)
            with _coefficients(run, model, handle, anchor_on, aux_on, scale):
                loss = float(run.training_step(model, dict(batch)))
            found[anchor_on, aux_on, scale] = (loss, _router_grads(layers), _projection(model))
            if not (anchor_on and aux_on and scale == 1.0):
                _zero(model)
        stats = handle.reset_stats() if handle is not None else {}
        _step(run, model, optimizer)  # with the full step's gradients, the last computed
        moved = [
            float((_effective_logits(m, facts, h) - b).abs().max())
            for m, h, b in zip(layers, inputs, before, strict=True)
        ]
        bias_moved = [
            None if b is None else float((expert_bias_of(m, facts).float() - b).abs().max())
            for m, b in zip(layers, bias_before, strict=True)
        ]
    return _report(asked, layers, handle, found, moved, bias_moved, stats)


def _report(asked, layers, handle, found, moved, bias_moved, stats) -> AuditReport:
    (lm, g_lm, _), (no_anchor, g_no_anchor, p_no_anchor), (no_aux, g_no_aux, _), (full, g_full, p_full) = (
        found[False, False, 1.0],
        found[False, True, 1.0],
        found[True, False, 1.0],
        found[True, True, 1.0],
    )
    _, g_scaled, p_scaled = found.get((True, True, REACH_SCALE), found[True, True, 1.0])
    method = handle.method if handle is not None else None
    has_term = method is not None and method.loss is not None
    out = []
    for pos, m in enumerate(layers):
        s = stats.get(pos)
        out.append(
            LayerAudit(
                layer=m.layer_index,
                grad=float(g_full[pos].norm()),
                moved=moved[pos],
                expert_bias=bias_moved[pos],
                anchor_grad=float((g_full[pos] - g_no_anchor[pos]).norm()) if has_term else None,
                aux_grad=float((g_full[pos] - g_no_aux[pos]).norm()),
                peft=_peft_kind(m),
                biased=(s.changed / s.content if s.content else 0.0) if method and method.selection and s else None,
                seen_by_anchor=None if handle is None else bool(s and s.tokens),
            )
        )
    loss = {"lm": lm, "anchor": full - no_anchor, "native_aux": full - no_aux}
    # the scaled run: a term that reaches the gradient moves it REACH_SCALE times as far; a detached one, not at all
    reaches = significant(p_scaled - p_no_anchor, p_full) if has_term else None
    lm_grads = [float(g.norm()) for g in g_lm]
    reach_L = [significant(float((s - n).norm()), g) for s, n, g in zip(g_scaled, g_no_anchor, lm_grads, strict=True)]
    report = AuditReport(asked, out, loss, reaches)
    report.contradictions = contradictions(report, handle is not None, lm_grads, reach_L if has_term else None)
    if frozen_without_hold(asked.router == "frozen", asked.anchor):
        report.notes.append(FROZEN_ROUTERS_NOTE)
    return report


# ---- pieces -----------------------------------------------------------------------------------------------


def _unwrapped(model):
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def _first_batch(trainer, rows: int) -> dict:
    if callable(getattr(trainer, "prepared_rollouts", None)):  # an RL trainer: rollouts made once, then trained on
        return trainer.prepared_rollouts()
    data = trainer.train_dataset
    if data is None:
        raise ArgumentError("the trainer has no train_dataset to audit with")
    if isinstance(data, torch.utils.data.IterableDataset):
        features = [row for _, row in zip(range(rows), data, strict=False)]
    else:
        features = [data[i] for i in range(min(rows, len(data)))]
    return trainer.data_collator(features)


@contextlib.contextmanager
def _left_as_found(trainer, model, handle):
    """A shallow copy of ``trainer`` with its own state, optimizer and counters; on exit every tensor of
    ``model``, the random state, the model's training flags and the anchor's counters are put back."""
    saved = {n: t.detach().to("cpu", copy=True) for n, t in _tensors(model)}
    rng, training = _rng_state(), {m: m.training for m in model.modules()}
    anchor = (handle.stats, handle.record_stats) if handle is not None else None
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    run = copy.copy(trainer)
    run.optimizer, run.lr_scheduler = None, None
    run.state = copy.deepcopy(trainer.state)
    run.current_gradient_accumulation_steps = 1
    for name in ("_metrics", "_anchor_terms", "_total_train_tokens"):  # TRL's metrics, rpb's term log
        if name in vars(trainer):
            setattr(run, name, copy.deepcopy(getattr(trainer, name)))
    if handle is not None:
        handle.stats, handle.record_stats = {}, True
    torch.use_deterministic_algorithms(True, warn_only=True)  # reruns of one step must give one gradient
    try:
        yield run
    finally:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        with torch.no_grad():
            for n, t in _tensors(model):
                t.copy_(saved[n])
                if isinstance(t, torch.nn.Parameter):
                    t.grad = None
        for m, flag in training.items():
            m.train(flag)
        _set_rng_state(rng)
        if anchor is not None:
            handle.stats, handle.record_stats = anchor


def _tensors(model):
    yield from model.named_parameters(remove_duplicate=True)
    yield from model.named_buffers(remove_duplicate=True)


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    numpy_state = None
    with contextlib.suppress(ImportError):
        import numpy

        numpy_state = numpy.random.get_state()
    return torch.get_rng_state(), cuda, random.getstate(), numpy_state


def _set_rng_state(state: tuple) -> None:
    cpu, cuda, py, np_state = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    if np_state is not None:
        import numpy

        numpy.random.set_state(np_state)


@contextlib.contextmanager
def _coefficients(run, model, handle, anchor_on: bool, aux_on: bool, scale: float = 1.0):
    """The anchor's coefficient and every native load-balancing coefficient set to 0 where switched off; the
    anchor's multiplied by ``scale`` where on."""
    restore = []
    if not aux_on:
        holders = [run, *model.modules()]
        holders += [c for m in model.modules() if (c := getattr(m, "config", None)) is not None]
        holders += [c.get_text_config() for c in list(holders) if hasattr(c, "get_text_config")]
        for obj in {id(o): o for o in holders}.values():
            for name in AUX_COEFFICIENTS:
                value = vars(obj).get(name) if hasattr(obj, "__dict__") else None
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    restore.append((obj, name, value))
                    setattr(obj, name, 0.0)
    if (not anchor_on or scale != 1.0) and handle is not None and handle.method.coefficient is not None:
        config, name = handle.config, handle.method.coefficient
        value = getattr(config, name) * scale if anchor_on else 0.0
        handle.config = dataclasses.replace(config, **{name: value})
        restore.append((handle, "config", config))
    try:
        yield
    finally:
        for obj, name, value in reversed(restore):
            setattr(obj, name, value)


def _router_inputs(layers: list[MoELayer], forward_backward) -> list[torch.Tensor]:
    """Run ``forward_backward`` and return the hidden states each router received (its first call)."""
    seen: dict[int, torch.Tensor] = {}

    def keep(pos: int, hidden: torch.Tensor) -> None:
        seen.setdefault(pos, hidden.detach().reshape(-1, hidden.shape[-1]).clone())

    with on_router_inputs(layers, keep):
        forward_backward()
    missing = [m.name for pos, m in enumerate(layers) if pos not in seen]
    if missing:
        raise RuntimeError(f"the training step never ran the routers {missing}: the trainer's model does not use them")
    return [seen[pos] for pos in range(len(layers))]


@torch.no_grad()
def _effective_logits(layer: MoELayer, facts: RouterFacts, hidden_TH: torch.Tensor) -> torch.Tensor:
    """The logits of the router that runs (PEFT's LoRA delta or copy included), in eval mode, called as its
    family's MoE block calls it."""
    module = layer.wrapper or layer.router
    flags = {m: m.training for m in module.modules()}
    module.eval()
    try:
        logits = router_output(layer, call_router(layer, facts, hidden_TH, module))[0]
    finally:
        for m, flag in flags.items():
            m.train(flag)
    return logits.float().reshape(hidden_TH.shape[0], -1)


def _router_grads(layers: list[MoELayer]) -> list[torch.Tensor]:
    """Each router's gradient, its parameters' gradients flattened and joined (zeros where none came)."""
    out = []
    for m in layers:
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().reshape(-1).cpu()
            for p in (m.wrapper or m.router).parameters()
            if p.requires_grad
        ]
        out.append(torch.cat(parts) if parts else torch.zeros(1))
    return out


def _projection(model) -> float:
    """The whole gradient projected on a fixed random direction: equal for two gradients only when they are
    (almost surely), at the memory of one parameter at a time."""
    total = 0.0
    for i, p in enumerate(x for x in model.parameters() if x.requires_grad):
        if p.grad is None:
            continue
        gen = torch.Generator(device=p.device).manual_seed(i)
        direction = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        total += float((p.grad.float() * direction).double().sum())
    return total


def _step(run, model, optimizer) -> None:
    """The optimizer step as the Trainer takes it: the gradient clipped to ``max_grad_norm`` first."""
    if run.args.max_grad_norm:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], run.args.max_grad_norm)
    optimizer.step()


def _zero(model) -> None:
    for p in model.parameters():
        p.grad = None


def _peft_kind(layer: MoELayer) -> str | None:
    """How PEFT wraps this router (None: it does not)."""
    wrapper = layer.wrapper
    if wrapper is None:
        return None
    kinds = []
    for m in wrapper.modules():
        if type(m).__name__ == "ParamWrapper" or (hasattr(m, "lora_A") and hasattr(m, "parameter_name")):
            kinds.append("LoRA on its weight (target_parameters)")
        elif isinstance(getattr(m, "modules_to_save", None), torch.nn.ModuleDict):
            kinds.append("a trained copy (modules_to_save)")
        elif hasattr(m, "lora_A"):
            kinds.append("LoRA (target_modules)")
    return ", ".join(dict.fromkeys(kinds)) or type(wrapper).__name__

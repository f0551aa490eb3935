"""One generation batch of rpb's ``GRPOTrainer``, from TRL's ``_generate_and_score_completions`` call to the batch
dict it returns: each rollout's tokens, routes, log-probabilities and (for RPB) labels, placed by token.

Shape legend: B = rollouts, N = one rollout's tokens (prompt and completion, no padding), P = a generation call's
padded prompt length, S = its forwarded positions, L = MoE layers, K = top-k.

**Life cycle** (one object per generation batch, training only; evaluation makes none, so it routes freely):

1. ``GenerationState(rows)`` when TRL starts a generation batch (its dataset rows, one per rollout);
2. ``add_turn`` after every ``generate`` call TRL makes: the first call's rows are the rollouts; a later call
   (TRL's tool loop, which generates again for the rows that called a tool, their prompt being the rollout so
   far plus the tool's result) is matched to its rollouts by their tokens, in order. A token keeps the route of
   the first forward that saw it, as an engine with prefix caching returns it; tool-result tokens keep the route
   of the prefill that forwarded them;
3. ``close`` once TRL has each rollout's final tokens (``_generate``'s return, on every generation path): the
   routes of every token but the last, the log-probability of every completion token (NaN where there is none:
   a tool's tokens, an engine's missing value), and RPB's labels from the tokens themselves;
4. the scoring forward leaves ``first_routes`` (the first training-side forward's own routing);
5. the trainer copies what it needs into TRL's batch dict, and the object is dropped.

A turn whose routes cannot be placed leaves ``problem`` (why, and the setting behind it); routes are then absent
from the whole batch, never placed at a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RolloutRecord:
    """One rollout as its generation calls left it."""

    #: its tokens so far: prompt, completion (tool results inside)
    tokens: list[int]
    #: the routes of its first ``routed`` tokens, as pieces in token order ([n, L, K] each)
    pieces: list[torch.Tensor] = field(default_factory=list)
    routed: int = 0
    #: the log-probabilities its generated tokens were drawn with: (first token index, values [n]) per call
    logps: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass
class GenerationState:
    """What one generation batch carries (see the module docstring for its life cycle)."""

    #: the generation batch's dataset rows, one per rollout
    rows: list
    rollouts: list[RolloutRecord] | None = None
    #: why the routes cannot be placed (None: they can, or none were recorded)
    problem: str | None = None
    #: after ``close``: each rollout's ``routes_NLK`` (N - 1 rows), or None when none were recorded
    routes: list[torch.Tensor] | None = None
    #: after ``close``: each rollout's completion log-probabilities (NaN where missing)
    logps: list[torch.Tensor] | None = None
    #: after ``close``, for a prior-reading anchor: per rollout (sample, prompt spans, completion spans)
    labels: list | None = None
    #: routing-kd with ``beta > 0``: the reference forward's router logits at the completion positions ``[B, C, L, E]``
    base_routing: torch.Tensor | None = None
    #: inside TRL's scoring (generation and the old-log-prob forward)
    scoring: bool = True
    #: the first training-side forward's own routing [B, S, L, K], once it ran
    first_routes: torch.Tensor | None = None
    #: PR2: what its first forward left for TRL's batch dict (``rpb.integrations.trl.predictive``'s keys)
    pr2: dict | None = None
    #: the rollouts came from a rollout_func (an engine), with or without its routes
    from_engine: bool = False

    # ---- 2. each generate call ------------------------------------------------------------
    def add_turn(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        routes_BSLK: torch.Tensor,
        logps_BC: torch.Tensor,
        P: int,
    ) -> None:
        """One ``generate`` call's routes (``routes_BSLK``: positions ``0 .. P + C - 2`` of its padded layout) and
        log-probabilities of its generated tokens (``logps_BC``), onto the rollouts its rows continue."""
        if self.problem is not None:
            return
        generated = routes_BSLK.shape[1] + 1 - P
        if any(len(c) > generated for c in completion_ids):
            self.problem = f"a completion longer than the {generated} positions generation forwarded"
            return
        targets = self._rollouts_of(prompt_ids)
        if targets is None:
            return
        for j, i in enumerate(targets):
            p, c = prompt_ids[j], completion_ids[j]
            record, tokens = self.rollouts[i], [*p, *c]
            start = P - len(p)  # where token 0 sits in this call's left-padded layout
            if len(tokens) - 1 > record.routed:
                record.pieces.append(routes_BSLK[j, start + record.routed : start + len(tokens) - 1].clone())
                record.routed = len(tokens) - 1
            record.tokens = tokens
            record.logps.append((len(p), logps_BC[j, : len(c)].clone()))

    def _rollouts_of(self, prompt_ids: list[list[int]]) -> list[int] | None:
        """The rollout each row of a generate call continues: the first call's rows are the rollouts; a later
        call's row j continues the first rollout after row j - 1's whose tokens begin its prompt (TRL's tool loop
        keeps the rollouts' order)."""
        if self.rollouts is None:
            self.rollouts = [RolloutRecord(tokens=list(p)) for p in prompt_ids]
            return list(range(len(prompt_ids)))
        targets, i = [], 0
        for j, p in enumerate(prompt_ids):
            while i < len(self.rollouts) and p[: len(self.rollouts[i].tokens)] != self.rollouts[i].tokens:
                i += 1
            if i == len(self.rollouts):
                self.problem = (
                    f"row {j} of a later generation call continues no rollout of the batch (its prompt does not "
                    "begin with any rollout's tokens)"
                )
                return None
            targets.append(i)
            i += 1
        return targets

    # ---- 3. the final tokens ------------------------------------------------------------------
    def close(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> None:
        """Each rollout's routes and completion log-probabilities for its final tokens (``prompt_ids[i] +
        completion_ids[i]``, as TRL hands them on after truncation)."""
        if self.problem is not None or self.rollouts is None:
            return
        if len(self.rollouts) != len(prompt_ids):
            self.problem = f"{len(self.rollouts)} rollouts recorded for a batch of {len(prompt_ids)}"
            return
        routes, logps, problems = [], [], []
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
            record, final = self.rollouts[i], [*p, *c]
            if record.tokens[: len(final)] != final:
                problems.append(f"rollout {i}: its final tokens are not the ones generation forwarded")
            elif record.routed < len(final) - 1:
                problems.append(
                    f"rollout {i}: {record.routed} of its {len(final)} tokens were forwarded in generation (every "
                    "token but the last needs a route)"
                )
            else:
                routes.append(torch.cat(record.pieces, dim=0)[: len(final) - 1])
                values_C = torch.full((len(c),), float("nan"))  # a tool's tokens were drawn by no one
                for start, drawn in record.logps:
                    at = start - len(p)
                    values_C[at : at + len(drawn)] = drawn[: max(0, len(c) - at)]
                logps.append(values_C)
        if problems:
            self.problem = "; ".join(problems)
            return
        self.routes, self.logps = routes, logps

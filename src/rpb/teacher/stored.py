"""``anchor.base: routes``: the base's routing read from a route file made for exactly the training file.

Shape legend: N = rows of the data file, R = every row's tokens back to back, L = MoE layers, K = top-k,
J = the experts stored after the top-k (a version-2 file's ``--top-m`` minus K), B = rows of a batch, S = its
positions, T = ``B * S``.

The route file (``rpb.replay.routefile``) comes from ``rpb routes`` (an HF forward of the base; with
``--with-probs`` the router probabilities at the stored experts too) or from an engine (ids alone, as
``rpb collect --from-routes`` reads them). Everything is checked before the first step, every problem named at
once (``rpb.collect.from_routes``'s checks): the row count, the router fingerprint and the data hash against the
run's, each row's tokens against the training labelling (the first differing row and position), each row's route
count and expert ids against the model. The routes of every row are then held back to back, MoE layers only, and a
step's are gathered by each token's (row, position in its row): ``sample_BT`` says the row, and the position is
counted from where the row starts in the batch's line, so right-padded and packed batches read alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from rpb.collect.from_routes import mismatch, row_routes
from rpb.data import LabelledData
from rpb.losses import ROUTES_LOSSES_WITH_PROBS, routes_loss_form
from rpb.replay.routefile import RouteFile, load_routes
from rpb.teacher.routing import BaseRouting

logger = logging.getLogger("rpb.teacher")


@dataclass
class StoredRoutes:
    """Every row's base routes, back to back: ``ids_RLK`` (int16), ``probs_RLK`` (float32 or None), ``offsets_N``
    (row i's first token); ``describe()`` is what the run records."""

    ids_RLK: torch.Tensor
    probs_RLK: torch.Tensor | None
    offsets_N: torch.Tensor
    path: str
    engine: str | None
    #: the term's form the run uses (``anchor.routes_loss``, or the default for this file)
    routes_loss: str = "hinge"
    #: the next experts by probability after the top-k, and their probabilities (None: the top-k alone)
    extra_ids_RLJ: torch.Tensor | None = None
    extra_probs_RLJ: torch.Tensor | None = None

    @property
    def top_m(self) -> int:
        return int(self.ids_RLK.shape[-1]) + (0 if self.extra_ids_RLJ is None else int(self.extra_ids_RLJ.shape[-1]))

    def describe(self) -> dict:
        return {
            "source": "routes",
            "routes_file": self.path,
            "engine": self.engine,
            "with_probs": self.probs_RLK is not None,
            "routes_loss": self.routes_loss,
            "top_m": self.top_m,
            "bytes": sum(t.numel() * t.element_size() for t in self._tensors() if t is not None),
        }

    def _tensors(self):
        return (self.ids_RLK, self.probs_RLK, self.extra_ids_RLJ, self.extra_probs_RLJ)

    def step(self, sample_BT: torch.Tensor) -> BaseRouting:
        """The base's routes for a batch's tokens (padding tokens read row 0's first route: the anchor skips them)."""
        at_T = self.token_index(sample_BT.cpu()).reshape(-1)
        ids_LTK = self.ids_RLK[at_T].long().transpose(0, 1)
        device = sample_BT.device
        probs_LTK = None if self.probs_RLK is None else self.probs_RLK[at_T].transpose(0, 1)
        base = BaseRouting(ids_LTK=ids_LTK.to(device), probs_LTK=_to(probs_LTK, device))
        if self.extra_ids_RLJ is not None:
            base.extra_ids_LTJ = self.extra_ids_RLJ[at_T].long().transpose(0, 1).to(device)
            base.extra_probs_LTJ = self.extra_probs_RLJ[at_T].transpose(0, 1).to(device)
        return base

    def routes_BSLK(self, sample_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base's top-k ids (and probabilities, or None) of a ``[B, S]`` batch's tokens, ``[B, S, L, K]``: what
        the Megatron path's ``set_micro_batch`` takes (padding reads row 0's first route: never counted)."""
        at_BS = self.token_index(sample_BS.cpu())
        probs = None if self.probs_RLK is None else self.probs_RLK[at_BS]
        return self.ids_RLK[at_BS].long(), probs

    def extra_BSLJ(self, sample_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A ``--top-m`` file's extra experts of a ``[B, S]`` batch's tokens, ``(ids_BSLJ, probs_BSLJ)`` (None: the
        file stores the top-k alone); the Megatron path's ``set_micro_batch(base_extra_BSLJ=...)``."""
        if self.extra_ids_RLJ is None:
            return None
        at_BS = self.token_index(sample_BS.cpu())
        return self.extra_ids_RLJ[at_BS].long(), self.extra_probs_RLJ[at_BS]

    def token_index(self, sample_BT: torch.Tensor) -> torch.Tensor:
        """Each token's place among the stored routes (``[B, S]``): its row's first token plus its position in the
        row; padding 0."""
        pad_BS = sample_BT < 0
        at_BS = self.offsets_N[sample_BT.clamp_min(0)] + positions_in_row(sample_BT)
        return torch.where(pad_BS, torch.zeros_like(at_BS), at_BS)


def _to(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def positions_in_row(sample_BT: torch.Tensor) -> torch.Tensor:
    """Each token's position in its data row: the count of the tokens before it, in its line, of the same row's
    run (a row's tokens are contiguous in a right-padded or packed line)."""
    B, S = sample_BT.shape
    starts_BS = torch.ones_like(sample_BT, dtype=torch.bool)
    starts_BS[:, 1:] = sample_BT[:, 1:] != sample_BT[:, :-1]
    index_BS = torch.arange(S).expand(B, S)
    first_BS = torch.where(starts_BS, index_BS, torch.zeros_like(index_BS)).cummax(dim=1).values
    return index_BS - first_BS


def load_stored_routes(
    path: str | Path,
    data: LabelledData,
    *,
    routers_sha256: str,
    moe_layers: list[int],
    num_layers: int,
    top_k: int,
    num_experts: int,
    transform: str,
    routes_loss: str | None = None,
) -> StoredRoutes:
    """The route file at ``path`` checked against the training file's labelling ``data`` and the model (its
    router fingerprint, MoE layers, decoder layers, top-k, experts), the run's router ``transform`` and the term's
    form (``anchor.routes_loss``: one that reads probabilities needs a file that has them)."""
    routes = load_routes(path)
    problems = file_problems(routes, data, routers_sha256, transform, path)
    if routes_loss in ROUTES_LOSSES_WITH_PROBS and routes.probs_RXK is None:
        problems.append(
            f"{path}: anchor.routes_loss={routes_loss} reads the base's probabilities and the file has ids alone "
            "(rpb routes --with-probs writes them; hinge and set-ce read ids alone)"
        )
    model = SimpleNamespace(moe_layers=moe_layers, top_k=top_k, num_experts=num_experts, num_layers=num_layers)
    per_row: list[torch.Tensor] = []
    if not problems:
        for ex in data.examples:
            routes_NLK, row_problems = row_routes(routes, ex, model, str(data.path))
            problems += row_problems
            per_row.append(routes_NLK)
    if problems:
        raise mismatch(
            f"anchor.routes={path}: {len(problems)} problem(s) against the training file {data.path}", problems
        )
    if routes.metadata.get("routers_sha256") is None:
        logger.warning(
            "rpb: %s carries no router fingerprint (an engine's arrays): rpb cannot check they are this base's", path
        )
    ids_RLK = (
        torch.cat(per_row).to(torch.int16) if per_row else torch.zeros(0, len(moe_layers), top_k, dtype=torch.int16)
    )
    probs_RLK = None
    if routes.probs_RXK is not None:
        width = routes.probs_RXK.shape[1]
        keep = moe_layers if width == num_layers else list(range(width))
        probs_RLK = torch.cat([routes.probs(ex.index)[:, keep] for ex in data.examples])
    extra = _extra(routes, data, moe_layers, num_layers, num_experts, path)
    lengths = torch.tensor([len(ex) for ex in data.examples], dtype=torch.int64)
    offsets_N = torch.cumsum(lengths, 0) - lengths
    form = routes_loss_form(routes_loss, probs_RLK is not None)
    return StoredRoutes(ids_RLK, probs_RLK, offsets_N, str(path), routes.metadata.get("engine"), form, *extra)


def _extra(routes: RouteFile, data: LabelledData, moe_layers, num_layers: int, num_experts: int, path):
    """A version-2 file's extra experts over the MoE layers, every row back to back (``(None, None)``: none)."""
    if routes.extra_ids_RXJ is None:
        return None, None
    width = routes.extra_ids_RXJ.shape[1]
    keep = moe_layers if width == num_layers else list(range(width))
    parts = [routes.extra(ex.index) for ex in data.examples]
    ids_RLJ = torch.cat([ids[:, keep] for ids, _ in parts])
    probs_RLJ = torch.cat([probs[:, keep] for _, probs in parts])
    if ids_RLJ.numel() and not (int(ids_RLJ.min()) >= 0 and int(ids_RLJ.max()) < num_experts):
        raise mismatch(
            f"anchor.routes={path}: extra_ids outside the model's {num_experts} experts",
            [f"{path}: extra_ids run from {int(ids_RLJ.min())} to {int(ids_RLJ.max())}"],
        )
    return ids_RLJ, probs_RLJ


def file_problems(routes: RouteFile, data: LabelledData, fingerprint: str, transform: str, path) -> list[str]:
    """The route file's problems as a whole, against the training file and the model."""
    meta, problems = routes.metadata, []
    if routes.num_rows != data.num_rows:
        problems.append(f"{path}: {routes.num_rows} rows of routes for the training file's {data.num_rows} rows")
    if meta.get("routers_sha256") not in (None, fingerprint):
        problems.append(
            f"{path}: routes of another model: router fingerprint {meta['routers_sha256'][:16]}…, the base's "
            f"{fingerprint[:16]}… (routers_sha256)"
        )
    if meta.get("data_sha256") not in (None, data.sha256):
        problems.append(
            f"{path}: routes of another data file (data_sha256 {meta['data_sha256'][:16]}…, the training file's "
            f"{data.sha256[:16]}…)"
        )
    if routes.probs_RXK is not None and meta.get("probs_transform") != transform:
        problems.append(
            f"{path}: router probabilities read as {meta.get('probs_transform')}, the run reads its routers as "
            f"{transform} (anchor.router_transform)"
        )
    return problems

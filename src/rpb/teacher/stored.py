"""``anchor.base: routes``: the base's routing read from a route file made for exactly the training file.

Shape legend: N = rows of the data file, R = every row's tokens back to back, L = MoE layers, K = top-k,
J = the experts stored after the top-k (a version-2 file's ``--top-m`` minus K), B = rows of a batch, S = its
positions, T = ``B * S``.

The route file (``rpb.replay.routefile``) comes from ``rpb routes`` (an HF forward of the base; with
``--with-probs`` the router probabilities at the stored experts too) or from an engine (ids alone, as
``rpb collect --from-routes`` reads them). Everything is checked before the first step, every problem named at
once (``rpb.collect.from_routes``'s checks): the row count, the router fingerprint and the data hash against the
run's, each row's tokens against the training labelling (the first differing row and position), each row's route
count and expert ids against the model, the rows streamed one at a time. Training never holds the file: each step
reads the rows its batch holds from a read-only map of the file (``RouteFile``), in the trainer's step,
so neither DataLoader workers nor any rank keeps more than a batch's routes in its own memory. A step's routes are
gathered by each token's (row, position in its row): ``sample_BT`` says the row, and the position is counted from
where the row starts in the batch's line, so right-padded and packed batches read alike.
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
from rpb.replay.routefile import RouteFile
from rpb.replay.routeshards import RouteShards, open_routes
from rpb.teacher.routing import BaseRouting

logger = logging.getLogger("rpb.teacher")


@dataclass
class StoredRoutes:
    """A checked route file read a batch at a time (``step``): ``file`` the mapped ``RouteFile``, ``keep`` its layer
    columns that are MoE layers, ``top_k``; ``describe()`` is what the run records."""

    file: RouteFile | RouteShards
    keep: list[int]
    top_k: int
    path: str
    engine: str | None
    #: the term's form the run uses (``anchor.routes_loss``, or the default for this file)
    routes_loss: str = "hinge"
    #: a step's routes are read by the tokens' rows and positions (``AnchorHandle.base_routing``), not a forward
    by_rows = True

    @property
    def with_probs(self) -> bool:
        return self.file.has_probs

    @property
    def top_m(self) -> int:
        return self.file.top_m

    @property
    def extra_columns(self) -> bool:
        """Whether the file stores experts after the top-k: a ``--top-m k`` file has the tensors with no columns,
        and reads as the top-k with probabilities (the same bucket, term for term)."""
        return self.file.has_extra and self.top_m > self.top_k

    def describe(self) -> dict:
        return {
            "source": "routes",
            "routes_file": self.path,
            "engine": self.engine,
            "with_probs": self.with_probs,
            "routes_loss": self.routes_loss,
            "top_m": self.top_m,
            "bytes": sum(p.stat().st_size for p in _files(Path(self.path))),
        }

    def step(self, sample_BT: torch.Tensor) -> BaseRouting:
        """The base's routes for a batch's tokens (padding tokens read expert 0: the anchor skips them)."""
        device, sample = sample_BT.device, sample_BT.cpu()
        lay = lambda x_BSLK: x_BSLK.reshape(-1, *x_BSLK.shape[2:]).transpose(0, 1).to(device)  # noqa: E731
        base = BaseRouting(ids_LTK=lay(self.gather("routes", sample).long()))
        if self.with_probs:
            base.probs_LTK = lay(self.gather("probs", sample))
        if self.extra_columns:
            base.extra_ids_LTJ = lay(self.gather("extra_ids", sample).long())
            base.extra_probs_LTJ = lay(self.gather("extra_probs", sample))
        return base

    def routes_BSLK(self, sample_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base's top-k ids (and probabilities, or None) of a ``[B, S]`` batch's tokens, ``[B, S, L, K]``: what
        the Megatron path's ``set_micro_batch`` takes (padding reads expert 0: never counted)."""
        probs = self.gather("probs", sample_BS.cpu()) if self.with_probs else None
        return self.gather("routes", sample_BS.cpu()).long(), probs

    def extra_BSLJ(self, sample_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A ``--top-m`` file's extra experts of a ``[B, S]`` batch's tokens, ``(ids_BSLJ, probs_BSLJ)`` (None: the
        file stores the top-k alone); the Megatron path's ``set_micro_batch(base_extra_BSLJ=...)``."""
        if not self.extra_columns:
            return None
        return self.gather("extra_ids", sample_BS.cpu()).long(), self.gather("extra_probs", sample_BS.cpu())

    def gather(self, name: str, sample_BS: torch.Tensor) -> torch.Tensor:
        """Tensor ``name`` of the file at each token of the batch, MoE layers only (``[B, S, L, last]``): each row
        of the batch read once, as a slice of the mapped file, and its tokens taken at their positions."""
        B, S = sample_BS.shape
        stated = self.file.stated[name]
        out_TLC = torch.zeros(B * S, len(self.keep), stated.shape[2], dtype=stated.dtype)
        row_T, at_T = sample_BS.reshape(-1), self.token_index(sample_BS).reshape(-1)
        for row in row_T[row_T >= 0].unique().tolist():
            mine_T = (row_T == row).nonzero().squeeze(1)
            out_TLC[mine_T] = self.file.rows_of(name, row)[:, self.keep][at_T[mine_T]]
        return out_TLC.reshape(B, S, len(self.keep), -1)

    def token_index(self, sample_BT: torch.Tensor) -> torch.Tensor:
        """Each token's position in its row's routes (``[B, S]``); padding 0."""
        pad_BS = sample_BT < 0
        at_BS = positions_in_row(sample_BT)
        return torch.where(pad_BS, torch.zeros_like(at_BS), at_BS)


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
    routes = open_routes(path)
    problems = file_problems(routes, data, routers_sha256, transform, path)
    if routes_loss in ROUTES_LOSSES_WITH_PROBS and not routes.has_probs:
        problems.append(
            f"{path}: anchor.routes_loss={routes_loss} reads the base's probabilities and the file has ids alone "
            "(rpb routes --with-probs writes them; hinge and set-ce read ids alone)"
        )
    model = SimpleNamespace(moe_layers=moe_layers, top_k=top_k, num_experts=num_experts, num_layers=num_layers)
    if not problems:  # streamed: one row's tokens and routes at a time, none kept
        for ex in data.examples:
            problems += row_routes(routes, ex, model, str(data.path))[1]
            problems += _extra_problems(routes, ex.index, moe_layers, num_layers, num_experts, path)
    if problems:
        raise mismatch(
            f"anchor.routes={path}: {len(problems)} problem(s) against the training file {data.path}", problems
        )
    if routes.metadata.get("routers_sha256") is None:
        logger.warning(
            "rpb: %s carries no router fingerprint (an engine's arrays): rpb cannot check they are this base's", path
        )
    form = routes_loss_form(routes_loss, routes.has_probs)
    keep = _keep(routes.width, moe_layers, num_layers)
    return StoredRoutes(routes, keep, top_k, str(path), routes.metadata.get("engine"), form)


def _files(path: Path) -> list[Path]:
    return sorted(path.iterdir()) if path.is_dir() else [path]


def _keep(width: int, moe_layers: list[int], num_layers: int) -> list[int]:
    """The file's layer columns that are MoE layers: the engines' layout has every decoder layer, else MoE alone."""
    return list(moe_layers) if width == num_layers else list(range(width))


def _extra_problems(routes: RouteFile, row: int, moe_layers, num_layers: int, num_experts: int, path) -> list[str]:
    """A version-2 file's extra experts of one row, against the model's experts."""
    if not routes.has_extra:
        return []
    ids = routes.extra(row)[0][:, _keep(routes.width, moe_layers, num_layers)]
    if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < num_experts):
        return [
            f"{path}: row {row}'s extra_ids run from {int(ids.min())} to {int(ids.max())}, outside the model's "
            f"{num_experts} experts"
        ]
    return []


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
    if routes.has_probs and meta.get("probs_transform") != transform:
        problems.append(
            f"{path}: router probabilities read as {meta.get('probs_transform')}, the run reads its routers as "
            f"{transform} (anchor.router_transform)"
        )
    return problems

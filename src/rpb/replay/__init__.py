"""Routing replay for Hugging Face MoE models: record a rollout's routes as ``generate`` makes them (or take an
engine's), carry them with the rollout, and replay them in the training forward (docs/rl.md).

* ``GenerationRecorder`` (``record``): each MoE layer's top-k at every forwarded token of ``model.generate``, and
  each generated token's log-probability.
* ``rollout_routes`` / ``batch_routes`` (``routes``): one rollout's ``routes_NLK`` and a padded batch's
  ``routes_BSLK``.
* ``RouteReplay`` (``replay``): the training forward routed to the recorded experts, gates from the live router.
* ``RoutePredictor`` / ``predictor_loss`` (``predictive``): PR2's predictor of the router's drift and its loss.
* ``mismatch``: flip rates and the log-probability gap, rollout against training.
* ``routes_from_vllm`` / ``routes_from_sglang`` (``engines``): an engine's returned routes as one rollout's
  ``routes_NLK``, checked against the model.
"""

from rpb.replay.engines import routes_from_sglang, routes_from_vllm
from rpb.replay.predictive import RoutePredictor, predictor_loss
from rpb.replay.record import GenerationRecorder
from rpb.replay.replay import RouteReplay
from rpb.replay.routes import NO_ROUTE, batch_routes, rollout_routes, routed_positions

#: ``off``: route freely; ``R2``: replay the first training forward's routing of a batch in its later updates;
#: ``R3``: replay the rollout's routing; ``PR2``: R2 whose routes a learned predictor of the drift chose
REPLAY_MODES = ("off", "R2", "R3", "PR2")

__all__ = [
    "NO_ROUTE",
    "REPLAY_MODES",
    "GenerationRecorder",
    "RoutePredictor",
    "RouteReplay",
    "batch_routes",
    "predictor_loss",
    "rollout_routes",
    "routed_positions",
    "routes_from_sglang",
    "routes_from_vllm",
]

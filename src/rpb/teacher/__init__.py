"""The base model as teacher: its routing (and its next-token distribution) for the tokens of each training step,
for the anchors that hold the model to what the base does on its own hidden states (``routing-kd``, ``output-kd``).

Shape legend: B = rows, T = tokens of the step (flattened ``B * S``, as the routers see them), L = MoE layers,
E = routed experts, K = top-k, V = vocabulary.

Two sources (``anchor.base``):

* ``online`` (``rpb.teacher.online``): a no-grad forward of the base on the step's own batch, before the training
  forward: under LoRA the same model with its adapters disabled (no second copy), under full fine-tuning a frozen
  copy loaded from the checkpoint. It runs in eval mode, so the anchor's, the replay's and the monitor's hooks on
  the training model pass it by, and, when only the routing is wanted, stops at the last MoE router.
* ``routes`` (``rpb.teacher.stored``): the base's top-k experts per token (and, from ``rpb routes --with-probs``,
  its router probabilities at them) read from a route file made for exactly the training file; no second model.

Either gives a ``BaseRouting`` for the step, which the trainer puts in the step's context
(``TokenContext.base``) for the anchor's hook to read, layer by layer.
"""

from rpb.teacher.online import OnlineBase, online_base
from rpb.teacher.routing import BaseRouting
from rpb.teacher.stored import StoredRoutes, load_stored_routes

__all__ = ["BaseRouting", "OnlineBase", "StoredRoutes", "load_stored_routes", "online_base"]

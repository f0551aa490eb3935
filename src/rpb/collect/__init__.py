"""``rpb collect``: the frozen base model's routing, averaged per sample, span and layer (eq. 2).

``collector`` runs the model and writes the artifact; ``rows`` checks the data file once and
reads rows back by range; ``store`` keeps finished chunks in ``<out>.partial/`` for resuming;
``dist`` shares the chunks out over ``torchrun`` / ``accelerate launch`` processes.
"""

from rpb.collect.collector import DEFAULT_CHUNK_ROWS, collect, collect_prior, plan_batches

__all__ = ["DEFAULT_CHUNK_ROWS", "collect", "collect_prior", "plan_batches"]

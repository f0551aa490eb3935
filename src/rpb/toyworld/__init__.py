"""The paper's study in a box, small enough for a laptop CPU.

``generators``: a synthetic world of four pretraining domains and two post-training sets of short,
exact-match question/answer pairs; ``tasks``: their sampling, splits and answer checking. ``base``: a
recipe for a tiny character-level MoE base model pretrained on that world (cached). ``world``: one
post-training cell (``rpb train`` with one method) and its scores. ``grids``: the grids of cells;
``inputs``: what a grid's cells share; ``experiment``: the resumable run of a grid's cells;
``report`` and ``tables``: their tables and figures; ``demo``: ``rpb demo``, the README's main command.
Only the command line imports this package; the library never depends on it.
"""

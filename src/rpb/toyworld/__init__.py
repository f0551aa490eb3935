"""The paper's study in a box, small enough for a laptop CPU, on three floors, each importing only downwards.

``world``: what the toy world is: a synthetic world of four pretraining domains and post-training sets of short,
exact-match question/answer pairs (``generators``, ``tasks``, ``knowledge``), a recipe for a tiny character-level
MoE base pretrained on it (``base``, cached), one post-training cell and its scores (``post``), one GRPO cell
(``rl``). ``study``: how any grid runs and is judged, from the grid's fields alone: what a grid is (``grid``),
resumable cells (``cells``), lanes, shipping, statistics, tables, figures, claims, the report across bases.
``grids``: one module per grid. Above them: ``demo`` (``rpb demo``, the README's main command) and ``cli``.
Only the command line imports this package; the library never depends on it.
"""

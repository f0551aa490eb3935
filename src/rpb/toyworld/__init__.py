"""The paper's study in a box, small enough for a laptop CPU.

``tasks``: a synthetic world of four pretraining domains and two post-training sets of short,
exact-match question/answer pairs. ``base``: a recipe for a tiny character-level MoE base model
pretrained on that world (cached). ``world``: one post-training cell (``rpb train`` with one
method) and its scores. ``experiment``: resumable grids of cells; ``tables``: their tables and
figures; ``demo``: ``rpb demo``, the README's main command. Only the command line imports this
package; the library never depends on it.
"""

"""What the toy world is: its domains and tasks, its bases and one post-training or GRPO cell. Imports nothing of
``rpb.toyworld.study`` or ``rpb.toyworld.grids``."""

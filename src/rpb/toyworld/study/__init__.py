"""How any grid of the toy world runs and is judged, from the grid's fields alone (``grid.Grid``): never a grid's
name, nothing of ``rpb.toyworld.grids``."""

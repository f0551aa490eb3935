"""Routing retention: base vs post-trained routing statistics, figures and report."""

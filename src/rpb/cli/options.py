"""Argument types and options that several commands share, so that each takes them the same way."""

from __future__ import annotations

import argparse
import json

from rpb.models import DTYPES

LANES_HELP = (
    "runs side by side, one process each, the usable cores shared out among them (default: one per usable "
    "core, at most 8; 1: one after another, all threads to each)"
)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def betas(text: str) -> list[float]:
    try:
        return [float(b) for b in text.split(",") if b.strip()] if text.strip() else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of numbers, got {text!r}") from None


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {text!r}")
    return int(text)


def model_options(parser) -> None:
    """The options every command that runs a checkpoint over data takes the same way."""
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--adapter", help="the model_type whose router facts to use (default: the model's own)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--device", default="auto")


def template_kwargs_option(parser, help_text: str | None = None) -> None:
    parser.add_argument(
        "--chat-template-kwargs",
        type=json_object,
        metavar="JSON",
        help=help_text or "the chat template's keyword arguments, e.g. '{\"enable_thinking\": true}' (recorded)",
    )

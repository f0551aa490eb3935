"""The argument types several commands share: what each accepts, and the message of what it refuses."""

import argparse

import pytest

from rpb.cli.options import betas, json_object, model_options, positive_int


def test_json_object_takes_an_object_and_refuses_other_json_and_non_json():
    assert json_object('{"enable_thinking": true}') == {"enable_thinking": True}
    with pytest.raises(argparse.ArgumentTypeError, match="expected a JSON object, got list"):
        json_object("[1, 2]")
    with pytest.raises(argparse.ArgumentTypeError, match="not JSON"):
        json_object("{enable_thinking: true}")


def test_betas_reads_a_comma_separated_list():
    assert betas("0.25, 0.5,1,") == [0.25, 0.5, 1.0]
    assert betas("  ") == []
    with pytest.raises(argparse.ArgumentTypeError, match=r"comma-separated list of numbers, got '0\.5,x'"):
        betas("0.5,x")


@pytest.mark.parametrize("text", ["0", "-1", "2.5", "two", ""])
def test_positive_int_refuses_what_is_not_a_whole_number_of_at_least_one(text):
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
        positive_int(text)


def test_positive_int_takes_whole_numbers():
    assert [positive_int(t) for t in ("1", "8", "16")] == [1, 8, 16]


def test_model_options_defaults():
    parser = argparse.ArgumentParser()
    model_options(parser)
    args = parser.parse_args([])
    assert (args.batch_size, args.adapter, args.dtype, args.device) == (8, None, "float32", "auto")
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float8"])

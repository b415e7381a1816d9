"""A seeded sample of tests/fuzz_cli.py's hostile command lines (all of them: ``python tests/fuzz_cli.py``)."""

import random

import pytest

from tests import fuzz_cli

ALL = fuzz_cli.cases()
SAMPLE = random.Random(41).sample(ALL, 150)  # about 0.1-0.5 s each: well under a minute


def test_the_fuzzer_makes_hostile_values_for_every_command_from_the_flag_table():
    assert len(ALL) >= 200
    assert {c.command for c in ALL} == set(fuzz_cli.BASES)


@pytest.mark.parametrize("case", SAMPLE, ids=str)
def test_a_hostile_command_line_is_refused_in_one_line(case):
    assert fuzz_cli.run_case(case) is None

"""`make test`'s two lanes (tests/lanes.py): a failure in either fails the run; a lane left without tests does not."""

from __future__ import annotations

import pytest

from tests.lanes import NO_TESTS, combined_status


@pytest.mark.parametrize(
    ("apps", "cluster", "expected"),
    [
        (0, 0, 0),
        (1, 0, 1),  # a test failed in the apps lane
        (0, 1, 1),  # ... or in the cluster lane, which ran in the background
        (0, 2, 2),  # interrupted
        (NO_TESTS, 0, 0),  # `make test` with a selection only one lane holds
        (0, NO_TESTS, 0),
        (NO_TESTS, 1, 1),
        (NO_TESTS, NO_TESTS, NO_TESTS),  # nothing selected at all
    ],
)
def test_either_lanes_failure_fails_the_run(apps, cluster, expected):
    assert combined_status([apps, cluster]) == expected

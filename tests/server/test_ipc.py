"""The messages between the server's processes survive pickling whole: every field, in its place."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from minisgl.core import TokenLogprob
from minisgl.messages import Alternative, LogprobEntry, ReqOutput, TextOutput


@pytest.mark.parametrize("message", [
    ReqOutput(7, [1, 2], [TokenLogprob(2, -0.5, [(2, -0.5), (3, -1.5)])], "stop", 11, 4, "fault",
              [TokenLogprob(5, -2.0, [])], 12.5, [0.25, -1.0]),
    TextOutput(7, "ab", [1, 2], [LogprobEntry("b", 2, -0.5, [Alternative("c", -1.5, 3)])], "stop", 11, 4, None,
               "</s>", [LogprobEntry("p", 5, None, [])], 12.5, [0.25]),
])
def test_an_output_message_pickles_to_an_equal_one(message):
    """Outputs pickle as their fields' values in order (ipc.Packed): each field must come back in its place,
    none set to another's value (every field given a distinct value here)."""
    back = pickle.loads(pickle.dumps(message))
    assert type(back) is type(message)
    assert [getattr(back, f.name) for f in dataclasses.fields(back)] == \
        [getattr(message, f.name) for f in dataclasses.fields(message)]

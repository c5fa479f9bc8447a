"""How the router reads /v1/responses and /v1/embeddings bodies: the prompt it classifies and charges."""
from __future__ import annotations

import pytest

from slofleet.router.wire import RoutedBody


@pytest.mark.parametrize("body, text, ids", [
    ({"input": "hello there"}, "\nhello there", None),
    ({"input": "hi", "instructions": "be brief"}, "be brief\nhi", None),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text",
                                                                                   "text": "b"}]}]}, "\nab", None),
    ({"input": ["one", "two"]}, "\none\ntwo", None),
    ({"input": [1, 2, 3]}, "", 3),
    ({"input": [[1, 2], [3]]}, "", 3),
])
def test_input_is_flattened_for_classification(body, text, ids):
    prompt = RoutedBody.model_validate(body).flat_prompt()
    assert (prompt.text, prompt.ids) == (text, ids)


def test_max_output_tokens_bounds_the_output():
    assert RoutedBody.model_validate({"input": "x", "max_output_tokens": 7}).output_tokens() == 7

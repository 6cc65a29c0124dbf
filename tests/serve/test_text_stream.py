"""Streamed text from growing final prefixes: the deltas always concatenate to the final text."""
from __future__ import annotations

import pytest

from flash_dllm.serve.api_server import TextStream

PIECES = ["Hello", " ", ",", " wor", "ld", "\xe2", "\x82\xac", " STOP", " end"]


class CleanUpDecoder:
    """Decodes like a tokenizer with clean_up_tokenization_spaces (" ," -> ",") whose tokens may hold half of
    a UTF-8 character: the text of a prefix is not always a prefix of the text."""

    def decode(self, ids: list[int]) -> str:
        raw = "".join(PIECES[i] for i in ids).encode("latin-1")
        return raw.decode("utf-8", errors="replace").replace(" ,", ",")


@pytest.mark.parametrize("stops", [[], ["STOP"], ["ld\u20ac S"]])
def test_deltas_concatenate_to_the_final_text(stops):
    stream = TextStream(CleanUpDecoder(), stops)
    ids = list(range(len(PIECES)))
    sent, stopped = "", False
    for length in range(1, len(ids) + 1):
        delta, stopped = stream.grow(ids[:length])
        sent += delta
        if stopped:
            break
    if not stopped:
        delta, stopped = stream.finish(ids)
        sent += delta
    final = CleanUpDecoder().decode(ids)
    expected = final[:min(final.find(s) for s in stops)] if stops else final
    assert sent == expected and "\ufffd" not in sent and stopped == bool(stops)

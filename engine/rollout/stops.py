"""Stop strings, checked on decoded text after every token.

Each step decodes only the last few tokens (enough to hold the longest stop string); on a
hit the full completion is decoded once to cut the text right after the first stop string
and keep the shortest token prefix whose text contains it.
"""
from __future__ import annotations


class StopStrings:
    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tok = tokenizer
        self.stops = list(stops)
        self.window = max((len(s) for s in stops), default=0) + 8  # tokens; >= 1 char each but byte pieces

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _first_end(self, text: str) -> int | None:
        ends = [text.find(s) + len(s) for s in self.stops if s in text]
        return min(ends) if ends else None

    def check(self, ids: list[int]) -> tuple[int, str] | None:
        """(tokens to keep, text cut after the stop string) if ``ids`` contain a stop string."""
        if not self.stops or self._first_end(self.decode(ids[-self.window:])) is None:
            return None
        text = self.decode(ids)
        end = self._first_end(text)
        if end is None:  # the window decoded differently (partial characters): not a real hit
            return None
        n = len(ids)
        while n > 1 and self._first_end(self.decode(ids[:n - 1])) == end:
            n -= 1
        return n, text[:end]

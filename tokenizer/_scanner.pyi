# The C extension tokenizer._scanner (tokenizer/_scanner.c), as tokenizer/wordcache.py calls it.
from typing import Any, Sequence

def split_bytelevel(ascii_text: str, kind: int, /) -> list[str]: ...
# The cached id lists of `words` joined (a new list), or the words not cached (a tuple). Any: the callers
# tell the two apart with `type(found) is tuple` (the hot path's test), which mypy does not narrow on.
def concat_cached(words: Sequence[str], cache: dict[str, list[int]], /) -> Any: ...

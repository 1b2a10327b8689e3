"""The sink contract (kvcache.sink): EventSink declares every method the ingest path calls on a sink,
the prefix index implements each with the same signature, and a decoded-only sink declines every
raw batch."""
from __future__ import annotations

import ast
import inspect
from array import array
from pathlib import Path

import kvcache
from kvcache.events import BlockStored, EventBatch
from kvcache.index import PrefixIndex
from kvcache.sink import DecodedSink, EventSink, RunApplied
from kvcache.wire import encode_batch

CONTRACT = sorted(name for name, v in vars(EventSink).items() if inspect.isfunction(v) and not name.startswith("_"))
PACKAGE = Path(kvcache.__file__).parent


def _shape(fn) -> tuple:
    """A method's parameters (name, kind, default, annotation) and return annotation, self left out."""
    sig = inspect.signature(fn)
    params = [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()][1:]
    return params, sig.return_annotation


def _sink_calls(source: str) -> set[str]:
    """Attributes read off a sink in `source`: `sink.X` and `self._sink.X`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "sink") or (
                    isinstance(v, ast.Attribute) and v.attr == "_sink" and isinstance(v.value, ast.Name)
                    and v.value.id == "self"):
                found.add(node.attr)
    return found


def test_the_contract_is_every_method_the_ingest_path_calls_on_a_sink():
    assert CONTRACT == ["apply", "apply_payload", "apply_run", "drop", "split_payload"]
    called: set[str] = set()
    for module in ("stream.py", "ingest.py"):
        source = (PACKAGE / module).read_text()
        assert "getattr(sink" not in source and "hasattr(sink" not in source  # no optional methods
        called |= _sink_calls(source)
    assert called == set(CONTRACT), called


def test_the_prefix_index_implements_the_whole_contract_with_its_signatures():
    index = PrefixIndex(max_entries=1_000)
    assert isinstance(index, EventSink)
    for name in CONTRACT:
        assert _shape(getattr(PrefixIndex, name)) == _shape(getattr(EventSink, name)), name


def test_a_decoded_sink_declines_every_raw_batch():
    class Sink(DecodedSink):
        def apply(self, pod, model, rank, events):
            pass

        def drop(self, pod, rank):
            pass

    sink = Sink()
    assert isinstance(sink, EventSink)
    for name in CONTRACT:
        assert _shape(getattr(DecodedSink, name)) == _shape(getattr(EventSink, name)), name
    payload = encode_batch(EventBatch(1.0, (BlockStored((1,), None, (1, 2), 2, None, "GPU", None),)), "0.33")
    assert sink.apply_payload("p", "m", 0, payload) is None
    assert sink.split_payload(payload, 1) is None
    counts = array("q", bytes(8 * 3))
    assert sink.apply_run("p", "m", 0, [(0, payload)], 0, 0, 64, 512, array("d", (0.1, 1.0)), counts) == \
        RunApplied(0, 0, 0, 0.0, None)

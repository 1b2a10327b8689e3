"""LocalTokenizer and its async adapter, on the project's test tokenizer; the log throttle."""
from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest

from tokenizer import testdata
from tokenizer.local import LocalBackend, LocalTokenizer
from devkit.tokenizer_stub import tokenize_response
from plugin.throttle import LogThrottle
from tokenizer.types import ChatInput, PromptInput, TokenizerError


@pytest.fixture(scope="module")
def local() -> LocalTokenizer:
    return LocalTokenizer.from_path(testdata.path())


def test_chat_renders_chatml_and_round_trips(local) -> None:
    item = ChatInput(messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}))
    text = local.render_chat(item)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = local.encode_chat(item)
    assert local.decode(ids) == text
    assert ids.count(local.hf.convert_tokens_to_ids("<|im_start|>")) == 3


def test_chat_options_change_the_rendering(local) -> None:
    msgs = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, here"})
    cont = local.render_chat(ChatInput(messages=msgs, add_generation_prompt=False, continue_final_message=True))
    assert cont.endswith("Sure, here")
    no_gen = local.render_chat(ChatInput(messages=msgs, add_generation_prompt=False))
    assert no_gen.endswith("<|im_end|>\n")
    think = local.render_chat(ChatInput(messages=msgs, chat_template_kwargs={"enable_thinking": False}))
    assert think.endswith("<think>\n\n</think>\n\n")
    tools = local.render_chat(ChatInput(messages=msgs, tools=({"type": "function", "function": {"name": "lookup"}},)))
    assert '"name": "lookup"' in tools
    custom = local.render_chat(ChatInput(messages=msgs, chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}"))
    assert custom == "[hi][Sure, here]"


def test_text_parts_are_joined_like_vllm(local) -> None:
    parts = ChatInput(messages=({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},))
    plain = ChatInput(messages=({"role": "user", "content": "a\nb"},))
    assert local.encode_chat(parts) == local.encode_chat(plain)


@pytest.mark.parametrize("messages", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},),
    ({"content": "no role"},),
    ("not an object",),
    ({"role": "user", "content": 5},),
])
def test_bad_messages_raise_value_error(local, messages) -> None:
    with pytest.raises(ValueError):
        local.encode_chat(ChatInput(messages=messages))


def test_broken_template_raises_value_error(local) -> None:
    with pytest.raises(ValueError, match="chat template failed"):
        local.encode_chat(ChatInput(messages=({"role": "user", "content": "x"},), chat_template="{{ raise_exception('no') }}"))


def test_prompt_special_tokens_are_cut_out(local) -> None:
    ids = local.encode_prompt("x<|endoftext|>y", add_special_tokens=False)
    assert local.hf.convert_tokens_to_ids("<|endoftext|>") in ids
    assert local.token_strs(ids)[1] == "<|endoftext|>"


def test_from_path_refuses_missing_directory(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        LocalTokenizer.from_path(tmp_path / "absent")
    with pytest.raises(ValueError, match="cannot load"):
        LocalTokenizer.from_path(tmp_path)


async def test_backend_offloads_long_inputs_and_agrees(local) -> None:
    backend = LocalBackend({"m": local}, offload_chars=100)
    main_thread = threading.get_ident()
    seen_threads: list[int] = []
    original = local.encode

    def spy(item):
        seen_threads.append(threading.get_ident())
        return original(item)

    local.encode = spy  # type: ignore[method-assign]
    try:
        short = PromptInput(text="short")
        long = ChatInput(messages=({"role": "user", "content": "long text " * 100},))
        results = await asyncio.gather(backend.tokenize("m", short), backend.tokenize("m", long), backend.tokenize("m", long))
    finally:
        del local.encode
    assert results[0] == local.encode_prompt("short")
    assert results[1] == results[2] == local.encode_chat(long)
    assert seen_threads[0] == main_thread and seen_threads[1] != main_thread
    with pytest.raises(TokenizerError, match="no local tokenizer"):
        await backend.tokenize("other", short)
    with pytest.raises(TokenizerError, match="both"):
        await backend.tokenize("m", ChatInput(messages=long.messages, continue_final_message=True))


def test_stub_server_answers_vllm_shapes(local) -> None:
    status, body = tokenize_response(local, {"model": "m", "prompt": "hi", "return_token_strs": True})
    assert status == 200 and body["count"] == len(body["tokens"]) and body["max_model_len"] == 8192
    assert body["token_strs"] == local.token_strs(body["tokens"])
    status, body = tokenize_response(local, {"model": "m", "messages": "nope"})
    assert status == 400 and "messages" in body["error"]["message"]


def test_log_throttle_logs_once_per_interval(caplog) -> None:
    now = [0.0]
    throttle = LogThrottle(interval_s=10, clock=lambda: now[0])
    logger = logging.getLogger("test.throttle")
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        results = [throttle.log(logger, logging.WARNING, "down", "tokenizer %s down", "m") for _ in range(5)]
        now[0] = 11
        results.append(throttle.log(logger, logging.WARNING, "down", "tokenizer %s down", "m"))
        results.append(throttle.log(logger, logging.WARNING, "other", "other %s", "x"))
    assert results == [True, False, False, False, False, True, True]
    assert [r.getMessage() for r in caplog.records] == ["tokenizer m down", "tokenizer m down (4 similar suppressed)", "other x"]


async def test_backend_default_serves_every_model(local) -> None:
    backend = LocalBackend(default=local)
    assert await backend.tokenize("any-model", PromptInput(text="hi")) == local.encode_prompt("hi")


def test_request_fields_win_over_chat_template_kwargs_like_vllm(local) -> None:
    # vLLM's TokenizeChatRequest/ChatCompletionRequest merge the request's own add_generation_prompt and
    # continue_final_message over chat_template_kwargs (renderers.params.merge_kwargs); other kwargs pass.
    msgs = ({"role": "user", "content": "x"},)
    overridden = ChatInput(messages=msgs, chat_template_kwargs={"add_generation_prompt": False})
    assert local.render_chat(overridden) == local.render_chat(ChatInput(messages=msgs, add_generation_prompt=True))
    assert local.render_chat(overridden).endswith("<|im_start|>assistant\n")
    think = ChatInput(messages=msgs, chat_template_kwargs={"enable_thinking": False, "unused": None})
    assert local.render_chat(think).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        local.render_chat(ChatInput(messages=msgs, chat_template_kwargs=["nope"]))  # type: ignore[arg-type]


def test_unencodable_text_is_a_value_error(local) -> None:
    with pytest.raises(ValueError, match="cannot encode"):
        local.encode_prompt("a\ud800b")


_TEXTS = ["", "hello world", "  leading and trailing  ", "Ünïcödé ☕ 漢字 and emoji 🙂", "tabs\tand\nnew lines\r\n",
          "<|im_start|>user\nhi<|im_end|>", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
          "numbers 1234567 3.14159 and code: def f(x): return x**2", "a" * 300]
_CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
          [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]]


@pytest.mark.parametrize("name", ["test", "llama3_1"])
def test_a_generic_tokenizer_without_a_model_config_loads_as_autotokenizer_loads_it(name, tmp_path) -> None:
    """The start-up shortcut (tokenizer.local._load_hf: the generic fast class, not imported through AutoTokenizer)
    gives the tokenizer AutoTokenizer gives: same class, special tokens, template, added tokens and ids."""
    import shutil

    from transformers import AutoTokenizer

    from tokenizer.local import _load_hf
    import realtok
    source = realtok.directory_or_skip(name)
    assert not (source / "config.json").exists()  # the case the shortcut takes
    mine, auto = _load_hf(source), AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    assert type(mine) is type(auto)
    assert mine.special_tokens_map == auto.special_tokens_map and mine.model_max_length == auto.model_max_length
    assert mine.chat_template == auto.chat_template and mine.get_added_vocab() == auto.get_added_vocab()
    assert {k: str(v) for k, v in mine.added_tokens_decoder.items()} == \
           {k: str(v) for k, v in auto.added_tokens_decoder.items()}
    for text in _TEXTS:
        for special in (True, False):
            assert mine(text, add_special_tokens=special)["input_ids"] == \
                   auto(text, add_special_tokens=special)["input_ids"], (text, special)
    for chat in _CHATS:
        assert mine.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
               auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    # a model config beside it (its model type may change AutoTokenizer's choice), custom code, or a named class:
    # AutoTokenizer decides, as before
    import transformers
    asked = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, **kw):
        asked.append(path)
        return real(path, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
        with_config = tmp_path / "with_config"
        shutil.copytree(source, with_config)
        (with_config / "config.json").write_text('{"model_type": "llama"}')
        _load_hf(with_config)
        named = tmp_path / "named"
        shutil.copytree(source, named)
        config = json.loads((named / "tokenizer_config.json").read_text())
        (named / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": ["x", None]}}))
        assert asked == [str(with_config)]
        _load_hf(named)
        assert asked == [str(with_config), str(named)]
        _load_hf(source)  # the shortcut: AutoTokenizer not asked
        assert asked == [str(with_config), str(named)]

"""A loopback HTTP server answering vLLM's `POST /tokenize` with LocalTokenizers.

For tests and benchmarks until (and besides) the simulated engine: same request
and response shapes as vLLM, same tokens as the engine would produce.
Run alone: `python -m devkit.tokenizer_stub --port 8000 [--model NAME [--path DIR]]`.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from tokenizer.local import LocalTokenizer
from tokenizer.types import ChatInput


def tokenize_response(tok: LocalTokenizer, body: Any) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) for one /tokenize request body, as vLLM answers it."""
    if not isinstance(body, dict):
        return 400, _error("request body must be a JSON object")
    try:
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list):
                raise ValueError("messages must be a list")
            tools = body.get("tools")
            item = ChatInput(
                messages=tuple(messages),
                tools=tuple(tools) if tools else None,
                chat_template=body.get("chat_template"),
                chat_template_kwargs=body.get("chat_template_kwargs"),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
            )
            text = tok.render_chat(item)
            ids = tok.encode_prompt(text, add_special_tokens=bool(body.get("add_special_tokens", False)))
        elif isinstance(body.get("prompt"), str):
            ids = tok.encode_prompt(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
        else:
            raise ValueError("either `prompt` (a string) or `messages` is required")
    except ValueError as e:
        return 400, _error(str(e))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": tok.max_model_len, "tokens": ids, "token_strs": None}
    if body.get("return_token_strs"):
        out["token_strs"] = tok.token_strs(ids)
    return 200, out


def _error(message: str, code: int = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": code}}


def make_app(tokenizers: Mapping[str, LocalTokenizer]) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response(_error("invalid JSON"), status=400)
        model = body.get("model") if isinstance(body, dict) else None
        tok = tokenizers.get(model) if model else next(iter(tokenizers.values()), None)
        if tok is None:
            return web.json_response(_error(f"The model `{model}` does not exist.", 404), status=404)
        status, out = tokenize_response(tok, body)
        return web.json_response(out, status=status)

    app = web.Application()
    app.router.add_post("/tokenize", handle)
    return app


def main(argv: list[str] | None = None) -> int:
    from tokenizer import testdata

    p = argparse.ArgumentParser(prog="python -m devkit.tokenizer_stub")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="test-model")
    p.add_argument("--path", default=str(testdata.path()))
    args = p.parse_args(argv)
    app = make_app({args.model: LocalTokenizer.from_path(args.path, fast=False)})  # the reference, as vLLM
    web.run_app(app, host=args.host, port=args.port, print=lambda *_: print("listening", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

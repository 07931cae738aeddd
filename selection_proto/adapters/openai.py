"""OpenAI request bodies as the router sees them: the model, and the prompt as token ids (given by
the client, tokenized with the model's own tokenizer and chat template, or, with neither, the
text's own "text tokens"); and errors in OpenAI's shape. Pure: files are read by the caller.

Text tokens (docs/GATEWAY.md): the UTF-8 bytes of the prompt, four to a token (little-endian,
the last padded with zero bytes). Two prompts sharing a prefix share their leading blocks, so
`--kv-events approximate` routes them together; they never match an engine's KV events."""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from typing import Any, Final

from ..core.base import jsonio

__all__ = ["TEXT_TOKEN_BYTES", "ChatTokenizer", "OpenAIError", "RoutingPrompt", "error_body", "parse_request",
           "text_tokens", "with_members"]

TEXT_TOKEN_BYTES: Final = 4
_ERROR_TYPES: Final = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
                       429: "rate_limit_error", 503: "service_unavailable_error"}


class OpenAIError(Exception):
    """A request refused before it reaches an engine, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    return json.dumps({"error": {"message": message, "type": _ERROR_TYPES.get(status, "internal_error"),
                                 "param": param, "code": status}}).encode()


class RoutingPrompt:
    """What a selection needs from one request: the model and the prompt's token ids (as the
    client sent them: not yet checked to be u32); `exact` when those are the engine's own tokens
    (given, or tokenized as the engine does)."""

    __slots__ = ("model", "token_ids", "exact")

    def __init__(self, model: str, token_ids: list[int], exact: bool) -> None:
        self.model, self.token_ids, self.exact = model, token_ids, exact


def text_tokens(text: str) -> list[int]:
    """The text's UTF-8 bytes as u32 tokens, four bytes each (the module docstring)."""
    data = text.encode("utf-8", "surrogatepass")
    data += b"\0" * (-len(data) % TEXT_TOKEN_BYTES)
    tokens = array("I")
    tokens.frombytes(data)
    if tokens.itemsize != TEXT_TOKEN_BYTES:  # pragma: no cover - no such platform in practice
        raise RuntimeError("array('I') is not 32 bits wide on this platform")
    return tokens.tolist()


class ChatTokenizer:
    """A model's tokenizer (the text of its `tokenizer.json`) and chat template (from its
    `tokenizer_config.json`), applied as vLLM applies them: a completion's prompt with special
    tokens added, a chat rendered by the template (Jinja2 in a sandbox, as transformers does) and
    tokenized without adding them again."""

    def __init__(self, tokenizer_json: str, config: Mapping[str, Any] | None = None) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(tokenizer_json)
        config = config or {}
        self._special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token",
                                                                          "pad_token")}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self._template = None
        if isinstance(template, str):
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
            self._template = env.from_string(template)

    def completion(self, text: str) -> list[int]:
        return self._encode(text, True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # The batch call lets go of the GIL while it tokenizes (`encode` holds it throughout: a
        # 4 MiB prompt stopped the event loop for 1.4 s); the fast one skips the offsets, which
        # routing never reads, in half the time. Their ids are `encode`'s.
        try:
            (encoding,) = self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
            return list(encoding.ids)
        except Exception as exc:  # noqa: BLE001 - a lone surrogate, say: the request's fault
            raise OpenAIError(400, f"the prompt cannot be tokenized: {exc}", "prompt") from None

    def chat(self, messages: list[Any], body: Mapping[str, Any]) -> list[int]:
        if self._template is None:
            raise OpenAIError(400, "this model's tokenizer has no chat template", "messages")
        kwargs = body.get("chat_template_kwargs")
        try:
            text = self._template.render(
                messages=messages, tools=body.get("tools"), add_generation_prompt=body.get("add_generation_prompt", True),
                **self._special, **(kwargs if isinstance(kwargs, dict) else {}))
        except OpenAIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error is the request's
            raise OpenAIError(400, f"the chat template failed: {exc}", "messages") from None
        return self._encode(text, False)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_template_error(message: str) -> None:
    raise OpenAIError(400, f"the chat template refused the messages: {message}", "messages")


def _load(body: bytes) -> Any:
    """orjson, the cyclic collector paused for a big body: it holds the GIL a fraction of the
    stdlib's time, which matters in a worker thread beside the event loop. What it refuses (a lone
    surrogate, a number out of range, deep nesting) the stdlib reads as before, from UTF-8 only:
    given bytes, it would read UTF-16 and UTF-32 too, which JSON between systems is not."""
    try:
        return jsonio.loads(body)
    except jsonio.JSONSyntaxError:
        if (wide := jsonio.wide_encoding(body)) is not None:
            raise ValueError(f"the body is {wide}; JSON must be UTF-8") from None
        return json.loads(body.decode("utf-8"))  # (a UnicodeDecodeError is a ValueError)


def parse_request(body: bytes, tokenizers: Mapping[str, ChatTokenizer]) -> RoutingPrompt:
    """The model and prompt of an OpenAI request body: `prompt` (text, token ids, or a batch of
    either: its first is routed) for completions, `messages` for chats, `input` for embeddings;
    none of them routes on load alone. Raises OpenAIError (400) for a body that is not that."""
    try:
        value = _load(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise OpenAIError(400, f"the request body is not valid JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(value, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "model is required (a non-empty string)", "model")
    tokenizer = tokenizers.get(model)
    messages = value.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise OpenAIError(400, "messages must be an array of objects", "messages")
        if tokenizer is not None:
            return RoutingPrompt(model, tokenizer.chat(messages, value), True)
        return RoutingPrompt(model, text_tokens(_chat_text(messages)), False)
    prompt = value.get("prompt", value.get("input"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if prompt is None or prompt == []:
        return RoutingPrompt(model, [], True)
    if isinstance(prompt, str):
        if tokenizer is not None:
            return RoutingPrompt(model, tokenizer.completion(prompt), True)
        return RoutingPrompt(model, text_tokens(prompt), False)
    if isinstance(prompt, list):
        return RoutingPrompt(model, prompt, True)  # the core checks each id as it checks `token_ids`
    raise OpenAIError(400, "prompt must be a string, an array of token ids, or an array of either", "prompt")


def with_members(body: bytes, members: Mapping[str, Any]) -> bytes:
    """A request body `parse_request` read (one JSON object), with `members` appended as its last:
    they win over the client's own of the same names, as JSON readers keep a repeated name's last
    value (Python's json, which the engines' servers read with, orjson, serde_json). A splice, not
    a parse: what the body holds is not read again (SGLang's bootstrap fields, docs/GATEWAY.md)."""
    head = body.rstrip()
    assert head.endswith(b"}"), "not the object parse_request read"
    inner = head[:-1].rstrip()
    added = json.dumps(members, separators=(",", ":"))[1:-1].encode()
    return inner + (b"" if inner.endswith(b"{") or not added else b",") + added + b"}"


def _chat_text(messages: list[dict[str, Any]]) -> str:
    """A chat as one canonical text, for text tokens: each message's role and content in order
    (content parts that are not text as their JSON)."""
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") if isinstance(p, dict) and p.get("type") == "text"
                              else json.dumps(p, sort_keys=True) for p in content)
        elif not isinstance(content, str):
            content = "" if content is None else json.dumps(content, sort_keys=True)
        parts.append(f"<|{message.get('role', '')}|>\n{content}\n")
    return "".join(parts)

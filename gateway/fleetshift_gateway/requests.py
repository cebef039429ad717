"""Parsing and checking an OpenAI request body before anything is routed.

Every check names the field it refused (``param``), and a refused request never reaches the
daemon, so it is neither routed nor counted in the traffic mix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from fleetshift_gateway.errors import ApiError, bad_request
from fleetshift_gateway.tokenizer import ROLES, ModelTokenizer

MAX_SEED = (1 << 64) - 1


@dataclass(frozen=True)
class Generation:
    """What one request asks the fleet for, in token ids."""

    model: ModelTokenizer
    prompt: list[int]
    max_tokens: int | None  # None: not stated (Route estimates; the rest of the context caps)
    temperature: float
    top_p: float
    seed: int | None
    stream: bool
    include_usage: bool

    @property
    def limit(self) -> int:
        return self.max_tokens or self.model.context_tokens - len(self.prompt)


def parse_body(raw: bytes, content_type: str) -> dict[str, Any]:
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise bad_request(
            "content-type",
            f"Content-Type must be application/json, got {content_type or 'none'!r}",
            code="unsupported_media_type",
        )
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(
            "body", f"the body is not valid JSON: {err}", code="invalid_json"
        ) from err
    if not isinstance(body, dict):
        raise bad_request("body", "the body must be a JSON object", code="invalid_json")
    return body


def model_of(body: dict[str, Any], models: dict[str, ModelTokenizer]) -> ModelTokenizer:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad_request("model", "model is required (a string)", code="missing_field")
    if name not in models:
        raise ApiError(
            404,
            f"the model {name!r} does not exist; served here: {sorted(models)}",
            param="model",
            code="model_not_found",
        )
    return models[name]


def completion(body: dict[str, Any], models: dict[str, ModelTokenizer]) -> Generation:
    model = model_of(body, models)
    return _generation(body, model, _completion_prompt(body.get("prompt"), model), "prompt")


def chat(body: dict[str, Any], models: dict[str, ModelTokenizer]) -> Generation:
    model = model_of(body, models)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages must be a non-empty list", code="missing_field")
    turns: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        content = msg.get("content") if isinstance(msg, dict) else None
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role", f"role must be one of {list(ROLES)}")
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content", "content must be a string")
        turns.append((role, content))
    body = {**body, "max_tokens": body.get("max_completion_tokens", body.get("max_tokens"))}
    return _generation(body, model, model.chat_prompt(turns), "messages")


def _completion_prompt(prompt: object, model: ModelTokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return model.encode(prompt)
    vocab = model.vocab_size
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)
    ):
        return list(prompt)
    raise bad_request(
        "prompt",
        f"prompt must be a non-empty string or a list of token ids in [0, {vocab}) "
        "(one prompt per request)",
    )


def _generation(
    body: dict[str, Any], model: ModelTokenizer, prompt: list[int], prompt_field: str
) -> Generation:
    context = model.context_tokens
    if len(prompt) >= context:
        raise bad_request(
            prompt_field,
            f"{prompt_field}: {len(prompt)} tokens, but model {model.name!r} has a context of "
            f"{context} tokens and needs room for at least one output token",
            code="context_length_exceeded",
        )
    max_tokens = _int(body, "max_tokens", 1, context - len(prompt), optional=True)
    if body.get("n", 1) != 1:
        raise bad_request("n", "only n = 1 is served")
    options = body.get("stream_options") or {}
    return Generation(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        seed=_int(body, "seed", 0, MAX_SEED, optional=True),
        stream=_bool(body, "stream"),
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
    )


def _int(body: dict[str, Any], name: str, low: int, high: int, *, optional: bool) -> int | None:
    value = body.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise bad_request(name, f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _number(
    body: dict[str, Any],
    name: str,
    default: float,
    low: float,
    high: float,
    *,
    open_low: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (open_low and value <= low):
        bound = "(" if open_low else "["
        raise bad_request(name, f"{name} must be a number in {bound}{low}, {high}], got {value!r}")
    return float(value)


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise bad_request(name, f"{name} must be true or false, got {value!r}")
    return value

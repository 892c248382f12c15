"""vLLM 0.32's JSON bodies (chat, completions, errors, models) and the reply the wire layer sends."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from .config import FakeConfig
from .model import _POOL_SIZE, Completion, Prompt, _pool_slice, _uniforms, encode_text, make_prompt, natural_length


def _json(obj: Any) -> bytes:
    # What Starlette's JSONResponse writes.
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def chat_body(cfg: FakeConfig, request_id: str, prompt_ids: list[int], comp: Completion, return_ids: bool) -> dict:
    """`ChatCompletionResponse.model_dump()` of vLLM 0.32 (chat_completion/protocol.py, serving.py)."""
    n_prompt, n_out = len(prompt_ids), len(comp.token_ids)
    message = {
        "role": "assistant",
        "content": comp.content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": comp.reasoning,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": comp.finish_reason,
        "stop_reason": None,
        "token_ids": comp.token_ids if return_ids else None,
        "routed_experts": None,
    }
    usage = {
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + n_out,
        "completion_tokens": n_out,
        "prompt_tokens_details": None,
        "completion_tokens_details": {"reasoning_tokens": comp.reasoning_tokens} if cfg.reasoning else None,
    }
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": cfg.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids if return_ids else None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_choice(cfg: FakeConfig, request: dict, prompt: Prompt, k: int) -> tuple[str, str, str | None, list[int]]:
    """(text, finish_reason, stop_reason, token_ids) of choice ``k``: the script entry or a stream slice,
    cut at the first stop string (not included, as vLLM does), else at max_tokens (one token per 4 bytes)."""
    max_tokens, seed = request.get("max_tokens") or 16, request.get("seed")
    if cfg.completion_script:
        base = seed if seed is not None else int.from_bytes(prompt.digest[:4], "little")
        text = cfg.completion_script[(base + k) % len(cfg.completion_script)]
    else:
        sub = make_prompt(
            [{"role": "user", "content": prompt.last_user}, {"role": "choice", "content": f"{seed}:{k}"}], cfg.seed
        )
        text = _pool_slice(int(_uniforms(sub.digest)[3] * _POOL_SIZE), natural_length(cfg, sub, max_tokens))[1]
    stops = request.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    hits = sorted((text.find(s), s) for s in stops if s and s in text)
    if hits:
        text, finish, stop_reason = text[: hits[0][0]], "stop", hits[0][1]
    elif len(encode_text(text)) > max_tokens:
        text, finish, stop_reason = text.encode()[: 4 * max_tokens].decode(errors="ignore"), "length", None
    else:
        finish, stop_reason = "stop", None
    return text, finish, stop_reason, encode_text(text)


def completion_body(cfg: FakeConfig, prompt: Prompt, choices: list[tuple], return_ids: bool) -> dict:
    """`CompletionResponse.model_dump()` of vLLM 0.32 (completion/protocol.py)."""
    prompt_ids = encode_text(prompt.last_user)
    out = [
        {
            "index": k,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": stop,
            "token_ids": ids if return_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids if return_ids and k == 0 else None,
            "routed_experts": None,
        }
        for k, (text, finish, stop, ids) in enumerate(choices)
    ]
    n_out = sum(len(c[3]) for c in choices)
    usage = {
        "prompt_tokens": len(prompt_ids),
        "total_tokens": len(prompt_ids) + n_out,
        "completion_tokens": n_out,
        "prompt_tokens_details": None,
    }
    return {
        "id": f"cmpl-{os.urandom(8).hex()}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": cfg.model,
        "choices": out,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """vLLM's ErrorResponse (serve/engine/protocol.py); other codes typed by their phrase, as its HTTP handler does."""
    err_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def too_long_body(cfg: FakeConfig, n_chars: int) -> dict:
    """vLLM's renderers/params.py `_text_len_check` message, raised as a VLLMValidationError."""
    max_tokens = cfg.max_prompt_chars // 4
    message = (
        f"This model's maximum context length is {cfg.max_model_len} tokens. However, your prompt contains "
        f"{n_chars} characters (more than {cfg.max_prompt_chars} characters, which is the upper bound for "
        f"{max_tokens} input tokens). Please reduce the length of the input prompt. "
        f"(parameter=input_text, value={n_chars})"
    )
    return error_body(400, message, "input_text")


def models_body(cfg: FakeConfig) -> dict:
    now = int(time.time())
    permission = {
        "id": f"modelperm-{os.urandom(8).hex()}",
        "object": "model_permission",
        "created": now,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": cfg.model,
        "object": "model",
        "created": now,
        "owned_by": "vllm",
        "root": cfg.model,
        "parent": None,
        "max_model_len": cfg.max_model_len,
        "permission": [permission],
    }
    return {"object": "list", "data": [card]}


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    content_type: str = "application/json"


RESET = "reset"  # abort the connection with a TCP RST, no response
CLOSE = "close"  # close the connection (FIN), no response


def _json_reply(status: int, obj: Any, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(status, _json(obj), headers)

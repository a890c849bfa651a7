"""OpenAI-shaped response bodies: whole answers, stream chunks, usage and logprobs.

The engines report each generated token's logprobs as one entry {token, logprob, top: [(token, logprob)...],
offset} (engines.specialist); completions and chat completions shape them differently, as OpenAI does:
completions as parallel lists (tokens, token_logprobs, top_logprobs, text_offset), chat as one object per
token with its UTF-8 bytes.
"""
from __future__ import annotations

from actors.messages import Output


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: list[dict]) -> dict:
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [dict(e["top"]) for e in entries], "text_offset": [e["offset"] for e in entries]}


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[dict]) -> dict:
    return {"content": [{**_chat_token(e["token"], e["logprob"]),
                         "top_logprobs": [_chat_token(t, v) for t, v in e["top"]]} for e in entries],
            "refusal": None}


def choice(out: Output, chat: bool, logprobs: bool, first: bool = False, delta: bool = False) -> dict:
    """One choice: of a whole answer, or (delta) of a stream chunk; `first` chunk of a chat names the role."""
    lp = (chat_logprobs if chat else completion_logprobs)(out.logprobs) if logprobs else None
    if not chat:
        return {"text": out.text, "index": 0, "logprobs": lp, "finish_reason": out.finish_reason}
    if delta:
        body = {"role": "assistant", "content": out.text} if first else {"content": out.text}
        return {"index": 0, "delta": body, "logprobs": lp, "finish_reason": out.finish_reason}
    return {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
            "finish_reason": out.finish_reason}

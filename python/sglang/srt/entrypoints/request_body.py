"""Request bodies as the HTTP server accepts them: read with a size limit (413 before the body is
buffered) and parsed into JSON that every later step can handle (strict UTF-8, no lone
surrogates, bounded nesting, bounded integers, finite numbers). Anything else is a BadBody, which
the server turns into a 4xx; no client input reaches a 500 through here."""

from __future__ import annotations

import asyncio
import json
import math

MAX_JSON_DEPTH = 32
MAX_INT_DIGITS = 20  # token ids, seeds and lengths fit in int64; longer integers are garbage
# Bodies above this are parsed in a worker thread (with Python-level number hooks, so the
# interpreter can hand the GIL back to the event loop); smaller ones parse inline, in well
# under a millisecond.
OFF_LOOP_BYTES = 256 * 1024


class BadBody(ValueError):
    """The body cannot be a request. `status` is 400, or 413 when it is too large."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


async def read_body(request, max_bytes: int) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed `max_bytes`: from
    Content-Length before anything is read, otherwise while it streams in."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise BadBody(f"the request body has {declared} bytes, more than the limit of {max_bytes} "
                      "(--max-request-bytes)", 413)
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > max_bytes:
            raise BadBody(f"the request body exceeds the limit of {max_bytes} bytes (--max-request-bytes)", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise BadBody(f"an integer with {len(digits.lstrip('-'))} digits is not a valid value "
                      f"(at most {MAX_INT_DIGITS})")
    return int(digits)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadBody(f"the number {text[:40]} is out of range")
    return value


def _constant(name: str):
    raise BadBody(f"{name} is not valid JSON")


def parse_json(raw: bytes):
    """Parse a body; BadBody (400) for anything that is not strict, well-formed JSON within the
    limits above."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadBody(f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise BadBody(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except BadBody:
        raise
    except ValueError as e:  # JSONDecodeError, or a number the parser itself refuses
        raise BadBody(f"malformed JSON body: {e}") from None
    _check_tree(value)
    return value


def _check_tree(root) -> None:
    """Nesting depth and string encodability, iteratively (a recursive walk is what fails)."""
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadBody(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, dict):
            for key, value in node.items():
                _check_str(key)
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            for value in node:
                if isinstance(value, (dict, list, str)):
                    stack.append((value, depth + 1))
        elif isinstance(node, str):
            _check_str(node)


def _check_str(s: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadBody(f"a string holds a lone surrogate (\\u{ord(s[e.start]):04x}), which is not text") from None


async def parse_json_off_loop(raw: bytes):
    """parse_json, in a worker thread for large bodies so the event loop keeps serving."""
    if len(raw) <= OFF_LOOP_BYTES:
        return parse_json(raw)
    return await asyncio.to_thread(parse_json, raw)

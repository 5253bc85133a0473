"""HTTP server (aiohttp): SGLang-native /generate and the OpenAI-compatible API, all served
by one TokenizerManager. Bad input is a 400 with an OpenAI-style JSON error, decided before
anything reaches the scheduler; the request-shape mapping lives in openai_api.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time

from aiohttp import web

from sglang.srt.entrypoints import openai_api as oai
from sglang.srt.entrypoints.openai_api import APIError
from sglang.srt.entrypoints.request_body import OFF_LOOP_BYTES, BadBody, parse_json_off_loop, read_body
from sglang.srt.managers.io_struct import OutputsSoFar
from sglang.srt.managers.tokenizer_manager import (
    RequestError,
    SchedulerDiedError,
    ShuttingDownError,
    TokenizerManager,
)

logger = logging.getLogger(__name__)

MANAGER = web.AppKey("manager", TokenizerManager)
_NATIVE_KEYS = {"text", "input_ids", "sampling_params", "stream", "rid", "return_logprob", "top_logprobs_num"}
RETRY_AFTER_S = 5  # what a client is told to wait while the server drains for a restart


def error_response(status: int, message: str, type_: str = "invalid_request_error", code=None,
                   headers=None) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code or status}}
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    # Every failure becomes a JSON error; only a bug in this server is a 500.
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e.status, e.message, e.type, e.code)
    except BadBody as e:
        return error_response(e.status, str(e))
    except RequestError as e:
        return error_response(400, str(e))
    except ShuttingDownError as e:
        return error_response(503, str(e), "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
    except SchedulerDiedError as e:
        return error_response(503, str(e), "service_unavailable")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, e.reason or "error", "invalid_request_error")
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # noqa: BLE001
        logger.exception("internal error on %s", request.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error")


async def read_json(request: web.Request) -> tuple[dict, bool]:
    """The body as a JSON object, and whether it is large (then `prepare` runs off the event
    loop). A draining server refuses before reading."""
    manager = request.app[MANAGER]
    if manager.draining:
        raise ShuttingDownError("the server is shutting down")
    raw = await read_body(request, manager.server_args.max_request_bytes)
    body = await parse_json_off_loop(raw)
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body, len(raw) > OFF_LOOP_BYTES


async def prepare(request: web.Request, build):
    """`build(manager, body)` (tokenize, validate, build the request), for a large body in a
    worker thread: tokenizing or checking megabytes, and even freeing millions of parsed
    values, would otherwise stall every other client and /health."""
    manager = request.app[MANAGER]
    body, large = await read_json(request)
    if not large:
        return build(manager, body)

    def run():
        try:
            return build(manager, body)
        except Exception as e:  # noqa: BLE001 - handed to the loop, which raises it
            e.__traceback__ = e.__context__ = None  # drop the frames that hold the big values
            return e
        finally:
            body.clear()

    result = await asyncio.to_thread(run)
    if isinstance(result, Exception):
        raise result
    return result


# ---- streaming ---------------------------------------------------------------------------


async def _sse(request: web.Request, gen, chunks_of) -> web.StreamResponse:
    """Serve `gen` (TokenizerManager.generate) as server-sent events. `chunks_of(out)` turns
    one output into the JSON events to send. Headers go out only after the first output, so
    a request the scheduler rejects is still a plain HTTP error."""
    async with contextlib.aclosing(gen):
        first = await anext(gen)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        out = first
        try:
            while True:
                for event in chunks_of(out):
                    await resp.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())
                if out.finished:
                    break
                out = await anext(gen)
        except (RequestError, SchedulerDiedError, ShuttingDownError) as e:
            status, type_ = (400, "invalid_request_error") if isinstance(e, RequestError) else (503, "service_unavailable")
            err = {"error": {"message": str(e), "type": type_, "param": None, "code": status}}
            await resp.write(f"data: {json.dumps(err)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _collect(req, gen):
    """Run `gen` (request `req`'s outputs) to the end: the full text, the outputs so far (ids,
    and logprobs when asked) and the last output."""
    text, outs, last = [], OutputsSoFar(req.return_logprob, req.top_logprobs_num), None
    async with contextlib.aclosing(gen):
        async for out in gen:
            text.append(out.text)
            outs.add(out.output_ids, out.output_logprobs, out.output_top_logprobs)
            last = out
    return "".join(text), outs, last


# ---- SGLang-native ---------------------------------------------------------------------


def _meta_info(out, outs: OutputsSoFar) -> dict:
    return {
        "id": out.rid,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "finish_reason": out.finish_reason,
        **outs.meta_info(),
    }


def _native_request(manager: TokenizerManager, body: dict):
    unknown = sorted(set(body) - _NATIVE_KEYS)
    if unknown:
        raise APIError(f"unknown field(s): {', '.join(unknown)}")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise APIError("exactly one of text or input_ids is required")
    if text is not None:
        if not isinstance(text, str):
            raise APIError("text must be a string (batched requests are not supported)")
        if not text:
            raise APIError("text is empty: the prompt needs at least one token")
        input_ids = manager.tokenize(text)
    stream = oai.get_bool(body, "stream", False)
    return manager.build_request(input_ids, body.get("sampling_params"), stream, body.get("rid"),
                                 return_logprob=body.get("return_logprob", False),
                                 top_logprobs_num=body.get("top_logprobs_num", 0))


async def generate(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER]
    req, skip = await prepare(request, _native_request)
    stream = req.stream
    gen = manager.generate(req, skip)
    if not stream:
        text, outs, last = await _collect(req, gen)
        return web.json_response({"text": text, "output_ids": outs.ids, "meta_info": _meta_info(last, outs)})
    # Like SGLang: every event carries the text, ids (and logprobs) so far.
    acc_text, outs = [], OutputsSoFar(req.return_logprob, req.top_logprobs_num)

    def events(out):
        acc_text.append(out.text)
        outs.add(out.output_ids, out.output_logprobs, out.output_top_logprobs)
        return [{"text": "".join(acc_text), "output_ids": list(outs.ids), "meta_info": _meta_info(out, outs)}]

    return await _sse(request, gen, events)


# ---- OpenAI-compatible ------------------------------------------------------------------


def _openai_request(manager: TokenizerManager, body: dict, chat: bool):
    """(request, skip_special_tokens, model, include_usage, chat output spec) of a completions
    or chat body."""
    model = oai.check_model(body, manager)
    output = None
    if chat:
        input_ids, output = oai.chat_prompt_ids(body, manager)
    else:
        input_ids = oai.completion_prompt_ids(body, manager)
    sampling_params, skip = oai.sampling_params_of(body, chat)
    stream = oai.get_bool(body, "stream", False)
    include_usage = stream and oai.stream_include_usage(body)
    sampling_params["skip_special_tokens"] = skip
    want_logprobs, top_logprobs = oai.logprobs_of(body, chat)
    req, skip = manager.build_request(input_ids, sampling_params, stream, return_logprob=want_logprobs,
                                      top_logprobs_num=top_logprobs)
    return req, skip, model, include_usage, output


async def completions(request: web.Request) -> web.StreamResponse:
    return await _openai_generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _openai_generate(request, chat=True)


async def _openai_generate(request: web.Request, chat: bool):
    manager = request.app[MANAGER]
    req, skip, model, include_usage, output = await prepare(request, lambda m, body: _openai_request(m, body, chat))
    gen = manager.generate(req, skip)
    token_text = (lambda i: manager.tokenizer.decode([i], skip_special_tokens=False)) if req.return_logprob else None
    fmt = oai.ResponseFormatter(chat=chat, model=model, rid=req.rid, created=int(time.time()),
                                token_text=token_text, top_logprobs=req.top_logprobs_num, output=output)
    if not req.stream:
        text, outs, last = await _collect(req, gen)
        logprobs = fmt.logprobs(outs.ids, outs.logprobs, outs.top_logprobs, last.finish_reason)
        return web.json_response(fmt.response(text, last, logprobs))
    return await _sse(request, gen, lambda out: fmt.stream_events(out, include_usage))


def _model_card(request: web.Request) -> dict:
    manager = request.app[MANAGER]
    return {
        "id": manager.served_model_name,
        "object": "model",
        "created": int(request.app["started_at"]),
        "owned_by": "sglang",
        "root": manager.server_args.model_path,
        "max_model_len": manager.context_length,
    }


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


async def retrieve_model(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    card = _model_card(request)
    if model_id not in (card["id"], card["root"]):
        raise APIError(f"The model `{model_id}` does not exist.", status=404, code="model_not_found")
    return web.json_response(card)


# ---- status ------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    # The server only listens once the model is ready, so alive means ready.
    manager = request.app[MANAGER]
    if manager.dead:
        return error_response(503, manager.death_message, "service_unavailable")
    if manager.draining:
        return error_response(503, "the server is shutting down", "service_unavailable",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
    return web.json_response({"status": "ok"})


async def get_server_info(request: web.Request) -> web.Response:
    info = await request.app[MANAGER].get_server_info()
    return web.json_response(info, dumps=lambda o: json.dumps(o, default=str))


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition (srt/metrics.py); the schedulers' gauges are read per scrape."""
    body, content_type = await request.app[MANAGER].metrics_text()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def get_model_info(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    args = manager.server_args
    return web.json_response(
        {"model_path": args.model_path, "tokenizer_path": getattr(args, "tokenizer_path", None), "is_generation": True}
    )


def create_app(manager: TokenizerManager) -> web.Application:
    # read_body enforces --max-request-bytes with a clear 413; this is aiohttp's own backstop.
    app = web.Application(middlewares=[error_middleware], client_max_size=manager.server_args.max_request_bytes)
    app[MANAGER] = manager
    app["started_at"] = time.time()
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", retrieve_model)
    app.router.add_get("/health", health)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(manager: TokenizerManager, host: str, port: int, ready_message: str | None = None) -> int:
    """Serve until SIGINT/SIGTERM (exit code 0) or until the scheduler process dies (1).

    A signal drains: new requests (and /health) get 503 with Retry-After, in-flight requests
    may finish for up to --shutdown-timeout seconds, and streams still open then end with an
    error event and [DONE]; non-streaming ones get a 503."""
    loop = asyncio.get_running_loop()
    scheduler_died = manager.start_io(loop)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # request in the scheduler instead of finishing it for nobody.
    runner = web.AppRunner(create_app(manager), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        if ready_message:
            print(ready_message, flush=True)
        waiters = [loop.create_task(stop.wait()), loop.create_task(scheduler_died.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        if scheduler_died.is_set():
            logger.error("%s: shutting down the server", manager.death_message)
            await asyncio.sleep(0.5)  # let the in-flight error responses reach their clients
            return 1
        left = await manager.drain(manager.server_args.shutdown_timeout)
        logger.info("drained; %d request(s) still in flight were ended with an error", left)
        return 0
    finally:
        await runner.cleanup()

"""Tool calls and reasoning end to end on CPU: `launch_server` (dsv4-tiny) with scripted
outputs (SGLANG_TEST_SCRIPTED_OUTPUTS forces the ids a matching prompt generates), read by the
official `openai` client, streamed and not. The whole path runs: sampled ids -> detokenizer ->
reasoning / DSML parsing -> OpenAI shapes."""

import json
import os
import sys
from pathlib import Path

import pytest

from sglang.srt.tokenizer import ByteTokenizer
from sglang.test.server_process import ServerProcess, free_port

# the test extra's clients: without them this module skips instead of failing collection
openai = pytest.importorskip("openai", exc_type=ImportError)
requests = pytest.importorskip("requests", exc_type=ImportError)

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL = "dsv4-tiny"
TOK = ByteTokenizer(512)
D = "｜DSML｜"


def _call_block(*invokes: str) -> str:
    return f"<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


WEATHER_CALL = (f'<{D}invoke name="get_weather">\n'
                f'<{D}parameter name="city" string="true">Zürich</{D}parameter>\n'
                f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
                f"</{D}invoke>")
SEARCH_CALL = (f'<{D}invoke name="search">\n<{D}parameter name="q" string="true">两个 "w"</{D}parameter>\n'
               f'<{D}parameter name="f" string="false">{{"a": [1, true]}}</{D}parameter>\n</{D}invoke>')

# user text that selects a script -> the text the model is made to generate
SCRIPTS = {
    "case tools": "Let me look.\n\n" + _call_block(WEATHER_CALL, SEARCH_CALL),
    "case think": "The user asks for weather.</think>\n\n" + _call_block(WEATHER_CALL),
    "case cut": "Sure.\n\n" + _call_block(WEATHER_CALL),
    "case named": WEATHER_CALL.split('name="', 1)[1].split("\n", 1)[1] + f"\n</{D}tool_calls>",
    "case answer": "It is sunny in Zürich.",
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
WEATHER_ARGS = {"city": "Zürich", "days": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tool-calls")
    scripts = [{"prompt_contains": TOK.encode(k), "output": TOK.encode(v)} for k, v in SCRIPTS.items()]
    (tmp / "scripts.json").write_text(json.dumps(scripts))
    port = free_port()
    env = dict(os.environ, SGLANG_TEST_SCRIPTED_OUTPUTS=str(tmp / "scripts.json"),
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", MODEL, "--device", "cpu", "--port", str(port)]
    s = ServerProcess(cmd, port, tmp / "server.log", env).wait_ready(180, poll_s=0.25)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def _chat(client, case: str, stream: bool, **kw):
    kw.setdefault("tools", [WEATHER, SEARCH])
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": case}],
                                          max_tokens=kw.pop("max_tokens", 600), stream=stream, **kw)


def _fold_stream(chunks) -> tuple[dict, str]:
    """(message, finish_reason) accumulated from stream chunks, as an agent framework does."""
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            msg["content"] += delta.content or ""
            msg["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            for tc in delta.tool_calls or []:
                entry = msg["tool_calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert entry["id"] is None and entry["arguments"] == "", "id and name come first"
                    entry["id"], entry["name"] = tc.id, tc.function.name
                entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return msg, finish


def test_tool_calls_non_streamed(client):
    out = _chat(client, "case tools", stream=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name) for c in calls] == [("function", "get_weather"), ("function", "search")]
    assert json.loads(calls[0].function.arguments) == WEATHER_ARGS
    assert json.loads(calls[1].function.arguments) == {"q": '两个 "w"', "f": {"a": [1, True]}}
    assert calls[0].id != calls[1].id
    assert out.usage.completion_tokens == len(TOK.encode(SCRIPTS["case tools"])) + 1  # + EOS


def test_tool_calls_streamed_add_up_to_the_same_calls(client):
    msg, finish = _fold_stream(_chat(client, "case tools", stream=True))
    assert finish == "tool_calls" and msg["content"] == "Let me look."
    calls = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    assert [c["name"] for c in calls] == ["get_weather", "search"]
    assert json.loads(calls[0]["arguments"]) == WEATHER_ARGS


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_from_the_answer(client, stream):
    kw = {"extra_body": {"chat_template_kwargs": {"thinking": True}}}
    if not stream:
        message = _chat(client, "case think", stream=False, **kw).choices[0].message
        reasoning, content = message.model_extra["reasoning_content"], message.content
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    else:
        msg, _ = _fold_stream(_chat(client, "case think", stream=True, **kw))
        reasoning, content = msg["reasoning_content"], msg["content"] or None
        calls = [(c["name"], json.loads(c["arguments"])) for c in msg["tool_calls"].values()]
    assert reasoning == "The user asks for weather."
    assert content is None
    assert calls == [("get_weather", WEATHER_ARGS)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_block_cut_off_by_max_tokens_comes_back_as_content(client, stream):
    n = len(TOK.encode("Sure.\n\n" + _call_block(WEATHER_CALL))) - 10
    if not stream:
        choice = _chat(client, "case cut", stream=False, max_tokens=n).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
    else:
        msg, finish = _fold_stream(_chat(client, "case cut", stream=True, max_tokens=n))
        content, calls = msg["content"], list(msg["tool_calls"].values()) or None
    assert finish == "length" and calls is None
    assert content == TOK.decode(TOK.encode(SCRIPTS["case cut"])[:n])  # every generated token, as text


def test_a_named_tool_choice_starts_the_call_in_the_prompt(client):
    out = _chat(client, "case named", stream=False,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", WEATHER_ARGS)]


def test_a_conversation_continues_with_the_tool_result(client):
    first = _chat(client, "case tools", stream=False).choices[0].message
    call = first.tool_calls[0]
    messages = [{"role": "user", "content": "case tools"},
                {"role": "assistant", "content": first.content,
                 "tool_calls": [{"id": call.id, "type": "function",
                                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
                {"role": "user", "content": "case answer"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, SEARCH], max_tokens=100)
    assert out.choices[0].message.content == "It is sunny in Zürich."
    assert out.choices[0].finish_reason == "stop" and not out.choices[0].message.tool_calls


def test_tools_are_not_parsed_when_tool_choice_is_none(server):
    body = {"messages": [{"role": "user", "content": "case tools"}], "tools": [WEATHER], "tool_choice": "none",
            "max_tokens": 600}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=600)
    msg = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and "tool_calls" not in msg
    assert msg["content"] == SCRIPTS["case tools"]  # the text as generated

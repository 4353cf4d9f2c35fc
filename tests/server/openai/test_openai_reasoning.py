"""Reasoning output through the OpenAI frontend: a thinking model's <think>…</think> comes back
as `reasoning_content` (chat, whole and streamed) and as a reasoning item (Responses API).

Real parts: tiny Llamas exported in the test, one with a chat template that thinks (Qwen3's
conventions: `enable_thinking: false` closes an empty block in the prompt; here
`think_first: true` opens one, as DeepSeek-R1's does) and one with none; the real AsyncEngine;
the OpenAI app under uvicorn on loopback; the official `openai` client. Random weights write
random text, so the tests that need tags force them with a regex (guided_regex). One test runs
a scripted engine instead, for the one thing a regex cannot force: a Responses reply with both
reasoning and an answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from tokenserve.config import GenerationConfig, preset
from tokenserve.engine.outputs import CompletionOutput, FinishReason, RequestOutput

THINK_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>"
    "{% endif %}{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ {'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif think_first %}<think>\n{% endif %}{% endif %}"
)
"""A template that thinks, in few tokens (the tiny vocabulary spends one per 2-3 characters)."""
PLAIN_TEMPLATE = ("{% for message in messages %}<|{{ message.role }}|>{{ message.content }}"
                  "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "user", "content": "A city?"}]
WORDS = "[a-z]{2,6}( [a-z]{2,6}){1,3}"
ANSWER = "[A-Z][a-z]{2,8}[.]"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


def regex_literal(text: str) -> str:
    """`text` as a regex that matches only it (llguidance's syntax)."""
    return re.sub(r"([\\{}()\[\].*+?|^$])", r"\\\1", text)


def export_tiny(tokenizer, base, chat_template: str):
    from tokenserve.export.exporter import export_model
    from tokenserve.model import build_model

    # 512 positions: a tool call written out takes about 80 of the tiny vocabulary's tokens
    architecture = dataclasses.replace(preset("tiny-llama"), max_seq_len=512)
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, chat_template=chat_template,
                              name="tiny-thinking")
    return export_model(build_model(architecture, seed=0), tokenizer, config, base,
                        jit_compile=False)


class ScriptedEngine:
    """An EngineClient that writes the text of `pieces`, one output each, then stops."""

    def __init__(self, tokenizer, config: GenerationConfig, pieces: list[str]):
        self.tokenizer, self.config, self.pieces = tokenizer, config, pieces
        self.max_model_len = config.max_seq_len

    async def generate(self, prompt_ids, params, request_id, priority=0, timeout_s=None,
                       trace_context=None, final_only=False):
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield RequestOutput(request_id, list(prompt_ids), [CompletionOutput(
                0, piece, [1], None, FinishReason.STOP if last else None)], last,
                num_generated_tokens=i + 1)

    def abort(self, request_id: str) -> None:
        pass

    def is_ready(self) -> bool:
        return True


SCRIPT = ["<thi", "nk>\nA ci", "ty in Fra", "nce.\n</th", "ink>\n\nPar", "is."]


class Servers:
    """One engine per template and an OpenAI app per --reasoning_parser value, each under
    uvicorn on a loopback port, in a thread with its own event loop."""

    PARSERS = ("auto", "none", "deepseek_r1")

    def __init__(self, think_dir, plain_dir, tokenizer):
        self.socks = {name: socket.socket() for name in self.PARSERS}
        for sock in self.socks.values():
            sock.bind(("127.0.0.1", 0))
        self.urls = {name: f"http://127.0.0.1:{sock.getsockname()[1]}"
                     for name, sock in self.socks.items()}
        self._http: list = []
        self._started = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, daemon=True, args=(
            self._serve(think_dir, plain_dir, tokenizer),))
        self._thread.start()
        assert self._started.wait(300), "servers did not start"

    async def _serve(self, think_dir, plain_dir, tokenizer) -> None:
        import uvicorn

        from tokenserve.engine.async_engine import AsyncEngine
        from tokenserve.engine.config import EngineConfig
        from tokenserve.server.openai import OpenAIServerConfig, StaticModels, build_openai_app

        small = EngineConfig(max_num_seqs=4, block_size=4, precision="float32",
                             max_num_batched_tokens=64)
        think = AsyncEngine.from_model_dir(think_dir, small)
        plain = AsyncEngine.from_model_dir(plain_dir, small)
        scripted = ScriptedEngine(tokenizer, think.config, SCRIPT)
        models = StaticModels({"think": think, "plain": plain, "scripted": scripted})
        tasks = []
        for name, sock in self.socks.items():
            app = build_openai_app(models, OpenAIServerConfig(reasoning_parser=name))
            http = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
            self._http.append(http)
            tasks.append(asyncio.create_task(http.serve(sockets=[sock])))
        while not all(http.started for http in self._http):
            await asyncio.sleep(0.01)
        self._started.set()
        await asyncio.gather(*tasks)
        think.shutdown()
        plain.shutdown()

    def client(self, parser: str = "auto") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.urls[parser] + "/v1", api_key="none",
                             max_retries=0, timeout=120)

    def post(self, path: str, body: dict, parser: str = "auto") -> httpx.Response:
        return httpx.post(self.urls[parser] + path, json=body, timeout=120)

    def close(self) -> None:
        for http in self._http:
            http.should_exit = True
        self._thread.join(timeout=30)


@pytest.fixture(scope="module")
def servers(tokenizer, tmp_path_factory):
    served = Servers(export_tiny(tokenizer, tmp_path_factory.mktemp("think"), THINK_TEMPLATE),
                     export_tiny(tokenizer, tmp_path_factory.mktemp("plain"), PLAIN_TEMPLATE),
                     tokenizer)
    yield served
    served.close()


def chat(servers, parser: str = "auto", **body):
    return servers.client(parser).chat.completions.create(
        **{"model": "think", "messages": MESSAGES, "max_tokens": 80, "temperature": 1.0,
           "seed": 0, **body})


def streamed(servers, parser: str = "auto", **body) -> tuple[list[str], list[str], list]:
    """(reasoning deltas, content deltas, chunks) of a streamed chat."""
    chunks = list(chat(servers, parser, stream=True, **body))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    reasoning = [d.reasoning_content for d in deltas
                 if (d.model_extra or {}).get("reasoning_content") is not None]
    return reasoning, [d.content for d in deltas if d.content], chunks


def test_think_block_is_split_from_the_answer(servers, tokenizer):
    # the tags are several tokens each, so the stream really splits them
    assert len(tokenizer.encode("<think>")) > 1 and len(tokenizer.encode("</think>")) > 1
    regex = f"<think>\n{WORDS}\n</think>\n\n{ANSWER}"
    out = chat(servers, extra_body={"guided_regex": regex})
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert re.fullmatch(WORDS, message.reasoning_content), message
    assert re.fullmatch(ANSWER, message.content), message
    reasoning, content, _ = streamed(servers, extra_body={"guided_regex": regex})
    assert len(reasoning) > 1  # streamed as it comes, not at the end
    assert "".join(reasoning) == message.reasoning_content  # the same seed: the same reply
    assert "".join(content) == message.content


def test_a_reply_cut_off_while_thinking_is_all_reasoning(servers):
    regex = "<think>[a-z ]{60,80}</think>ok"
    out = chat(servers, max_tokens=12, extra_body={"guided_regex": regex})
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length"
    assert message.content is None
    assert re.fullmatch("[a-z ]+", message.reasoning_content.strip())
    reasoning, content, chunks = streamed(servers, max_tokens=12,
                                          extra_body={"guided_regex": regex})
    assert content == [] and "".join(reasoning) == message.reasoning_content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_reply_without_tags_is_all_content(servers):
    out = servers.post("/v1/chat/completions", {
        "model": "think", "messages": MESSAGES, "max_tokens": 20, "seed": 0,
        "temperature": 1.0, "guided_regex": ANSWER}).json()
    message = out["choices"][0]["message"]
    assert re.fullmatch(ANSWER, message["content"]) and "reasoning_content" not in message


def test_tool_calls_come_from_after_the_think_block(servers):
    thought = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    regex = regex_literal(f"<think>maybe {thought}</think>\n{call}")
    out = chat(servers, tools=TOOLS, max_tokens=200, extra_body={"guided_regex": regex})
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [{"city": "Paris"}]
    assert message.reasoning_content == f"maybe {thought}" and not message.content
    reasoning, content, chunks = streamed(servers, tools=TOOLS, max_tokens=200,
                                          extra_body={"guided_regex": regex})
    arguments = "".join(call.function.arguments or "" for chunk in chunks if chunk.choices
                        for call in chunk.choices[0].delta.tool_calls or ())
    assert json.loads(arguments) == {"city": "Paris"} and content == []
    assert "".join(reasoning) == message.reasoning_content


def test_a_template_that_does_not_think_gets_no_reasoning_field(servers):
    regex = "<think>[a-z]{3}</think>[a-z]{3}"
    body = {"model": "plain", "messages": MESSAGES, "max_tokens": 40, "guided_regex": regex}
    message = servers.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"].startswith("<think>")
    with httpx.stream("POST", servers.urls["auto"] + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert lines and not any("reasoning_content" in line for line in lines)


def test_reasoning_parser_none_and_a_named_parser(servers):
    regex = "<think>[a-z]{3}</think>[a-z]{3}"
    off = chat(servers, "none", extra_body={"guided_regex": regex}).choices[0].message
    assert off.content.startswith("<think>") and "reasoning_content" not in off.model_extra
    # deepseek_r1 parses every model's replies, this one's included
    named = chat(servers, "deepseek_r1", model="plain",
                 extra_body={"guided_regex": regex}).choices[0].message
    assert len(named.reasoning_content) == 3 and len(named.content) == 3


def test_chat_template_kwargs_reach_the_template(servers, tokenizer):
    def prompt(**body) -> str:
        ids = servers.post("/tokenize", {"model": "think", "messages": MESSAGES,
                                         **body}).json()["tokens"]
        return tokenizer.decode(ids, skip_special_tokens=False)

    assert prompt().endswith("<|assistant|>")
    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|assistant|><think>\n\n</think>\n\n")
    # a prompt that opens the block starts the reply in it: random text, no end tag
    out = chat(servers, max_tokens=6, temperature=0.0,
               extra_body={"chat_template_kwargs": {"think_first": True}})
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.content is None
    assert out.choices[0].message.reasoning_content
    # a prompt that closed it starts the reply in the answer, even under deepseek_r1
    out = chat(servers, "deepseek_r1", max_tokens=6, temperature=0.0,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.content and "reasoning_content" not in \
        out.choices[0].message.model_extra


@pytest.mark.parametrize("kwargs, param", [
    ([1], "chat_template_kwargs"), ("enable_thinking", "chat_template_kwargs"),
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt")])
def test_bad_chat_template_kwargs_are_refused(servers, kwargs, param):
    for path, body in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
        response = servers.post(path, {"model": "think", "messages": MESSAGES,
                                       "chat_template_kwargs": kwargs, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(param + ":")


def test_responses_reasoning_item_mirrors_chat(servers):
    client = servers.client()
    message = client.chat.completions.create(model="scripted", messages=MESSAGES).choices[0]
    assert (message.message.reasoning_content, message.message.content) == \
        ("A city in France.", "Paris.")
    response = client.responses.create(model="scripted", input="A city?")
    reasoning, answer = response.output
    assert reasoning.type == "reasoning" and reasoning.status == "completed"
    assert reasoning.content[0].text == "A city in France." and reasoning.summary == []
    assert answer.type == "message" and response.output_text == "Paris."
    events = list(client.responses.create(model="scripted", input="A city?", stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        "A city in France."
    done = [(e.item.type, e.output_index) for e in events
            if e.type == "response.output_item.done"]
    assert done == [("reasoning", 0), ("message", 1)]
    assert [e.output_index for e in events if e.type == "response.output_text.delta"] == \
        [1, 1]
    assert events[-1].response.output[1].content[0].text == "Paris."
    # a client that keeps the conversation itself sends the reasoning item back
    again = client.responses.create(model="scripted", store=False, input=[
        *[item.model_dump(exclude_none=True) for item in response.output],
        {"role": "user", "content": "And in Italy?"}])
    assert again.status == "completed"


def test_responses_cut_off_while_thinking_has_only_the_reasoning_item(servers):
    client = servers.client()
    # the template's generation prompt opens the block only on request; deepseek_r1 starts
    # every reply in it
    response = client.responses.create(model="plain", input="A city?", max_output_tokens=5,
                                       temperature=0.0)
    assert response.output[0].type == "message"  # auto: no reasoning for this template
    deep = servers.client("deepseek_r1")
    response = deep.responses.create(model="plain", input="A city?", max_output_tokens=5,
                                     temperature=0.0)
    assert response.status == "incomplete" and [item.type for item in response.output] == \
        ["reasoning"]
    assert response.output[0].status == "incomplete" and response.output[0].content[0].text
    events = list(deep.responses.create(model="plain", input="A city?", stream=True,
                                        max_output_tokens=5, temperature=0.0))
    assert events[-1].type == "response.incomplete"
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == \
        ["reasoning"]
    # logprobs would mix the reasoning's tokens into the message's: refused
    with pytest.raises(openai.BadRequestError, match="reasoning"):
        deep.responses.create(model="plain", input="A city?", max_output_tokens=5,
                              include=["message.output_text.logprobs"])


def test_unknown_reasoning_parser_fails_at_start():
    from tokenserve.errors import ConfigError
    from tokenserve.server.openai import OpenAIServerConfig

    with pytest.raises(ConfigError, match="--reasoning_parser 'r2' is not a reasoning parser"):
        OpenAIServerConfig(reasoning_parser="r2")
    result = subprocess.run([sys.executable, "-m", "tokenserve", "serve", "--port=0",
                             "--rest_api_port=0", "--openai_port=0", "--reasoning_parser=r2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "tokenserve serve: error: --reasoning_parser 'r2' is not a reasoning parser; use " \
           "one of auto, none, qwen3, deepseek_r1" in result.stderr

"""The bad-input matrix of docs/api.md, one test per row, against a real server process.

Every row runs while a well-formed stream is in flight on the same server, and checks that
the stream still completes (all its tokens, finish_reason, [DONE]) besides the row's own
status and message.
"""

from __future__ import annotations

import json
import threading

import grpc
import httpx
import pytest

from support.openai_harness import API_KEY, BUSY_MODEL, MAX_BODY_BYTES, MODEL
from support.paths import REPO_ROOT
from tokenserve.server.proto.tokenserve import generation_pb2 as pb

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "x", "max_tokens": 2}
HI = [{"role": "user", "content": "hi"}]
LONG_TEXT = "def add(a, b):\n    return a + b\n" * 40  # well over 128 tokens


def body(**changes):
    return {**OK, **changes}


# 1,000 levels of arrays: past Python's recursion limit in the JSON parser
NESTED = b'{"model": "tiny", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"


# (row id, path, request: json dict | raw bytes, headers override, status, message part)
HTTP_ROWS = [
    ("malformed-json", C, b'{"model": "tiny", "prompt": ', None, 400, "not valid JSON"),
    ("body-not-an-object", C, [1, 2], None, 400, "must be a JSON object"),
    ("wrong-type-temperature", C, body(temperature="hot"), None, 400,
     "temperature: Input should be a valid number"),
    ("wrong-type-max-tokens", C, body(max_tokens="10"), None, 400,
     "max_tokens: Input should be a valid integer"),
    ("wrong-type-messages", CHAT, {"model": MODEL, "messages": "hi"}, None, 400,
     "messages: Input should be a valid list"),
    ("missing-prompt", C, {"model": MODEL}, None, 400, "prompt: Field required"),
    ("wrong-type-prompt", C, body(prompt=[["a"], 5]), None, 400,
     "prompt must be a string, a list of strings, a list of token ids or a list of token-id "
     "lists."),
    ("unknown-harmless-field-ignored", C, body(my_field=1, user="u", store=False), None, 200,
     ""),
    ("tool-without-function", CHAT, {"model": MODEL, "messages": HI,
                                     "tools": [{"type": "function"}]}, None, 400,
     "tools.0.function: Field required"),
    ("response-format-bad-schema", CHAT, {"model": MODEL, "messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     None, 400, "invalid JSON schema: Invalid type: nope"),
    ("response-format-not-an-object", C, body(response_format="json_object"), None, 400,
     "response_format: Input should be a valid dictionary or instance of ResponseFormat"),
    ("response-format-unknown-type", C, body(response_format={"type": "xml"}), None, 400,
     "response_format.type: Input should be 'text', 'json_object' or 'json_schema'"),
    ("unsupported-logit-bias", C, body(logit_bias={"1": 5}), None, 400,
     "'logit_bias' is not supported"),
    ("unsupported-suffix", C, body(suffix="end"), None, 400, "'suffix' is not supported"),
    ("best-of-above-n", C, body(best_of=3), None, 400, "best_of must equal n"),
    ("echo-with-huge-logprobs", C, body(echo=True, logprobs=21), None, 400,
     "logprobs must be between 0 and 20"),
    ("image-content-part", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, None, 400,
     "messages.0.content.0: content of type 'image_url' is not supported"),
    ("function-role-message", CHAT, {"model": MODEL, "messages": [
        {"role": "function", "content": "x"}]}, None, 400, "role 'function' is not supported"),
    ("unknown-model", C, body(model="nope"), None, 404, "The model 'nope' does not exist."),
    ("unknown-version", C, body(model="tiny:7"), None, 404, "has version 1 only"),
    ("unknown-label", C, body(model="tiny@canary"), None, 404, "has no label 'canary'"),
    ("unknown-model-streamed", C, body(model="nope", stream=True), None, 404,
     "does not exist"),
    ("empty-prompt", C, body(prompt=""), None, 400, "prompt must not be empty"),
    ("empty-prompt-list", C, body(prompt=[]), None, 400, "prompt must not be empty"),
    ("empty-token-id-prompt", C, body(prompt=[[]]), None, 400, "prompt must not be empty"),
    ("empty-messages", CHAT, {"model": MODEL, "messages": []}, None, 400,
     "messages: List should have at least 1 item"),
    ("prompt-too-long", C, body(prompt=LONG_TEXT), None, 400,
     "maximum context length is 128 tokens"),
    ("chat-prompt-too-long", CHAT, {"model": MODEL, "messages": [
        {"role": "user", "content": LONG_TEXT}]}, None, 400, "maximum context length"),
    ("token-id-outside-vocabulary", C, body(prompt=[5, 99999]), None, 400,
     "token id 99999 is outside the vocabulary"),
    ("invalid-utf8-body", C, b'{"model": "tiny", "prompt": "\xff\xfe"}', None, 400,
     "not valid UTF-8"),
    ("lone-surrogate-prompt", C, b'{"model": "tiny", "prompt": "a\\ud800b"}', None, 400,
     "'prompt' is not valid UTF-8"),
    # a lone surrogate anywhere is refused as the body is read, naming the field: every
    # field below once reached code that could not encode it (a 500)
    ("lone-surrogate-model", C, b'{"model": "\\ud800", "prompt": "x"}', None, 400,
     "'model' is not valid UTF-8 text"),
    ("lone-surrogate-stop", C, b'{"model": "tiny", "prompt": "x", "stop": ["ok", "\\udfff"]}',
     None, 400, "'stop.1' is not valid UTF-8 text"),
    ("lone-surrogate-guided-choice", C,
     b'{"model": "tiny", "prompt": "x", "guided_choice": ["a", "\\ud800"]}', None, 400,
     "'guided_choice.1' is not valid UTF-8 text"),
    ("lone-surrogate-tool-schema", CHAT,
     b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
     b'"function", "function": {"name": "f", "parameters": {"type": "object", "properties": '
     b'{"a": {"type": "\\ud83d"}}}}}]}', None, 400,
     "'tools.0.function.parameters.properties.a.type' is not valid UTF-8 text"),
    ("lone-surrogate-tool-call-arguments", CHAT,
     b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
     b'"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '
     b'"\\ud800"}}]}]}', None, 400,
     "'messages.1.tool_calls.0.function.arguments' is not valid UTF-8 text"),
    ("lone-surrogate-key", C, b'{"model": "tiny", "prompt": "x", "top_p\\ud800": 1}', None, 400,
     "The body has a key that is not valid UTF-8 text"),
    ("lone-surrogate-responses-metadata-key", "/v1/responses",
     b'{"model": "tiny", "input": "hi", "metadata": {"k\\ud83d": "v"}}', None, 400,
     "'metadata' has a key that is not valid UTF-8 text"),
    ("surrogate-pair-is-text", C,
     b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 1}', None, 200, ""),
    ("escaped-backslash-is-text", C,
     b'{"model": "tiny", "prompt": "\\\\ud800", "max_tokens": 1}', None, 200, ""),
    ("max-tokens-zero", C, body(max_tokens=0), None, 400, "max_tokens must be at least 1"),
    ("max-tokens-negative", C, body(max_tokens=-5), None, 400,
     "max_tokens must be at least 1"),
    ("max-tokens-beyond-context", C, body(max_tokens=1000), None, 400,
     "maximum context length is 128 tokens"),
    ("max-completion-tokens-beyond-context", CHAT, {"model": MODEL, "messages": HI,
                                                    "max_completion_tokens": 1000}, None, 400,
     "maximum context length"),
    ("temperature-negative", C, body(temperature=-1.0), None, 400,
     "temperature must be in [0, 100]"),
    ("top-p-zero", C, body(top_p=0.0), None, 400, "top_p must be in (0, 1]"),
    ("top-p-above-one", C, body(top_p=1.5), None, 400, "top_p must be in (0, 1]"),
    ("huge-n", C, body(n=1000), None, 400, "n must be between 1 and 16"),
    ("huge-logprobs", C, body(logprobs=50), None, 400, "logprobs must be between 0 and 20"),
    ("top-logprobs-without-logprobs", CHAT, {"model": MODEL, "messages": HI,
                                             "top_logprobs": 2}, None, 400,
     "top_logprobs requires logprobs"),
    ("stream-options-without-stream", C, body(stream_options={"include_usage": True}), None,
     400, "stream_options is only allowed when stream is true"),
    ("seed-beyond-int64", C, body(seed=2**70), None, 400, "seed must be a 64-bit integer"),
    ("timeout-not-positive", C, body(timeout_s=-1.0), None, 400, "timeout_s must be positive"),
    ("huge-body", C, body(prompt="x" * (MAX_BODY_BYTES + 1)), None, 413,
     f"over the limit of {MAX_BODY_BYTES} bytes"),
    ("huge-body-chunked", C, "chunked", None, 413, f"over the limit of {MAX_BODY_BYTES} bytes"),
    ("missing-api-key", C, OK, {}, 401, "Missing API key"),
    ("wrong-api-key", C, OK, {"Authorization": "Bearer sk-wrong"}, 401,
     "Incorrect API key provided."),
    ("missing-api-key-models", "/v1/models", None, {}, 401, "Missing API key"),
    ("full-queue", C, body(model=BUSY_MODEL, prompt="def add(a, b):"), None, 429,
     "the queue is full"),
    ("full-queue-streamed", C, body(model=BUSY_MODEL, prompt="def add(a, b):", stream=True),
     None, 429, "the queue is full"),
    ("unknown-route", "/v1/audio/speech", OK, None, 404, "Not Found"),
    ("wrong-method", C, None, None, 405, "Method Not Allowed"),
    ("deeply-nested-json", C, NESTED, None, 400, "nested more than 64 levels deep"),
    ("deeply-nested-json-chat", CHAT, NESTED, None, 400, "nested more than 64 levels deep"),
    ("deeply-nested-json-tokenize", "/tokenize", NESTED, None, 400,
     "nested more than 64 levels deep"),
    ("deeply-nested-json-detokenize", "/detokenize", NESTED, None, 400,
     "nested more than 64 levels deep"),
    ("nan-in-body", C, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', None, 400,
     "NaN is not a JSON value"),
    ("prompt-longer-than-context-can-hold", C, body(prompt="x" * 60_000), None, 400,
     "However, your prompt has 60000 characters, more than 128 tokens can hold"),
    ("text-plain-body", C, ("text/plain", json.dumps(OK).encode()), None, 415,
     "Content-Type 'text/plain' is not supported"),
    ("form-encoded-body", C, ("application/x-www-form-urlencoded", b"prompt=x"), None, 415,
     "Content-Type 'application/x-www-form-urlencoded' is not supported"),
    ("text-part-without-text", CHAT, {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text"}]}]}, None, 400,
     "messages.0.content.0.text: a content part of type 'text' needs a 'text' string."),
    ("tokenize-empty-messages", "/tokenize", {"model": MODEL, "messages": []}, None, 400,
     "messages: List should have at least 1 item"),
    ("trailing-slash-without-key", C + "/", OK, {}, 401, "Missing API key"),
    ("trailing-slash", C + "/", OK, None, 404, "Not Found"),
    ("unknown-route-without-key", "/v1/audio/speech", OK, {}, 401, "Missing API key"),
    ("metrics-without-key", "/metrics", None, {}, 401, "Missing API key"),
    # int() refuses a literal of over 4,300 digits with a ValueError json.loads passes on
    ("integer-longer-than-python-reads", C,
     b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None, 400,
     "an integer of 5000 digits is longer than the 4300 this server reads"),
    ("guided-json-with-a-huge-integer", C,
     body(guided_json='{"type": "integer", "maximum": ' + "9" * 5000 + "}"), None, 400,
     "the JSON schema cannot be read: it has an integer longer than the 4300 digits"),
    ("guided-json-nested-too-deeply", C, body(guided_json="[" * 5000 + "]" * 5000), None,
     400, "the JSON schema cannot be read: it is nested too deeply"),
]


class GoodStream(threading.Thread):
    """A well-formed streamed completion of 40 tokens, read to its end in a thread."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server, self.started, self.lines, self.error = server, threading.Event(), [], None

    def run(self) -> None:
        request = {"model": MODEL, "prompt": "import os", "max_tokens": 40, "stream": True,
                   "ignore_eos": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", self.server.url + C, json=request, timeout=60,
                              headers=self.server.headers) as response:
                for line in response.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        except Exception as error:  # reported by check()
            self.error = error
        finally:
            self.started.set()

    def check(self) -> None:
        self.join(timeout=60)
        assert self.error is None and self.lines[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in self.lines[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 40
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def send(server, path, request, headers):
    all_headers = dict(server.headers if headers is None else headers)
    if request is None:
        return httpx.get(server.url + path, headers=all_headers, timeout=60)
    if request == "chunked":  # no Content-Length: the limit must hold while reading
        def chunks():
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(MAX_BODY_BYTES // 1024 + 1):
                yield b"x" * 1024
            yield b'"}'
        return httpx.post(server.url + path, content=chunks(), headers=all_headers, timeout=60)
    if isinstance(request, bytes):
        all_headers["Content-Type"] = "application/json"
        return httpx.post(server.url + path, content=request, headers=all_headers, timeout=60)
    if isinstance(request, tuple):  # (content type, raw body)
        all_headers["Content-Type"] = request[0]
        return httpx.post(server.url + path, content=request[1], headers=all_headers,
                          timeout=60)
    return httpx.post(server.url + path, json=request, headers=all_headers, timeout=60)


@pytest.mark.parametrize("row", HTTP_ROWS, ids=[row[0] for row in HTTP_ROWS])
def test_http_bad_input(server, row):
    _, path, request, headers, status, message = row
    good = GoodStream(server)
    good.start()
    good.started.wait(60)
    response = send(server, path, request, headers)
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert message in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
    good.check()


def test_a_lone_surrogate_is_refused_with_its_fields_path(server):
    request = (b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
               b'"text": "ok"}, {"type": "text", "text": "a\\udc00"}]}]}')
    error = send(server, CHAT, request, None).json()["error"]
    assert error["param"] == "messages.0.content.1.text"
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_utf8")


GRPC_OK = {"model": MODEL, "text": "x", "sampling": {"max_tokens": 2}}
# (row id, request fields, metadata override, status code, message part)
GRPC_ROWS = [
    ("unknown-model", {**GRPC_OK, "model": "nope"}, None, grpc.StatusCode.NOT_FOUND,
     "does not exist"),
    # the message quotes the name: cut, so the status fits the client's 16 KiB trailer limit
    ("unknown-model-with-a-huge-name", {**GRPC_OK, "model": "m" * 10_000}, None,
     grpc.StatusCode.NOT_FOUND, "mmm... (7980 more characters)"),
    ("huge-invalid-regex", {**GRPC_OK, "sampling": {"guided_regex": "(" * 10_000}}, None,
     grpc.StatusCode.INVALID_ARGUMENT, "more characters)"),
    ("no-prompt", {"model": MODEL}, None, grpc.StatusCode.INVALID_ARGUMENT, "needs a prompt"),
    ("empty-prompt", {**GRPC_OK, "text": ""}, None, grpc.StatusCode.INVALID_ARGUMENT,
     "prompt must not be empty"),
    ("prompt-too-long", {**GRPC_OK, "text": LONG_TEXT}, None,
     grpc.StatusCode.INVALID_ARGUMENT, "maximum context length is 128 tokens"),
    ("token-id-outside-vocabulary", {"model": MODEL, "token_ids": {"ids": [5, 99999]}}, None,
     grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    ("max-tokens-zero", {**GRPC_OK, "sampling": {"max_tokens": 0}}, None,
     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1"),
    ("max-tokens-beyond-context", {**GRPC_OK, "sampling": {"max_tokens": 1000}}, None,
     grpc.StatusCode.INVALID_ARGUMENT, "maximum context length"),
    ("temperature-negative", {**GRPC_OK, "sampling": {"temperature": -1.0}}, None,
     grpc.StatusCode.INVALID_ARGUMENT, "temperature must be in [0, 100]"),
    ("top-p-zero", {**GRPC_OK, "sampling": {"top_p": 0.0}}, None,
     grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    ("huge-n", {**GRPC_OK, "sampling": {"n": 1000}}, None, grpc.StatusCode.INVALID_ARGUMENT,
     "n must be between 1 and 16"),
    ("invalid-utf8-text", b"\n\x04tiny\x12\x02\xff\xfe", None,
     grpc.StatusCode.INVALID_ARGUMENT, "String field had bad UTF-8"),
    ("missing-api-key", GRPC_OK, (), grpc.StatusCode.UNAUTHENTICATED, "Missing API key"),
    ("wrong-api-key", GRPC_OK, (("authorization", "Bearer sk-wrong"),),
     grpc.StatusCode.UNAUTHENTICATED, "Incorrect API key"),
    ("full-queue", {**GRPC_OK, "model": BUSY_MODEL, "text": "def add(a, b):"}, None,
     grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full"),
]


@pytest.mark.parametrize("row", GRPC_ROWS, ids=[row[0] for row in GRPC_ROWS])
def test_grpc_bad_input(server, row):
    _, fields, metadata, code, message = row
    good = GoodStream(server)
    good.start()
    good.started.wait(60)
    if isinstance(fields, bytes):  # bytes the generated client would refuse to send
        request = fields
    else:
        fields = dict(fields)
        sampling = pb.SamplingOptions(**fields.pop("sampling", {}))
        if "token_ids" in fields:
            fields["token_ids"] = pb.TokenIds(**fields["token_ids"])
        request = pb.GenerateRequest(sampling=sampling, **fields).SerializeToString()
    with grpc.insecure_channel(server.grpc_target) as channel:
        generate = channel.unary_stream("/tokenserve.v1.GenerationService/Generate",
                                        response_deserializer=pb.GenerateResponse.FromString)
        auth = (("authorization", f"Bearer {API_KEY}"),) if metadata is None else metadata
        with pytest.raises(grpc.RpcError) as caught:
            list(generate(request, metadata=auth, timeout=60))
    assert caught.value.code() == code
    assert message in caught.value.details()
    good.check()


def test_the_documented_matrix_is_the_tested_one():
    """docs/api.md's tables list exactly these rows, in order, with these statuses."""
    import re

    doc = (REPO_ROOT / "docs" / "api.md").read_text()
    http = re.findall(r"^\| H(\d+) \| `([\w-]+)` \|[^|]*\| (\d+) \|", doc, re.M)
    assert [(int(n), rid, int(status)) for n, rid, status in http] == [
        (i + 1, row[0], row[4]) for i, row in enumerate(HTTP_ROWS)]
    grpc_rows = re.findall(r"^\| G(\d+) \| `([\w-]+)` \|[^|]*\| ([A-Z_]+) \|", doc, re.M)
    assert [(int(n), rid, code) for n, rid, code in grpc_rows] == [
        (i + 1, row[0], row[3].name) for i, row in enumerate(GRPC_ROWS)]

"""The Responses API with the official `openai` client against two real server processes
(`tokenserve serve`, tiny exported Llama) sharing one real redis-server for conversations
(--state_store) and KV blocks (--kv_store)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from support.openai_harness import export_tiny_model
from support.redis_server import RedisServer
from support.servables import free_port

KEY_A, KEY_B = "key-alice", "key-bob"
INSTRUCTIONS = "You write Python.\n" * 2  # full KV blocks shared by every turn (of 16)

pytestmark = pytest.mark.slow  # two server processes start: about 2 minutes on 2 cores


class Replica:
    """`tokenserve serve` with the OpenAI port, the Redis stores and two API keys."""

    def __init__(self, tmp, model_base, redis_url: str):
        self.port = free_port()
        self.log_path = tmp / f"replica-{self.port}.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tokenserve", "serve", f"--port={free_port()}",
             "--rest_api_port=0", f"--openai_port={self.port}", "--model_name=tiny",
             f"--model_base_path={model_base}", f"--kv_store={redis_url}",
             f"--state_store={redis_url}", f"--api_key={KEY_A}", f"--api_key={KEY_B}",
             "--precision=float32"],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"replica exited:\n{self.log_path.read_text()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(self.log_path.read_text())

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics",
                         headers={"Authorization": f"Bearer {KEY_A}"}).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{"))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    model_base = export_tiny_model(tmp / "tiny").parent
    redis = RedisServer(tmp)
    redis.start()
    pair = [Replica(tmp, model_base, redis.url) for _ in range(2)]
    try:
        for replica in pair:
            replica.wait_ready()
        yield pair
    finally:
        for replica in pair:
            replica.stop()
        redis.kill()


def create(client: openai.OpenAI, text: str, previous: str | None = None, **options):
    return client.responses.create(model="tiny", input=text, instructions=INSTRUCTIONS,
                                   previous_response_id=previous, temperature=0.0,
                                   max_output_tokens=6, **options)


def test_turn_two_on_replica_b_equals_a_single_process_conversation(replicas):
    a, b = replicas
    first = create(a.client(), "def add(a, b):")
    single = create(a.client(), "class Point:", previous=first.id)
    again = create(a.client(), "def add(a, b):")
    assert again.output_text == first.output_text
    other = create(b.client(), "class Point:", previous=again.id)  # another process
    assert other.output_text == single.output_text
    assert other.usage.input_tokens == single.usage.input_tokens
    assert other.previous_response_id == again.id and other.status in ("completed",
                                                                       "incomplete")
    assert b.metric("tokenserve:kv_store_hits_total") > 0  # B loaded A's blocks
    assert a.metric("vllm:prefix_cache_hits_total") > 0
    assert a.metric("vllm:prefix_cache_queries_total") >= a.metric(
        "vllm:prefix_cache_hits_total")
    # both replicas read and list the stored conversation
    assert b.client().responses.retrieve(single.id).output_text == single.output_text
    items = a.client().responses.input_items.list(other.id)
    assert [item.role for item in items.data] == ["user"]
    assert items.data[0].content[0].text == "class Point:"


def test_streaming_sends_typed_events_and_continues_across_replicas(replicas):
    a, b = replicas
    first = create(a.client(), "import os")
    expected = create(a.client(), "for item in items:", previous=first.id)
    events = list(create(b.client(), "for item in items:", previous=first.id, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert streamed == final.output_text == expected.output_text
    assert a.client().responses.retrieve(final.id).output_text == streamed  # it was stored


def test_one_api_key_cannot_read_or_continue_another_keys_response(replicas):
    a, b = replicas
    mine = create(a.client(KEY_A), "x = 1")
    with pytest.raises(openai.NotFoundError):
        b.client(KEY_B).responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        create(a.client(KEY_B), "y", previous=mine.id)
    with pytest.raises(openai.NotFoundError):
        a.client(KEY_B).responses.delete(mine.id)
    assert a.client(KEY_A).responses.retrieve(mine.id).id == mine.id


def test_unknown_previous_response_is_404_with_a_clear_message_and_delete_forgets(replicas):
    a, b = replicas
    with pytest.raises(openai.NotFoundError) as error:
        create(a.client(), "x", previous="resp_" + "0" * 48)
    assert "not found" in str(error.value)
    assert error.value.body["param"] == "previous_response_id"
    gone = create(a.client(), "x = 2")
    b.client().responses.delete(gone.id)
    with pytest.raises(openai.NotFoundError):
        a.client().responses.retrieve(gone.id)
    unstored = create(a.client(), "x = 3", store=False)
    with pytest.raises(openai.NotFoundError):
        a.client().responses.retrieve(unstored.id)

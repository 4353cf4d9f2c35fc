"""The browser UI of `tokenserve serve` in a real headless Chromium (Selenium): the playground
streams and stops for real, the dashboard draws the server's own numbers, a wrong API key shows
an error, the page works with keys off, and `--noui` serves nothing at `/`.

Screenshots land in a temporary folder, or in $TOKENSERVE_UI_SCREENSHOTS when set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.servables import free_port

KEY = "sk-ui-test"
MAX_TOKENS = 400  # the built-in model's context is 512 positions
DEADLINE_S = 60   # a bound on waits for the page or the server, not a timing assertion

def _start(tmp: Path, name: str, *flags: str) -> dict:
    port = free_port()
    log = open(tmp / f"{name}.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenserve", "serve", "--port=0", "--rest_api_port=0",
         f"--openai_port={port}", "--host=127.0.0.1", "--precision=float32",
         "--max_num_seqs=4", *flags],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    return {"url": f"http://127.0.0.1:{port}", "process": process, "log": tmp / f"{name}.log"}


def _wait_ready(server: dict) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert server["process"].poll() is None, server["log"].read_text()
        try:
            if httpx.get(server["url"] + "/ready").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"server not ready:\n{server['log'].read_text()}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three servers of the built-in model, started together: UI with an API key, UI without
    keys, and --noui."""
    tmp = tmp_path_factory.mktemp("ui-servers")
    started = {"keyed": _start(tmp, "keyed", f"--api_key={KEY}"),
               "open": _start(tmp, "open"),
               "noui": _start(tmp, "noui", "--noui")}
    try:
        for server in started.values():
            _wait_ready(server)
        yield started
    finally:
        for server in started.values():
            server["process"].terminate()
        for server in started.values():
            server["process"].wait(timeout=60)


@pytest.fixture(scope="module")
def browser():
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/test.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    folder = os.environ.get("TOKENSERVE_UI_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        return Path(folder)
    return tmp_path_factory.mktemp("ui-screenshots")


def wait_for(condition, what: str):
    """Polls `condition()` until it returns something truthy (returned), up to DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def open_page(driver, server: dict, key: str | None, view: str = "playground") -> None:
    """Loads the page with `key` in the API-key field (sessionStorage), models loaded."""
    driver.get(f"{server['url']}/#{view}")
    js(driver, "sessionStorage.clear()")
    if key is not None:
        js(driver, "sessionStorage.setItem('tokenserve.apiKey', arguments[0])", key)
    driver.refresh()
    wait_for(lambda: js(driver, "return document.getElementById('model').dataset.loaded"),
             "the model picker")


def set_field(driver, element_id: str, value) -> None:
    js(driver, "document.getElementById(arguments[0]).value = arguments[1]", element_id,
       str(value))


def reply_state(driver) -> dict:
    return js(driver, """
        const reply = [...document.querySelectorAll('.message')].pop();
        return reply && {state: reply.dataset.state || '',
                         text: reply.querySelector('.content').textContent,
                         tokens: reply.querySelectorAll('.token').length};""")


def stat(driver, name: str) -> str:
    return js(driver, "return document.getElementById(arguments[0]).textContent", f"stat-{name}")


def metric_sum(server: dict, name: str, **labels) -> float:
    """Sum of a series in the server's /metrics over all models and versions."""
    text = httpx.get(server["url"] + "/metrics",
                     headers={"Authorization": f"Bearer {KEY}"}).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def send_prompt(driver, prompt: str, max_tokens: int, mode: str = "chat",
                logprobs: bool = False) -> None:
    js(driver, "document.querySelector(`input[name=mode][value=${arguments[0]}]`).click()", mode)
    set_field(driver, "max_tokens", max_tokens)
    set_field(driver, "prompt", prompt)
    js(driver, "document.getElementById('ignore_eos').checked = true;"
               "document.getElementById('logprobs').checked = arguments[0]", logprobs)
    driver.find_element("id", "send").click()


def test_stats_snapshot_sums_models_and_keeps_buckets_cumulative():
    from prometheus_client import CollectorRegistry

    from tokenserve.observability.llm_metrics import LLMMetrics
    from tokenserve.server.ui.stats import metrics_snapshot
    from tokenserve.stats import RejectionStats, RequestStats, StepStats

    registry = CollectorRegistry()
    metrics = LLMMetrics(registry)
    assert metrics_snapshot(registry)["kv_cache_usage"] is None  # no step yet
    for version, running, usage in (("1", 2, 0.25), ("2", 1, 0.5)):
        metrics.on_step(StepStats(model="m", version=version, time=0.0, duration_s=0.01,
                                  num_running=running, num_waiting=1, num_batched_tokens=3,
                                  num_prefill_tokens=0, num_decode_tokens=3, cache_usage=usage))
        metrics.on_request(RequestStats(
            request_id=version, model="m", version=version, arrival_time=0.0,
            scheduled_time=0.0, first_token_time=0.03, finish_time=1.0,
            token_times=(0.03, 0.05, 0.07), num_prompt_tokens=5, num_generation_tokens=3,
            finish_reason="length"))
    metrics.on_rejection(RejectionStats(model="m", version="", reason="queue_full"))
    metrics.on_rejection(RejectionStats(model="m", version="", reason="invalid"))
    snapshot = metrics_snapshot(registry)
    assert (snapshot["num_running"], snapshot["num_waiting"]) == (3, 2)
    assert snapshot["kv_cache_usage"] == 0.5  # the fullest engine
    assert snapshot["num_generation_tokens"] == 6 and snapshot["num_prompt_tokens"] == 10
    assert snapshot["rejected"] == {"queue_full": 1, "invalid": 1}
    assert snapshot["finished"] == {"length": 2}
    ttft = snapshot["ttft"]
    assert ttft["le"][-1] == "+Inf" and ttft["counts"][-1] == 2
    assert ttft["counts"] == sorted(ttft["counts"])  # cumulative, as Prometheus buckets
    assert snapshot["itl"]["counts"][-1] == 4  # two gaps per request
    json.dumps(snapshot)  # what the route sends


def test_the_page_is_open_but_its_data_needs_the_key(servers):
    keyed = servers["keyed"]
    page = httpx.get(keyed["url"] + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert httpx.get(keyed["url"] + "/ui/static/main.js").status_code == 200
    assert httpx.get(keyed["url"] + "/ui/api/stats").status_code == 401
    stats = httpx.get(keyed["url"] + "/ui/api/stats",
                      headers={"Authorization": f"Bearer {KEY}"}).json()
    [model] = stats["models"]
    assert model["name"] == "builtin"
    assert model["model_version_status"][0]["state"] == "AVAILABLE"
    assert {"num_running", "num_waiting", "kv_cache_usage", "ttft", "itl"} <= set(
        stats["metrics"])


def test_noui_serves_nothing_at_the_root(servers):
    noui = servers["noui"]
    for path in ("/", "/ui/static/index.html", "/ui/api/stats"):
        assert httpx.get(noui["url"] + path).status_code == 404, path
    assert httpx.get(noui["url"] + "/v1/models").status_code == 200


def test_a_wrong_api_key_shows_the_error_not_a_blank_page(servers, browser, screenshots):
    open_page(browser, servers["keyed"], "sk-wrong")
    error = wait_for(lambda: js(browser, """const box = document.getElementById('error');
                                           return !box.hidden && box.textContent;"""),
                     "the error banner")
    assert "401" in error and "API key" in error
    assert browser.find_element("id", "send").is_displayed()
    browser.save_screenshot(str(screenshots / "error.png"))


def test_streamed_text_grows_before_it_finishes(servers, browser, screenshots):
    open_page(browser, servers["keyed"], KEY)
    models = js(browser, "return [...document.querySelectorAll('#model option')]"
                         ".map(o => o.value)")
    assert {"builtin", "builtin:1"} <= set(models)
    send_prompt(browser, "def fibonacci(n):", MAX_TOKENS, logprobs=True)
    lengths, deadline = [], time.monotonic() + DEADLINE_S
    while (reply := reply_state(browser))["state"] in ("", "streaming"):
        assert time.monotonic() < deadline, "the stream did not finish"
        if reply["text"] and (not lengths or len(reply["text"]) != lengths[-1]):
            lengths.append(len(reply["text"]))
    assert reply["state"] == "done", reply
    assert len(lengths) >= 3 and lengths == sorted(lengths), lengths  # seen growing
    assert len(reply["text"]) > lengths[0]
    assert reply["tokens"] > 0  # logprob heat: one span per streamed piece
    wait_for(lambda: stat(browser, "finish") == "length", "the finish reason")
    assert stat(browser, "completion") == str(MAX_TOKENS)
    assert int(stat(browser, "prompt")) > 0
    assert stat(browser, "ttft").endswith(" s") and float(stat(browser, "tps")) > 0
    assert js(browser, "return document.getElementById('error').hidden")
    browser.save_screenshot(str(screenshots / "playground.png"))


def test_stop_cancels_the_request_on_the_server(servers, browser):
    keyed = servers["keyed"]
    open_page(browser, keyed, KEY)
    aborted_before = metric_sum(keyed, "vllm:request_success_total", finished_reason="abort")
    for _ in range(3):  # a stream can finish before the click lands: then try again
        send_prompt(browser, "class Stack:", MAX_TOKENS, mode="completion")
        wait_for(lambda: reply_state(browser)["text"], "the first streamed text")
        browser.find_element("id", "stop-button").click()
        state = wait_for(lambda: reply_state(browser)["state"] in ("stopped", "done")
                         and reply_state(browser)["state"], "the stream to end")
        if state == "stopped":
            break
    assert state == "stopped"
    assert stat(browser, "finish").startswith("stopped")
    assert len(reply_state(browser)["text"]) > 0
    wait_for(lambda: metric_sum(keyed, "vllm:request_success_total",
                                finished_reason="abort") > aborted_before,
             "the server to abort the request")
    wait_for(lambda: metric_sum(keyed, "vllm:num_requests_running") == 0
             and metric_sum(keyed, "vllm:num_requests_waiting") == 0,
             "no running request on the server")


def test_dashboard_charts_have_data_after_traffic(servers, browser, screenshots):
    keyed = servers["keyed"]
    open_page(browser, keyed, KEY, view="dashboard")
    # two snapshots first, so the traffic below falls inside the page's window
    wait_for(lambda: int(js(browser, "return document.getElementById('chart-requests')"
                                     ".dataset.points || 0")) >= 1, "the first chart points")
    for prompt in ("def add(a, b):", "import os\n", "def add(a, b):"):
        response = httpx.post(keyed["url"] + "/v1/completions", timeout=120,
                              headers={"Authorization": f"Bearer {KEY}"},
                              json={"prompt": prompt, "max_tokens": 64, "ignore_eos": True})
        assert response.status_code == 200
    httpx.post(keyed["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
               json={"model": "no-such-model", "prompt": "x"})  # a refusal (404)

    def chart(name: str) -> dict:
        return js(browser, """const c = document.getElementById(arguments[0]);
            return {points: Number(c.dataset.points || 0), max: Number(c.dataset.max || 0),
                    latest: JSON.parse(c.dataset.latest || '[]')};""", f"chart-{name}")

    wait_for(lambda: chart("tps")["max"] > 0, "output tok/s")
    wait_for(lambda: chart("ttft")["latest"][:1] != [None] and chart("ttft")["points"],
             "TTFT percentiles")
    wait_for(lambda: chart("itl")["points"] > 0, "ITL percentiles")
    wait_for(lambda: chart("errors")["max"] > 0, "the refused request")
    for name in ("requests", "cache"):
        assert chart(name)["points"] > 0, name
    rows = js(browser, "return [...document.querySelectorAll('#models-table tbody tr')]"
                       ".map(r => [...r.cells].map(c => c.textContent))")
    assert ["builtin", "1", "AVAILABLE", "OK", ""] in rows
    browser.set_window_size(1400, 1100)  # the charts and the models table
    js(browser, "window.scrollTo(0, 0)")
    browser.save_screenshot(str(screenshots / "dashboard.png"))
    browser.set_window_size(1400, 1000)


def test_the_page_works_with_keys_off(servers, browser):
    server = servers["open"]
    open_page(browser, server, None)
    send_prompt(browser, "def add(a, b):", 16, mode="completion")
    wait_for(lambda: reply_state(browser)["state"] == "done", "the completion")
    assert reply_state(browser)["text"]
    assert js(browser, "return document.getElementById('error').hidden")
    assert stat(browser, "completion") == "16"
    browser.get(server["url"] + "/#dashboard")
    wait_for(lambda: js(browser, "return document.getElementById('dashboard-updated')"
                                 ".textContent.startsWith('Updated')"), "the dashboard")
    wait_for(lambda: json.loads(js(browser, "return document.getElementById('chart-requests')"
                                            ".dataset.latest || '[null]'"))[0] is not None,
             "the running-requests chart")

// The playground: chat and completion requests streamed over SSE, a Stop button that aborts
// the fetch (the server sees the disconnect and aborts the engine request), and per-response
// numbers measured in the browser: TTFT (send to first token), tok/s (tokens after the first
// over the time since the first), token counts from the server's usage, finish reason.
import { apiFetch, clearError, showError } from "./api.js";

const $ = (id) => document.getElementById(id);

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

// Server-sent events from a fetch body: yields each `data:` payload (parsed JSON).
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// Token heat: probability 1 is clear, lower probabilities redder.
function heat(logprob) {
  const p = Math.exp(logprob);
  return `rgba(220, 50, 47, ${(0.75 * (1 - p)).toFixed(3)})`;
}

export class Playground {
  constructor() {
    this.history = [];  // chat messages so far: [{role, content}]
    this.controller = null;
    $("send").addEventListener("click", () => this.send());
    $("stop-button").addEventListener("click", () => this.stop());
    $("clear").addEventListener("click", () => this.clear());
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) this.send();
    });
    for (const radio of document.querySelectorAll("input[name=mode]")) {
      radio.addEventListener("change", () => this.clear());
    }
    this.clear();
  }

  get mode() {
    return document.querySelector("input[name=mode]:checked").value;
  }

  async loadModels() {
    const select = $("model");
    const previous = select.value;
    try {
      const response = await apiFetch("/v1/models");
      const models = (await response.json()).data;
      select.replaceChildren(...models.map((model) => {
        const option = document.createElement("option");
        option.value = option.textContent = model.id;
        option.title = `max_model_len ${model.max_model_len}`;
        return option;
      }));
      if (models.some((model) => model.id === previous)) select.value = previous;
      select.dataset.loaded = "true";
    } catch (error) {
      select.replaceChildren();
      select.dataset.loaded = "false";
      showError(error);
    }
  }

  clear() {
    if (this.controller) this.stop();
    this.history = [];
    $("transcript").replaceChildren();
    $("system-row").hidden = this.mode !== "chat";
    for (const id of ["stat-ttft", "stat-tps", "stat-prompt", "stat-completion", "stat-finish"]) {
      $(id).textContent = "–";
    }
  }

  request(text) {
    const body = {
      model: $("model").value || undefined,
      stream: true,
      stream_options: { include_usage: true },
      temperature: numberField("temperature"),
      top_p: numberField("top_p"),
      top_k: numberField("top_k"),
      max_tokens: numberField("max_tokens"),
      seed: numberField("seed"),
    };
    const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
    if (stop.length) body.stop = stop;
    if ($("ignore_eos").checked) body.ignore_eos = true;
    const logprobs = $("logprobs").checked;
    if (this.mode === "chat") {
      const system = $("system").value.trim();
      body.messages = [...(system ? [{ role: "system", content: system }] : []),
        ...this.history, { role: "user", content: text }];
      if (logprobs) body.logprobs = true;
      return ["/v1/chat/completions", body];
    }
    body.prompt = text;
    if (logprobs) body.logprobs = 1;
    return ["/v1/completions", body];
  }

  message(role, text) {
    const box = document.createElement("div");
    box.className = `message ${role}`;
    const label = document.createElement("span");
    label.className = "role";
    label.textContent = role;
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    box.append(label, content);
    $("transcript").append(box);
    return box;
  }

  async send() {
    const text = $("prompt").value;
    if (this.controller || !text.trim()) return;
    clearError();
    const [path, body] = this.request(text);
    if (this.mode === "chat") {
      this.message("user", text);
      $("prompt").value = "";
    } else {
      this.message("prompt", text);
    }
    const reply = this.message(this.mode === "chat" ? "assistant" : "completion", "");
    const content = reply.querySelector(".content");
    reply.dataset.state = "streaming";
    this.controller = new AbortController();
    $("send").disabled = true;
    $("stop-button").disabled = false;
    this.clearStats();
    const sent = performance.now();
    let firstAt = null, lastAt = null, numChunks = 0, answer = "", finish = null, usage = null;
    try {
      const response = await apiFetch(path, {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body), signal: this.controller.signal,
      });
      for await (const chunk of events(response)) {
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        const piece = this.mode === "chat" ? (choice.delta && choice.delta.content) || ""
          : choice.text || "";
        if (piece) {
          lastAt = performance.now();
          if (firstAt === null) {
            firstAt = lastAt;
            $("stat-ttft").textContent = `${((firstAt - sent) / 1000).toFixed(3)} s`;
          }
          numChunks += 1;
          answer += piece;
          this.appendPiece(content, piece, this.logprobOf(choice));
          $("transcript").scrollTop = $("transcript").scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      reply.dataset.state = "done";
    } catch (error) {
      if (error.name === "AbortError") {
        finish = "stopped (request aborted)";
        reply.dataset.state = "stopped";
      } else {
        reply.dataset.state = "error";
        finish = finish || "error";
        showError(error);
      }
    } finally {
      this.controller = null;
      $("send").disabled = false;
      $("stop-button").disabled = true;
    }
    if (this.mode === "chat" && reply.dataset.state === "done") {
      this.history.push({ role: "user", content: text }, { role: "assistant", content: answer });
    }
    const numTokens = usage ? usage.completion_tokens : numChunks;
    if (numTokens > 1 && lastAt > firstAt) {
      $("stat-tps").textContent = ((numTokens - 1) / ((lastAt - firstAt) / 1000)).toFixed(1);
    }
    $("stat-prompt").textContent = usage ? usage.prompt_tokens : "–";
    $("stat-completion").textContent = usage ? usage.completion_tokens : `${numChunks} (streamed)`;
    $("stat-finish").textContent = finish || "–";
  }

  logprobOf(choice) {
    const logprobs = choice.logprobs;
    if (!logprobs) return null;
    const values = this.mode === "chat" ? (logprobs.content || []).map((t) => t.logprob)
      : logprobs.token_logprobs || [];
    const known = values.filter((v) => typeof v === "number");
    return known.length ? known.reduce((a, b) => a + b, 0) : null;  // joint log-prob
  }

  appendPiece(content, piece, logprob) {
    if (logprob === null) {
      content.append(piece);
      return;
    }
    const span = document.createElement("span");
    span.className = "token";
    span.textContent = piece;
    span.style.backgroundColor = heat(logprob);
    span.title = `p = ${Math.exp(logprob).toFixed(3)} (logprob ${logprob.toFixed(3)})`;
    content.append(span);
  }

  clearStats() {
    for (const id of ["stat-ttft", "stat-tps", "stat-prompt", "stat-completion", "stat-finish"]) {
      $(id).textContent = "…";
    }
  }

  stop() {
    if (this.controller) this.controller.abort();
  }
}

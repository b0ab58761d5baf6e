// The playground: a chat over /v1/chat/completions, streamed, with live figures from the answer
// (time to first token, tokens/s) and from /metrics (running and waiting requests, KV cache).
// Plain DOM and fetch: the page must work offline, served by the package alone.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];
let controller = null;

function headers() {
  const out = {"content-type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) out.authorization = "Bearer " + key;
  return out;
}

function addTurn(role, text) {
  const node = document.createElement("div");
  node.className = "turn " + role;
  node.textContent = text;
  $("conversation").append(node);
  return node;
}

async function loadModels() {
  try {
    const answer = await fetch("/v1/models", {headers: headers()});
    const models = (await answer.json()).data || [];
    $("model").replaceChildren(...models.map((m) => new Option(m.id, m.id)));
  } catch (error) {
    $("status").textContent = "Could not list models: " + error;
  }
}

// Reads an SSE body and calls onEvent with each data payload (parsed), until [DONE].
async function readEvents(body, onEvent) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  return {
    model: $("model").value || undefined,
    messages: messages.concat(history),
    temperature: parseFloat($("temperature").value),
    top_p: parseFloat($("top-p").value),
    max_tokens: parseInt($("max-tokens").value, 10),
    stream: true,
    stream_options: {include_usage: true},
  };
}

async function send(event) {
  event.preventDefault();
  const text = $("message").value.trim();
  if (!text || controller) return;
  $("message").value = "";
  history.push({role: "user", content: text});
  addTurn("user", text);
  const turn = addTurn("assistant", "");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const start = performance.now();
  let first = null;
  let tokens = 0;
  try {
    const answer = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!answer.ok) throw new Error((await answer.json()).error.message);
    await readEvents(answer.body, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (!piece) continue;
        if (first === null) {
          first = performance.now();
          $("ttft").textContent = ((first - start) / 1000).toFixed(3) + " s";
        }
        turn.textContent += piece;
        tokens += 1;
      }
      const seconds = first === null ? 0 : (performance.now() - first) / 1000;
      if (seconds > 0) $("tokens-per-s").textContent = (tokens / seconds).toFixed(1);
    });
    history.push({role: "assistant", content: turn.textContent});
    $("status").textContent = `${tokens} tokens in ${((performance.now() - start) / 1000).toFixed(2)} s`;
  } catch (error) {
    turn.classList.add("error");
    turn.textContent += (turn.textContent ? "\n" : "") + "[" + error.message + "]";
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    turn.dataset.done = "true";
  }
}

function metric(text, name) {
  const match = text.match(new RegExp("^pagedserve:" + name + "\\{[^}]*\\} (\\S+)$", "m"));
  return match ? parseFloat(match[1]) : null;
}

async function refreshFigures() {
  try {
    const answer = await fetch("/metrics", {headers: headers()});
    if (!answer.ok) return;
    const text = await answer.text();
    const show = (id, value, format) => { if (value !== null) $(id).textContent = format(value); };
    show("running", metric(text, "num_requests_running"), (v) => v.toFixed(0));
    show("waiting", metric(text, "num_requests_waiting"), (v) => v.toFixed(0));
    show("kv-cache", metric(text, "kv_cache_usage_perc"), (v) => (100 * v).toFixed(1) + " %");
    show("generated", metric(text, "generation_tokens_total"), (v) => v.toFixed(0));
    document.body.dataset.figures = String(Number(document.body.dataset.figures || 0) + 1);
  } catch (error) {
    $("status").textContent = "metrics: " + error;
  }
}

$("composer").addEventListener("submit", send);
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { history.length = 0; $("conversation").replaceChildren(); });
$("message").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) send(e); });
$("api-key").addEventListener("change", loadModels);
loadModels();
refreshFigures();
setInterval(refreshFigures, 1000);

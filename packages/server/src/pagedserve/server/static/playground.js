// The playground: a chat over /v1/chat/completions, streamed, with live figures from the answer
// (time to first token, tokens/s) and from /metrics (running and waiting requests, KV cache).
// A reasoning model's thinking (reasoning_content, with --reasoning-parser) streams into a
// collapsed "Thinking" section above the answer; tool calls (with tools given as JSON in the
// settings) are shown under it, each call's name and arguments as they arrive. An attached
// image goes with the message as an image_url part (a data: URL; the server fetches nothing),
// for a model that takes images; the figures count the images the vision encoder ran on.
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

function addTurn(role, text, imageUrl) {
  const node = document.createElement("div");
  node.className = "turn " + role;
  node.textContent = text;
  if (imageUrl) {
    const picture = document.createElement("img");
    picture.src = imageUrl;
    picture.alt = "attached image";
    node.prepend(picture);
  }
  $("conversation").append(node);
  return node;
}

// The attached file as a data: URL (null when none is attached).
function attachedImage() {
  const file = $("image").files[0];
  if (!file) return Promise.resolve(null);
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// An assistant turn: its thinking (created collapsed on the first thought), its answer, and
// its tool calls, each filled in as the stream delivers them.
class AssistantTurn {
  constructor() {
    this.node = addTurn("assistant", "");
    this.answer = document.createElement("div");
    this.answer.className = "answer";
    this.node.append(this.answer);
    this.thinking = null;
    this.calls = [];
  }

  think(text) {
    if (!this.thinking) {
      const details = document.createElement("details");
      details.className = "reasoning";
      const summary = document.createElement("summary");
      summary.textContent = "Thinking";
      this.thinking = document.createElement("div");
      this.thinking.className = "reasoning-text";
      details.append(summary, this.thinking);
      this.node.prepend(details);
    }
    this.thinking.textContent += text;
  }

  say(text) { this.answer.textContent += text; }

  call(delta) {
    let call = this.calls[delta.index];
    if (!call) {
      const node = document.createElement("pre");
      node.className = "tool-call";
      this.node.append(node);
      call = this.calls[delta.index] = {id: delta.id, name: "", arguments: "", node};
    }
    const fn = delta.function || {};
    if (fn.name) call.name = fn.name;
    if (fn.arguments) call.arguments += fn.arguments;
    call.node.textContent = `${call.name}(${call.arguments})`;
  }

  // The turn as the conversation history sends it back (the thinking is not sent back).
  message() {
    const message = {role: "assistant", content: this.answer.textContent};
    if (this.calls.length) {
      message.tool_calls = this.calls.map((c) => (
        {id: c.id, type: "function", function: {name: c.name, arguments: c.arguments}}));
    }
    return message;
  }

  fail(message) {
    this.node.classList.add("error");
    this.say((this.answer.textContent ? "\n" : "") + "[" + message + "]");
  }
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
  const body = {
    model: $("model").value || undefined,
    messages: messages.concat(history),
    temperature: parseFloat($("temperature").value),
    top_p: parseFloat($("top-p").value),
    max_tokens: parseInt($("max-tokens").value, 10),
    stream: true,
    stream_options: {include_usage: true},
  };
  const tools = $("tools").value.trim();
  if (tools) {  // a list of OpenAI function tools
    body.tools = JSON.parse(tools);
    body.tool_choice = $("tool-choice").value;
  }
  return body;
}

async function send(event) {
  event.preventDefault();
  const text = $("message").value.trim();
  if (!text || controller) return;
  const imageUrl = await attachedImage();
  $("message").value = "";
  $("image").value = "";
  const content = imageUrl
    ? [{type: "text", text}, {type: "image_url", image_url: {url: imageUrl}}]
    : text;
  history.push({role: "user", content});
  addTurn("user", text, imageUrl);
  const turn = new AssistantTurn();
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
        const delta = choice.delta || {};
        const thought = delta.reasoning_content || delta.reasoning;
        if (!thought && !delta.content && !delta.tool_calls) continue;
        if (first === null) {
          first = performance.now();
          $("ttft").textContent = ((first - start) / 1000).toFixed(3) + " s";
        }
        if (thought) turn.think(thought);
        if (delta.content) turn.say(delta.content);
        for (const call of delta.tool_calls || []) turn.call(call);
        tokens += 1;
      }
      const seconds = first === null ? 0 : (performance.now() - first) / 1000;
      if (seconds > 0) $("tokens-per-s").textContent = (tokens / seconds).toFixed(1);
    });
    history.push(turn.message());
    $("status").textContent = `${tokens} tokens in ${((performance.now() - start) / 1000).toFixed(2)} s`;
  } catch (error) {
    turn.fail(error.message);
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    turn.node.dataset.done = "true";
  }
}

function metric(text, name) {
  const match = text.match(new RegExp("^pagedserve:" + name + "\\{[^}]*\\} (\\S+)$", "m"));
  return match ? parseFloat(match[1]) : null;
}

// Every tier's value of a tier-labelled series (the KV connector's), as "ram 96 · disk 40".
function byTier(text, name) {
  const pattern = new RegExp("^pagedserve:" + name + "\\{[^}]*tier=\"(\\w+)\"[^}]*\\} (\\S+)$", "gm");
  const parts = [...text.matchAll(pattern)].map((m) => m[1] + " " + parseFloat(m[2]).toFixed(0));
  return parts.length ? parts.join(" · ") : null;
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
    show("kv-hits", byTier(text, "kv_connector_hit_tokens_total"), (v) => v);
    const encoded = metric(text, "encoder_cache_encoded_total");
    const hits = metric(text, "encoder_cache_hits_total");
    if (encoded !== null && hits !== null) $("images").textContent = `${encoded} / ${hits}`;
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

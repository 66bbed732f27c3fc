// The chat view: a conversation with the served model, streamed from /v1/chat/completions.
// Stop aborts the request (the server sees the client leave and the engine frees it).

import { api, events } from "./api.js";

const $ = (id) => document.getElementById(id);
const SAMPLING = [["temperature", "temperature"], ["top_p", "top-p"], ["max_tokens", "max-tokens"]];

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export class Chat {
  constructor() {
    this.turns = []; // the conversation as sent: {role, content}
    this.pictures = []; // data: URLs that go with the next message, as image_url parts
    this.controller = null; // aborts the reply in flight
    this.list = $("messages");
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.send();
      }
    });
    $("attach").addEventListener("change", async (e) => {
      for (const file of e.target.files) this.pictures.push(await dataUrl(file));
      e.target.value = "";
      this.showAttached();
    });
    $("stop").addEventListener("click", () => this.controller?.abort());
    $("regenerate").addEventListener("click", () => this.regenerate());
    $("new-chat").addEventListener("click", () => this.clear());
  }

  setModels(models) {
    $("model").replaceChildren(...models.map((m) => new Option(m, m)));
  }

  showError(message) {
    this.list.append(el("p", "msg error", message));
  }

  send() {
    const text = $("prompt").value;
    if (!text.trim() || this.controller) return;
    $("prompt").value = "";
    const pictures = this.pictures.map((url) => ({ type: "image_url", image_url: { url } }));
    this.turns.push({ role: "user", content: pictures.length ? [...pictures, { type: "text", text }] : text });
    const bubble = el("div", "msg user");
    for (const url of this.pictures) bubble.append(thumbnail(url));
    bubble.append(el("p", "", text));
    this.list.append(bubble);
    this.pictures = [];
    this.showAttached();
    this.reply();
  }

  showAttached() {
    $("attached").replaceChildren(...this.pictures.map(thumbnail));
    $("attached").hidden = this.pictures.length === 0;
  }

  regenerate() {
    if (this.controller) return;
    if (this.turns.at(-1)?.role === "assistant") this.turns.pop();
    const last = this.list.lastElementChild;
    if (last?.classList.contains("assistant")) last.remove(); // the reply, or the error in its place
    if (this.turns.length) this.reply();
  }

  clear() {
    this.controller?.abort();
    this.turns = [];
    this.pictures = [];
    this.showAttached();
    this.list.replaceChildren();
    this.busy(false);
    $("prompt").focus();
  }

  request() {
    const system = $("system").value.trim();
    const body = {
      model: $("model").value || undefined,
      messages: [...(system ? [{ role: "system", content: system }] : []), ...this.turns],
      stream: true,
      stream_options: { include_usage: true },
    };
    for (const [field, id] of SAMPLING) {
      if ($(id).value !== "") body[field] = Number($(id).value); // empty: the server's default
    }
    return body;
  }

  async reply() {
    const turns = this.turns; // a new conversation started meanwhile keeps none of this reply
    const reply = new Reply(this.list);
    this.controller = new AbortController();
    this.busy(true);
    try {
      const response = await api("/v1/chat/completions",
        { method: "POST", body: this.request(), signal: this.controller.signal });
      for await (const chunk of events(response)) reply.add(chunk);
      reply.end("done");
    } catch (e) {
      if (e.name === "AbortError") reply.end("stopped");
      else reply.fail(e.message);
    } finally {
      if (reply.content) turns.push({ role: "assistant", content: reply.content });
      this.controller = null;
      this.busy(false);
    }
  }

  busy(on) {
    $("send").hidden = on;
    $("stop").hidden = !on;
    $("regenerate").disabled = on || this.turns.length === 0;
  }
}

// One assistant reply as it streams: its text, its reasoning (apart, collapsed), its figures.
class Reply {
  constructor(list) {
    this.list = list;
    this.node = el("div", "msg assistant");
    this.node.dataset.state = "streaming";
    this.body = el("div", "content");
    this.stats = el("p", "stats");
    this.node.append(this.body, this.stats);
    list.append(this.node);
    this.content = "";
    this.reasoning = "";
    this.usage = null;
    this.finish = null;
    this.started = performance.now();
    this.first = null; // when the first token came
  }

  add(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    const choice = chunk.choices?.[0];
    if (!choice) return;
    this.finish = choice.finish_reason ?? this.finish;
    const { content, reasoning_content: reasoning } = choice.delta ?? {};
    if (content || reasoning) this.first ??= performance.now();
    if (reasoning) this.showReasoning(reasoning);
    if (content) {
      this.content += content;
      render(this.body, this.content);
    }
    this.follow();
  }

  showReasoning(text) {
    if (!this.thought) {
      const details = el("details", "reasoning");
      this.thought = el("div");
      details.append(el("summary", "", "Reasoning"), this.thought);
      this.node.prepend(details);
    }
    this.reasoning += text;
    this.thought.textContent = this.reasoning;
  }

  end(state) {
    this.node.dataset.state = state;
    const done = performance.now();
    const figures = [];
    if (this.first !== null) figures.push(`TTFT ${Math.round(this.first - this.started)} ms`);
    if (this.usage) {
      const tokens = this.usage.completion_tokens;
      const seconds = (done - this.first) / 1000; // decode speed: the tokens after the first
      if (tokens > 1 && seconds > 0) figures.push(`${((tokens - 1) / seconds).toFixed(1)} tok/s`);
      figures.push(`${tokens} tokens`, `${this.usage.prompt_tokens_details?.cached_tokens ?? 0} cached`);
    }
    if (state === "stopped") figures.push("stopped");
    else if (this.finish === "length") figures.push("cut at max tokens");
    this.stats.textContent = figures.join(" · ");
  }

  fail(message) {
    this.node.dataset.state = "error";
    if (!this.content) this.body.remove();
    this.stats.replaceWith(el("p", "error", message));
  }

  follow() {
    const list = this.list;
    if (list.scrollHeight - list.scrollTop - list.clientHeight < 80) list.scrollTop = list.scrollHeight;
  }
}

// Fenced code blocks (``` ... ```, also while the fence is still open) as <pre><code>, `inline`
// code as <code>, the rest as text. Built as nodes, never as HTML: the model's text is not markup.
function thumbnail(url) {
  const img = el("img", "thumbnail");
  img.src = url;
  img.alt = "attached picture";
  return img;
}

function dataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

export function render(node, text) {
  const parts = [];
  let at = 0;
  for (const m of text.matchAll(/```([^\n`]*)\n?([\s\S]*?)(?:```|$)/g)) {
    parts.push(prose(text.slice(at, m.index)));
    const code = el("code", "", m[2]);
    if (m[1].trim()) code.dataset.lang = m[1].trim();
    const pre = el("pre");
    pre.append(code);
    parts.push(pre);
    at = m.index + m[0].length;
  }
  parts.push(prose(text.slice(at)));
  node.replaceChildren(...parts.filter(Boolean));
}

// Text around code blocks, without the blank lines that set them apart (the blocks do that).
function prose(text) {
  text = text.replace(/^\n+|\s+$/g, "");
  if (!text) return null;
  const p = el("p");
  text.split(/(`[^`\n]+`)/).forEach((piece, i) => p.append(i % 2 ? el("code", "", piece.slice(1, -1)) : piece));
  return p;
}

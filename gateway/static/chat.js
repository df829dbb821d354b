// The chat page: conversations kept in this browser (localStorage), answers streamed from
// /v1/chat/completions, the prefix cache's numbers from /v1/cache/stats. No build step, no CDN.
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const STORE = "prefixgate.chats";
const CURRENT = "prefixgate.current";
const KEY = "prefixgate.key";
const SAMPLING = ["temperature", "top_p", "max_tokens", "seed"];
const CACHE_REFRESH_MS = 2000;

let chats = load(STORE, []);
let current = localStorage.getItem(CURRENT);
let model = null;
let controller = null;  // the request streaming now (the stop button aborts it)

function load(name, fallback) {
  try { return JSON.parse(localStorage.getItem(name)) ?? fallback; } catch { return fallback; }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(chats));
  localStorage.setItem(CURRENT, current ?? "");
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function askKey() {
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function currentChat() {
  return chats.find((c) => c.id === current);
}

function newChat() {
  const id = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
  chats.unshift({ id, title: "New chat", system: "", messages: [] });
  current = id;
  save();
  render();
}

// ---- drawing

function render() {
  const list = $("chats");
  list.replaceChildren(...chats.map((c) => {
    const item = document.createElement("li");
    item.classList.toggle("current", c.id === current);
    const open = document.createElement("button");
    open.className = "open";
    open.type = "button";
    open.textContent = c.title;
    open.addEventListener("click", () => { current = c.id; save(); render(); });
    const remove = document.createElement("button");
    remove.className = "delete";
    remove.type = "button";
    remove.title = "Delete this chat";
    remove.textContent = "×";
    remove.addEventListener("click", () => {
      chats = chats.filter((other) => other.id !== c.id);
      if (current === c.id) current = chats[0]?.id ?? null;
      save();
      if (!chats.length) newChat(); else render();
    });
    item.append(open, remove);
    return item;
  }));
  const chat = currentChat();
  $("system").value = chat?.system ?? "";
  $("messages").replaceChildren(...(chat?.messages ?? []).map(messageElement));
  $("messages").scrollTop = $("messages").scrollHeight;
}

function messageElement(message) {
  const el = document.createElement("div");
  el.className = `message ${message.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role;
  const body = document.createElement("div");
  body.className = "body";
  if (message.role === "assistant") body.append(renderMarkdown(message.content));
  else body.textContent = message.content;
  el.append(role, body);
  if (message.stats) {
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = message.stats;
    el.append(stats);
  }
  return el;
}

let painting = false;

function paintLast(message) {  // at most once a frame while tokens stream in
  if (painting) return;
  painting = true;
  requestAnimationFrame(() => {
    painting = false;
    const last = $("messages").lastElementChild;
    if (last) last.replaceWith(messageElement(message));
    $("messages").scrollTop = $("messages").scrollHeight;
  });
}

function statsLine(usage, sent, first, end, stopped) {
  const parts = [];
  if (usage) {
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    parts.push(`prompt ${usage.prompt_tokens} tokens`, `cached ${cached}`);
  }
  if (first !== null) parts.push(`TTFT ${((first - sent) / 1000).toFixed(2)} s`);
  if (usage && first !== null && end > first && usage.completion_tokens > 1) {
    parts.push(`${((usage.completion_tokens - 1) / ((end - first) / 1000)).toFixed(1)} tokens/s`);
  }
  if (stopped) parts.push("stopped");
  return parts.join(" · ");
}

// ---- talking to the server

async function* serverEvents(response) {
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
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function sampling() {
  const fields = {};
  for (const name of SAMPLING) {
    const raw = $(name).value.trim();
    if (raw !== "") fields[name] = Number(raw);
  }
  return fields;
}

async function send(text) {
  const chat = currentChat();
  chat.system = $("system").value;
  chat.messages.push({ role: "user", content: text });
  if (chat.title === "New chat") chat.title = text.slice(0, 40);
  const reply = { role: "assistant", content: "", stats: "" };
  chat.messages.push(reply);
  save();
  render();
  showError("");
  const history = chat.messages.slice(0, -1).map(({ role, content }) => ({ role, content }));
  const messages = chat.system ? [{ role: "system", content: chat.system }, ...history] : history;
  const body = { model, messages, stream: true, stream_options: { include_usage: true }, ...sampling() };
  controller = new AbortController();
  setBusy(true);
  const sent = performance.now();
  let first = null;
  let usage = null;
  let stopped = false;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      if (response.status === 401) askKey();
      const error = await response.json().catch(() => ({}));
      throw new Error(error.error?.message ?? `HTTP ${response.status}`);
    }
    for await (const event of serverEvents(response)) {
      if (event.error) throw new Error(event.error.message);
      const delta = event.choices?.[0]?.delta?.content;
      if (delta) {
        first ??= performance.now();
        reply.content += delta;
        paintLast(reply);
      }
      if (event.usage) usage = event.usage;
    }
  } catch (error) {
    if (error.name === "AbortError") stopped = true;
    else showError(error.message);
  } finally {
    reply.stats = statsLine(usage, sent, first, performance.now(), stopped);
    controller = null;
    setBusy(false);
    save();
    render();
    refreshCache();
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function formatBytes(bytes) {
  return bytes >= 2 ** 30 ? `${(bytes / 2 ** 30).toFixed(1)} GiB` : `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}

async function refreshCache() {
  if (!model || document.visibilityState !== "visible") return;  // (no model yet: waiting for a key)
  try {
    const response = await fetch("/v1/cache/stats", { headers: headers() });
    if (!response.ok) return;
    const s = await response.json();
    $("cache-tenant").textContent = s.tenant;
    $("cache-hit-rate").textContent = `${(100 * s.hit_rate).toFixed(1)} %`;
    $("cache-tokens").textContent = `${s.cached_tokens} / ${s.prompt_tokens}`;
    $("cache-used").textContent = `${s.kv_blocks.used} / ${s.kv_blocks.total}`;
    $("cache-cached").textContent = String(s.kv_blocks.cached);
    $("cache-free").textContent = String(s.kv_blocks.free);
    $("cache-evicted").textContent = String(s.evicted_blocks);
    $("cache-disk").textContent = s.disk ? `${s.disk.blocks} blocks, ${formatBytes(s.disk.bytes)}` : "off";
  } catch {
    // the server restarting: the next refresh tries again
  }
}

async function start() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) {
    askKey();
    return;
  }
  model = (await response.json()).data[0].id;
  $("model-name").textContent = model;
  if (!currentChat()) {
    if (chats.length) current = chats[0].id; else newChat();
  }
  render();
  refreshCache();
}

// ---- wiring

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller || !model) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("new-chat").addEventListener("click", newChat);
$("system").addEventListener("change", () => {
  const chat = currentChat();
  if (chat) { chat.system = $("system").value; save(); }
});
$("key-form").addEventListener("submit", () => {
  localStorage.setItem(KEY, $("key-input").value.trim());
  start();
});
setInterval(refreshCache, CACHE_REFRESH_MS);
start();

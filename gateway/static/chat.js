// The chat page: conversations kept in this browser (localStorage), answers streamed from
// /v1/chat/completions, the prefix cache's numbers from /v1/cache/stats. No build step, no CDN.
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const STORE = "prefixgate.chats";
const CURRENT = "prefixgate.current";
const KEY = "prefixgate.key";
const SETTINGS = "prefixgate.settings";  // the sampling fields, kept across reloads
const SAMPLING = ["temperature", "top_p", "max_tokens", "seed"];
const EXPORT_FORMAT = "prefixgate.chats";
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

function newId() {
  return `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
}

function newChat() {
  chats.unshift({ id: newId(), title: "New chat", system: "", messages: [] });
  current = chats[0].id;
  save();
  render();
}

function button(className, text, title, onClick) {
  const el = document.createElement("button");
  el.type = "button";
  el.className = className;
  el.textContent = text;
  if (title) el.title = title;
  el.addEventListener("click", onClick);
  return el;
}

// ---- drawing

function render() {
  $("chats").replaceChildren(...chats.map(chatItem));
  const chat = currentChat();
  $("system").value = chat?.system ?? "";
  $("topbar-title").textContent = chat?.title ?? "";
  const messages = chat?.messages ?? [];
  $("messages").replaceChildren(...messages.map((m, index) => messageElement(m, index, messages.length)));
  $("messages").scrollTop = $("messages").scrollHeight;
}

function chatItem(chat) {
  const item = document.createElement("li");
  item.classList.toggle("current", chat.id === current);
  const open = button("open", chat.title, chat.title, () => {
    current = chat.id;
    document.body.classList.remove("sidebar-open");
    save();
    render();
  });
  const rename = button("rename", "✎", "Rename this chat", () => renameChat(item, open, chat));
  const remove = button("delete", "×", "Delete this chat", () => {
    chats = chats.filter((other) => other.id !== chat.id);
    if (current === chat.id) current = chats[0]?.id ?? null;
    save();
    if (!chats.length) newChat(); else render();
  });
  item.append(open, rename, remove);
  return item;
}

function renameChat(item, open, chat) {
  const input = document.createElement("input");
  input.className = "title-input";
  input.value = chat.title;
  input.setAttribute("aria-label", "Chat title");
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    if (keep && input.value.trim()) chat.title = input.value.trim();
    save();
    render();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
  open.replaceWith(input);
  input.focus();
  input.select();
}

function messageElement(message, index, count) {
  const el = document.createElement("div");
  el.className = `message ${message.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role;
  const body = document.createElement("div");
  body.className = "body";
  if (message.role === "assistant") {
    body.append(renderMarkdown(message.content));
    for (const pre of body.querySelectorAll("pre")) {
      const code = pre.querySelector("code").textContent;
      pre.prepend(button("copy-code", "Copy", "Copy this code", (event) => copyText(code, event.target)));
    }
  } else {
    body.textContent = message.content;
  }
  el.append(role, body, actions(message, index, count, el));
  if (message.stats) {
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = message.stats;
    el.append(stats);
  }
  return el;
}

function actions(message, index, count, el) {
  const bar = document.createElement("div");
  bar.className = "actions";
  bar.append(button("copy", "Copy", "Copy this message", (event) => copyText(message.content, event.target)));
  if (message.role === "user") {
    bar.append(button("edit", "Edit", "Edit this message and answer it again", () => editBox(el, index)));
  } else if (index === count - 1) {
    bar.append(button("regenerate", "Regenerate", "Answer the last message again", regenerate));
  }
  return bar;
}

function editBox(el, index) {
  if (controller) return;
  const chat = currentChat();
  const box = document.createElement("div");
  box.className = "edit-box";
  const text = document.createElement("textarea");
  text.value = chat.messages[index].content;
  text.rows = Math.min(10, text.value.split("\n").length + 1);
  text.setAttribute("aria-label", "Edited message");
  const saveButton = button("save", "Save & send", "Replace this message and answer it again", () => {
    const content = text.value.trim();
    if (!content || controller) return;
    chat.messages[index].content = content;
    chat.messages.splice(index + 1);  // the edit replaces what followed it (no branches)
    answer(chat);
  });
  box.append(text, saveButton, button("cancel", "Cancel", "", render));
  el.querySelector(".body").replaceWith(box);
  el.querySelector(".actions").remove();
  text.focus();
}

async function copyText(text, target) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {  // no Clipboard API outside a secure context (http:// on another host than localhost)
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const label = target.textContent;
  target.textContent = "Copied";
  setTimeout(() => { target.textContent = label; }, 1500);
}

let painting = false;

function paintLast(message) {  // at most once a frame while tokens stream in
  if (painting) return;
  painting = true;
  requestAnimationFrame(() => {
    painting = false;
    const list = $("messages");
    const last = list.lastElementChild;
    if (last) last.replaceWith(messageElement(message, list.children.length - 1, list.children.length));
    list.scrollTop = list.scrollHeight;
  });
}

// usage: the server's (null when stopped: it comes with the last chunk); tokens: counted from the stream
function statsLine(usage, tokens, sent, first, end, stopped) {
  const parts = [];
  if (usage) {
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    parts.push(`prompt ${usage.prompt_tokens} tokens`, `cached ${cached}`);
  }
  const generated = usage?.completion_tokens ?? tokens;
  parts.push(`answer ${generated} token${generated === 1 ? "" : "s"}`);
  if (first !== null) parts.push(`TTFT ${((first - sent) / 1000).toFixed(2)} s`);
  if (first !== null && end > first && generated > 1) {
    parts.push(`${((generated - 1) / ((end - first) / 1000)).toFixed(1)} tokens/s`);
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

function send(text) {
  const chat = currentChat();
  chat.system = $("system").value;
  chat.messages.push({ role: "user", content: text });
  if (chat.title === "New chat") chat.title = text.slice(0, 40);
  answer(chat);
}

function regenerate() {
  const chat = currentChat();
  if (controller || chat.messages.at(-1)?.role !== "assistant") return;
  chat.messages.pop();
  answer(chat);
}

// Streams an answer to the chat's messages as they are, into a new last message.
async function answer(chat) {
  const reply = { role: "assistant", content: "", stats: "" };
  chat.messages.push(reply);
  save();
  render();
  showError("");
  const history = chat.messages.slice(0, -1).map(({ role, content }) => ({ role, content }));
  const messages = chat.system ? [{ role: "system", content: chat.system }, ...history] : history;
  // logprobs: one entry per generated token, so a stopped answer still knows how many it got
  const body = { model, messages, stream: true, stream_options: { include_usage: true }, logprobs: true,
                 ...sampling() };
  controller = new AbortController();
  setBusy(true);
  const sent = performance.now();
  let first = null;
  let usage = null;
  let tokens = 0;
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
      const choice = event.choices?.[0];
      tokens += choice?.logprobs?.content?.length ?? 0;
      if (choice?.delta?.content) {
        first ??= performance.now();
        reply.content += choice.delta.content;
        paintLast(reply);
      }
      if (event.usage) usage = event.usage;
    }
  } catch (error) {
    if (error.name === "AbortError") stopped = true;
    else showError(error.message);
  } finally {
    reply.stats = statsLine(usage, tokens, sent, first, performance.now(), stopped);
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
  document.body.classList.toggle("busy", busy);
}

// ---- export and import (JSON)

function exportChat() {
  const chat = currentChat();
  if (!chat) return;
  const data = { format: EXPORT_FORMAT, version: 1, chats: [chat] };
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
  link.download = `${chat.title.replace(/[^\w.-]+/g, "_").slice(0, 60) || "chat"}.json`;
  link.click();
  URL.revokeObjectURL(link.href);
}

function importedChat(raw) {  // only the fields the page uses, as text: an imported file is not trusted
  const messages = Array.isArray(raw?.messages) ? raw.messages : [];
  return {
    id: newId(),
    title: String(raw?.title ?? "Imported chat").slice(0, 200),
    system: String(raw?.system ?? ""),
    messages: messages.filter((m) => ["user", "assistant"].includes(m?.role))
      .map((m) => ({ role: m.role, content: String(m.content ?? ""), stats: String(m.stats ?? "") })),
  };
}

async function importChats(file) {
  try {
    const data = JSON.parse(await file.text());
    if (data?.format !== EXPORT_FORMAT || !Array.isArray(data.chats)) {
      throw new Error("not a chat exported from this page");
    }
    const added = data.chats.map(importedChat);
    chats.unshift(...added);
    current = added[0]?.id ?? current;
    save();
    render();
    showError("");
  } catch (error) {
    showError(`Import failed: ${error.message}`);
  }
}

// ---- the cache panel

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
    $("cache-free-empty").textContent = String(s.kv_blocks.free_empty);
    $("cache-free-cached").textContent = String(s.kv_blocks.free_cached);
    $("cache-evicted").textContent = String(s.evicted_blocks);
    $("cache-disk").textContent = s.disk ? `${s.disk.blocks} blocks, ${formatBytes(s.disk.bytes)}` : "off";
  } catch {
    // the server restarting: the next refresh tries again
  }
}

// ---- settings kept across reloads

function restoreSettings() {
  const saved = load(SETTINGS, {});
  for (const name of SAMPLING) {
    if (typeof saved[name] === "string") $(name).value = saved[name];
  }
}

function saveSettings() {
  localStorage.setItem(SETTINGS, JSON.stringify(Object.fromEntries(SAMPLING.map((n) => [n, $(n).value]))));
}

async function start() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) {
    askKey();
    return;
  }
  const card = (await response.json()).data[0];
  model = card.id;
  $("model-name").textContent = model;
  const cap = card.sampling_defaults?.max_tokens;  // what a request without max_tokens gets
  $("max_tokens").placeholder = cap ? `server default ${cap}` : "rest of the context";
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
$("export").addEventListener("click", exportChat);
$("import").addEventListener("click", () => $("import-file").click());
$("import-file").addEventListener("change", (event) => {
  if (event.target.files[0]) importChats(event.target.files[0]);
  event.target.value = "";
});
$("system").addEventListener("change", () => {
  const chat = currentChat();
  if (chat) { chat.system = $("system").value; save(); }
});
for (const name of SAMPLING) $(name).addEventListener("input", saveSettings);
for (const [toggle, open] of [["toggle-sidebar", "sidebar-open"], ["toggle-cache", "cache-open"]]) {
  $(toggle).addEventListener("click", () => {  // the phone layout: one panel at a time over the chat
    const opened = !document.body.classList.contains(open);
    document.body.classList.remove("sidebar-open", "cache-open");
    document.body.classList.toggle(open, opened);
    $("toggle-sidebar").setAttribute("aria-expanded", String(document.body.classList.contains("sidebar-open")));
    $("toggle-cache").setAttribute("aria-expanded", String(document.body.classList.contains("cache-open")));
  });
}
$("key-form").addEventListener("submit", () => {
  localStorage.setItem(KEY, $("key-input").value.trim());
  start();
});
restoreSettings();
setInterval(refreshCache, CACHE_REFRESH_MS);
start();

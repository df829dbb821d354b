// The chat page: conversations kept in this browser (localStorage, one entry per chat, so that tabs open at once
// keep each other's), answers streamed from /v1/chat/completions, the prefix cache's numbers from
// /v1/cache/stats. No build step, no CDN.
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const STORE = "prefixgate.chats";  // the single list of chats an earlier page kept: moved to CHAT_PREFIX entries
const CHAT_PREFIX = "prefixgate.chat.";
const CURRENT = "prefixgate.current";
const KEY = "prefixgate.key";
const SETTINGS = "prefixgate.settings";  // the sampling fields, kept across reloads
const SAMPLING = ["temperature", "top_p", "max_tokens", "seed"];
const EXPORT_FORMAT = "prefixgate.chats";
const CACHE_REFRESH_MS = 2000;
const START_RETRY_MS = 2000;
const RETRY_MAX_MS = 16000;  // the server away: each failed try waits twice as long as the one before, up to this
const CACHE_TIMEOUT_MS = 10000;  // a stats fetch the server has not answered by then counts as failed
const PARTIAL_SAVE_MS = 1000;  // a streaming answer is saved this often, so a reload keeps what came
const LIVE_MS = 5 * PARTIAL_SAVE_MS;  // an answer another tab saved this recently still streams there

let chats = loadChats();
let current = localStorage.getItem(CURRENT);
let model = null;
let serverCap = null;  // the card's max_tokens for a request that sets none, sent as it is (null: none sent)
const streams = new Map();  // chat id -> the AbortController of the answer streaming into it (Stop aborts it)
let resendAfterKey = false;  // a message refused for want of a key: answered once a key is given
let notReady = false;  // the server answered /v1/models with an error: start() tries again
let startDelay = START_RETRY_MS;
let cacheTimer = null;
let cacheDelay = CACHE_REFRESH_MS;
let cacheFetching = false;  // one stats fetch at a time: the next is timed from when it settles
let cacheAgain = false;  // a refresh asked for while one was fetching: done as that one settles

function load(name, fallback) {
  try { return JSON.parse(localStorage.getItem(name)) ?? fallback; } catch { return fallback; }
}

function loadChats() {
  const found = [];
  for (let i = 0; i < localStorage.length; i++) {
    const name = localStorage.key(i);
    const chat = name.startsWith(CHAT_PREFIX) ? load(name, null) : null;
    if (chat?.id) found.push({ ...chat, messages: answered(chat.messages) });
  }
  const older = load(STORE, []);
  const moving = (Array.isArray(older) ? older : []).filter((c) => c?.id && !found.some((f) => f.id === c.id))
    .map((chat, i) => ({ ...chat, messages: answered(chat.messages), updated: chat.updated ?? Date.now() - i }));
  found.push(...moving);
  // the old list goes only once every chat of it has an entry of its own (a full storage keeps it, and says so)
  if (Array.isArray(older) && older.length && moving.every(store)) localStorage.removeItem(STORE);
  return found.sort((a, b) => (b.updated ?? 0) - (a.updated ?? 0));
}

// without the empty answers the server never gave (a closed page's, or a refused request's from an earlier page:
// their stats have no usage); one the model gave empty stays
function answered(messages) {
  const unstarted = (m) => m.role === "assistant" && m.content === "" && !m.reasoning
    && !String(m.stats ?? "").startsWith("prompt");
  return (Array.isArray(messages) ? messages : []).filter((m) => !unstarted(m));
}

function setItem(name, value) {  // false (and said) when the browser's storage for the page is full
  try {
    localStorage.setItem(name, value);
    return true;
  } catch (error) {
    showError(`This browser's storage for the page is full (${error.name}): delete or export old chats.`);
    return false;
  }
}

function store(chat) {
  return setItem(CHAT_PREFIX + chat.id, JSON.stringify(chat));
}

// the chat that changed, and which one is open; `touched` false: a change (a rename) that leaves its place in the list
function save(chat = currentChat(), touched = true) {
  if (chat) {
    if (touched) chat.updated = Date.now();
    if (streams.has(chat.id)) storeStreaming(chat, chat.messages.at(-1));  // (other tabs: still answering here)
    else store(chat);
  }
  setItem(CURRENT, current ?? "");
}

// Another tab saved or deleted a chat. The list takes it at once; the chat on screen is drawn again (the reader's
// place kept) where this tab is not working in it (no answer streaming into it here, no edit or rename open): an
// answer streaming there shows here as it is saved, "answering in another tab". A chat streaming here keeps its
// messages; deleted elsewhere, its answer stops; renamed elsewhere, it takes the title.
window.addEventListener("storage", (event) => {
  if (!event.key?.startsWith(CHAT_PREFIX)) return;
  const id = event.key.slice(CHAT_PREFIX.length);
  const theirs = event.newValue ? load(event.key, null) : null;
  const mine = chats.find((c) => c.id === id);
  if (streams.has(id)) {  // its messages are this tab's; a title or system prompt set there is taken
    if (!theirs) {  // (a save of this tab's that raced the delete would bring it back: taken out again)
      streams.get(id).abort();
      localStorage.removeItem(event.key);
    }
    else if (mine) Object.assign(mine, { title: theirs.title, system: theirs.system });
    if (theirs) { drawList(); return; }
  }
  if (theirs?.id && !streamingElsewhere(theirs)) theirs.messages = answered(theirs.messages);
  chats = chats.filter((c) => c.id !== id);
  if (theirs?.id) chats.push(theirs);
  chats.sort((a, b) => (b.updated ?? 0) - (a.updated ?? 0));
  if (!currentChat()) {  // the chat on screen was deleted there
    current = chats[0]?.id ?? null;
    render();
  } else if (current === id && !editing()) {
    drawList();
    if (document.activeElement !== $("system")) $("system").value = currentChat().system ?? "";
    if (shownMessages() !== messagesDrawn) drawMessages(false);  // (a rename, a system prompt: none of them)
  } else drawList();
});

// another tab's copy of an answer still streaming there: saved as "interrupted" (what a reload of that tab would
// find), and saved again within LIVE_MS (a tab closed mid-answer leaves the copy, which then reads as interrupted)
function streamingElsewhere(chat) {
  const last = chat?.messages?.at(-1);
  return last?.role === "assistant" && last.stats === "interrupted" && Date.now() - (last.at ?? 0) < LIVE_MS;
}

function answeringElsewhere(id) {  // by the stored copy: this tab's own may be older
  return streamingElsewhere(load(CHAT_PREFIX + id, null));
}

function editing() {  // an edit or a rename open: what this tab draws leaves it alone
  return document.querySelector(".edit-box, .title-input") !== null;
}

// false (and said) where an answer streams into the chat, here or in another tab: a second one would write over it
function free(chat) {
  if (!chat || !streams.has(chat.id) && !answeringElsewhere(chat.id)) return true;
  showError(streams.has(chat.id) ? ANSWERING_HERE : ANSWERING_ELSEWHERE);
  return false;
}

let listDrawn = "";  // the chats, titles and choice the list shows: another tab's save of an answer changes none

// (not while a title is being typed there: its end draws the list; not when nothing it shows changed, so that a
// click on it is not lost to a redraw between press and release while another tab saves an answer every second)
function drawList() {
  const shown = JSON.stringify([current, chats.map((c) => [c.id, c.title])]);
  if (!document.querySelector(".title-input") && shown !== listDrawn) {
    $("chats").replaceChildren(...chats.map(chatItem));
    listDrawn = shown;
  }
  $("topbar-title").textContent = currentChat()?.title ?? "";
  if ($("error").textContent === ANSWERING_ELSEWHERE && !answeringElsewhere(current)) {
    showError("");  // (that answer ended, or another chat is on screen)
  }
}

let apiKey = null;  // the key given in this tab, where a full storage could not keep it
let keyGiven = false;  // the key dialog closed by its form, not by a second Escape

function currentKey() {  // the stored one first: another tab may have set a new one
  return localStorage.getItem(KEY) ?? apiKey;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = currentKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function askKey(why = "") {  // the page is of no use without a key: the dialog stays until one is given
  $("key-error").textContent = why;
  $("key-error").hidden = !why;
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
  save(chats[0]);
  render();
  $("input").focus();
}

// a button pressed from the keyboard (Enter or Space: a click of detail 0) hands the focus to the message box,
// where the next keys go; a redraw would otherwise drop it on the page's body, at the top of the tab order
function typeNext(event) {
  if (event?.detail === 0) $("input").focus();
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
  drawList();
  showBusy();
  $("system").value = currentChat()?.system ?? "";
  drawMessages(true);
}

function atBottom(list) {  // a reader there follows new text; one who scrolled up stays put
  return list.scrollHeight - list.scrollTop - list.clientHeight < 40;
}

let messagesDrawn = "";  // what the messages on screen show, as drawMessages drew them

// the chat on screen's messages as drawn (a stored copy's time of saving aside, but whether it still streams there)
function shownMessages() {
  const chat = currentChat();
  return JSON.stringify([current, sentFrom(chat), (chat?.messages ?? []).map((m) => [
    m.role, m.content, m.reasoning, m.thinkingOpen, streamingElsewhere({ messages: [m] }) || m.stats])]);
}

function drawMessages(toBottom) {  // toBottom false: the reader's place is kept unless they were at the bottom
  messagesDrawn = shownMessages();
  const list = $("messages");
  const follow = toBottom || atBottom(list);
  const top = list.scrollTop;
  const messages = currentChat()?.messages ?? [];
  const elements = messages.map((m, index) => messageElement(m, index, messages.length));
  const from = sentFrom(currentChat());
  if (from > 0) elements[from].prepend(contextNote());
  list.replaceChildren(...elements);
  list.scrollTop = follow ? list.scrollHeight : top;
}

function contextNote() {  // above the first message sent where a long chat no longer sends its oldest ones
  const note = document.createElement("div");
  note.className = "context-start";
  note.textContent = "The messages above are no longer sent: this chat outgrew the model's context. "
    + "The ones below are (+ New chat starts afresh).";
  return note;
}

function chatItem(chat) {
  const item = document.createElement("li");
  item.dataset.id = chat.id;
  item.classList.toggle("current", chat.id === current);
  const open = button("open", chat.title, chat.title, (event) => {
    current = chat.id;
    showPanel(null);
    save(null);
    render();
    typeNext(event);
  });
  const rename = button("rename", "✎", "Rename this chat", () => renameChat(item, open, chat));
  const remove = button("delete", "×", "Delete this chat", (event) => {
    streams.get(chat.id)?.abort();  // its answer stops with it
    chats = chats.filter((other) => other.id !== chat.id);
    localStorage.removeItem(CHAT_PREFIX + chat.id);
    if (current === chat.id) current = chats[0]?.id ?? null;
    save(null);
    if (!chats.length) newChat(); else render();
    typeNext(event);
  });
  item.append(open, rename, remove);
  return item;
}

function renameChat(item, open, { id, title }) {
  const input = document.createElement("input");
  input.className = "title-input";
  input.value = title;
  input.setAttribute("aria-label", "Chat title");
  let done = false;
  const finish = (keep, fromKeys) => {
    if (done) return;
    done = true;
    const chat = chats.find((c) => c.id === id);  // (another tab's save may have replaced this tab's copy)
    if (chat && keep && input.value.trim()) chat.title = input.value.trim();
    input.remove();  // (before drawing: the list is not drawn while a title is being typed)
    listDrawn = "";  // (its item lost its button to the input: drawn again even with the title unchanged)
    if (chat) save(chat, false);
    render();
    if (fromKeys) $("chats").querySelector(`li[data-id="${CSS.escape(id)}"] .open`)?.focus();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key !== "Enter" && event.key !== "Escape") return;
    event.preventDefault();  // (or the key, once the focus is back on the chat's button, would press it)
    finish(event.key === "Enter", true);
  });
  input.addEventListener("blur", () => finish(true, false));
  open.replaceWith(input);
  input.focus();
  input.select();
}

let liveCheck = null;  // one redraw when the last "answering in another tab" would lapse (that tab closed at once)

function redrawWhenFree() {  // an open edit or rename is never drawn over: tried again a moment later
  if (editing()) liveCheck = setTimeout(redrawWhenFree, LIVE_MS);
  else drawMessages(false);
}

function messageElement(message, index, count) {
  const el = document.createElement("div");
  el.className = `message ${message.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role;
  el.append(role, messageBody(message), actions(message, index, count, el));
  if (message.stats) {
    const stats = document.createElement("div");
    stats.className = "stats";
    const live = streamingElsewhere({ messages: [message] });
    stats.textContent = live ? "answering in another tab" : message.stats;
    if (live) {
      clearTimeout(liveCheck);
      liveCheck = setTimeout(redrawWhenFree, LIVE_MS);
    }
    el.append(stats);
  }
  return el;
}

function messageBody(message) {
  const body = document.createElement("div");
  body.className = "body";
  if (message.role === "assistant") {
    if (message.reasoning) body.append(thinkingElement(message));
    body.append(renderMarkdown(message.content));
    for (const pre of body.querySelectorAll("pre")) {
      const code = pre.querySelector("code").textContent;
      pre.prepend(button("copy-code", "Copy", "Copy this code", (event) => copyText(code, event.target)));
    }
  } else {
    body.textContent = message.content;
  }
  return body;
}

// A reasoning model's thinking (the stream's delta.reasoning): open while it is all there is, folded once the
// answer begins, unless the reader opened or folded it (kept across the repaints of a streaming answer).
function thinkingElement(message) {
  const details = document.createElement("details");
  details.className = "thinking";
  details.open = message.thinkingOpen ?? message.content === "";
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const text = document.createElement("div");
  text.textContent = message.reasoning;
  details.append(summary, text);
  // (a click, or Enter or Space on the summary: the "toggle" event also follows setting `open` above)
  summary.addEventListener("click", () => { message.thinkingOpen = !details.open; });
  return details;
}

function actions(message, index, count, el) {
  const bar = document.createElement("div");
  bar.className = "actions";
  bar.append(button("copy", "Copy", "Copy this message", (event) => copyText(message.content, event.target)));
  if (message.role === "user") {
    bar.append(button("edit", "Edit", "Edit this message and answer it again", () => editBox(el, index)));
    if (index === count - 1) {  // its answer was refused, failed or stopped before it began
      bar.append(button("regenerate", "Answer", "Answer this message", () => {
        if (free(currentChat())) answer(currentChat());
      }));
    }
  } else if (index === count - 1) {
    bar.append(button("regenerate", "Regenerate", "Answer the last message again", regenerate));
  }
  return bar;
}

function editBox(el, index) {
  const { id, messages } = currentChat();
  if (streams.has(id)) return;
  const box = document.createElement("div");
  box.className = "edit-box";
  const text = document.createElement("textarea");
  text.value = messages[index].content;
  text.rows = Math.min(10, text.value.split("\n").length + 1);
  text.setAttribute("aria-label", "Edited message");
  const saveButton = button("save", "Save & send", "Replace this message and answer it again", () => {
    const content = text.value.trim();
    const chat = chats.find((c) => c.id === id);  // (another tab's save may have replaced this tab's copy)
    if (!content || !chat || !free(chat) || !sampling()) return;  // (a bad settings field: nothing replaced)
    if (chat.messages[index]?.role !== "user") {  // (that save moved the messages: the edit has no place)
      showError("This chat changed in another tab: edit the message again.");
      render();
      return;
    }
    const above = index < sentFrom(chat);  // (before the splice: after it, the edited message is the last one)
    chat.messages[index].content = content;
    chat.messages.splice(index + 1);  // the edit replaces what followed it (no branches)
    if (above) chat.contextFrom = 0;  // an older message edited: all sent again, left out anew if too long
    answer(chat);
    $("input").focus();
  });
  const cancel = (event) => {
    render();
    typeNext(event);
  };
  text.addEventListener("keydown", (event) => {
    if (event.key === "Escape") cancel({ detail: 0 });
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) saveButton.click();
  });
  box.append(text, saveButton, button("cancel", "Cancel", "Escape", cancel));
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

const painting = new Set();  // the chats whose streaming answer is drawn at the next frame

// the streaming answer, at most once a frame, where its chat is the one shown; the view follows the stream only
// while it is at the bottom (a reader who scrolled up stays where they are). Drawn in place: the message keeps its
// element and buttons, its body the parts that did not change (a finished code block, a paragraph with a link),
// so that a click on one is not lost to a repaint between press and release.
function paintLast(chat, message) {
  if (painting.has(chat.id)) return;
  painting.add(chat.id);
  requestAnimationFrame(() => {
    painting.delete(chat.id);
    if (chat.id !== current) return;
    const list = $("messages");
    const follow = atBottom(list);
    const body = list.lastElementChild?.querySelector(".body");
    if (body) keepSame(body, messageBody(message));
    if (follow) list.scrollTop = list.scrollHeight;
  });
}

const drawnAs = new WeakMap();  // a part of a streaming answer -> its HTML as drawn (a "Copied" label since aside)

function keepSame(body, fresh) {  // body made like fresh: its leading parts drawn as fresh's stay
  const old = [...body.children];
  const wanted = [...fresh.children];
  let same = 0;
  while (same < old.length && same < wanted.length && drawnAs.get(old[same]) === wanted[same].outerHTML) same += 1;
  for (const part of old.slice(same)) part.remove();
  for (const part of wanted.slice(same)) drawnAs.set(part, part.outerHTML);
  body.append(...wanted.slice(same));
}

// usage: the server's (null when stopped: it comes with the last chunk); tokens: counted from the stream;
// ending: why it ended where it did not finish by itself ("stopped", a cut, "interrupted"), or null
function statsLine(usage, tokens, sent, first, end, ending) {
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
  if (ending) parts.push(ending);
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

function sampling() {  // null (and the error shown) where a field is not a finite number
  const fields = {};
  for (const name of SAMPLING) {
    const raw = $(name).value.trim();  // (a number field the browser could not read, 1e309, reads as "")
    if ($(name).validity?.badInput || (raw !== "" && !Number.isFinite(Number(raw)))) {
      showError(`${name} must be a number`);
      return null;
    }
    if (raw === "") continue;
    fields[name] = Number(raw);
  }
  if (!$("thinking-label").hidden) {  // a template with Qwen3's switch (on by default there; not everywhere)
    fields.chat_template_kwargs = { enable_thinking: $("thinking").checked };
  }
  return fields;
}

function send(text) {
  if (!currentChat()) newChat();  // (another tab deleted the last chat)
  const chat = currentChat();
  chat.system = $("system").value;
  chat.messages.push({ role: "user", content: text });
  if (chat.title === "New chat") chat.title = text.slice(0, 40);
  answer(chat);
}

function regenerate() {
  const chat = currentChat();
  // (a settings field that cannot be sent says so, and the answer stays: none replaces it)
  if (chat.messages.at(-1)?.role !== "assistant" || !free(chat) || !sampling()) return;
  chat.messages.pop();
  answer(chat);
}

const CUT = { length: "cut at max_tokens or the context's end" };
const EXPORTED_STREAMING = "unfinished: exported while it streamed";
const ANSWERING_ELSEWHERE = "This chat is answering in another tab: wait for its answer to end.";
const ANSWERING_HERE = "An answer is streaming into this chat: wait for it to end, or press Stop.";
const TOO_LONG = "This message alone does not fit the model's context: Edit it to shorten it.";
const TOO_LONG_WITH_MAX_TOKENS = "This message and max_tokens do not fit the model's context: lower max_tokens in the "
  + "settings, or Edit the message to shorten it.";
let serverError = null;  // the error shown for a server that was away or failed: cleared once it answers again

// what a reload finds if the page closes before the answer ends; other tabs read it as streaming here while `at`
// is recent, and as interrupted once the page closed (live false) (a chat deleted meanwhile is not brought back)
function storeStreaming(chat, reply, live = true) {
  if (!chats.includes(chat)) return;
  const copy = { ...reply, stats: "interrupted", ...(live && { at: Date.now() }) };
  store({ ...chat, messages: chat.messages.map((m) => (m === reply ? copy : m)) });
}

// Streams an answer to the chat's messages as they are, into a new last message (one answer a chat at a time; chats
// stream at once). An answer that never began (a refused or failed request, a stop before its first token) is taken
// out again, so that the history sent next holds no such empty answer (one the model gave empty stays: it is the
// conversation the cache holds).
async function answer(chat) {
  const fields = sampling();
  if (!fields) return;
  // the server's cap sent as max_tokens: a chat that leaves the answer less room is refused (400) and sent with
  // fewer old messages, where the server would clamp the answer to the rest of the context and cut it short
  let cap = fields.max_tokens === undefined ? serverCap : null;
  const reply = { role: "assistant", content: "", stats: "" };
  chat.messages.push(reply);
  chat.updated = Date.now();
  showError("");
  storeStreaming(chat, reply);
  render();
  const body = () => {  // the conversation as it is sent now (sentFrom moves on where it outgrew the context)
    const sent = chat.messages.slice(sentFrom(chat), chat.messages.indexOf(reply));
    const history = answered(sent).map(({ role, content }) => ({ role, content }));
    const messages = chat.system ? [{ role: "system", content: chat.system }, ...history] : history;
    // logprobs: one entry per generated token, so a stopped answer still knows how many it got; no model: the
    // server's own, whatever it was restarted with (a model read at load went stale: a 404 until a reload)
    return JSON.stringify({ messages, stream: true, stream_options: { include_usage: true }, logprobs: true,
                            ...fields, ...(cap && { max_tokens: cap }) });
  };
  const controller = new AbortController();
  streams.set(chat.id, controller);
  showBusy();
  const sent = performance.now();
  let first = null;
  let usage = null;
  let tokens = 0;
  let ending = null;
  let savedAt = sent;
  const saving = setInterval(() => {  // (a long prefill too, before any token)
    savedAt = performance.now();
    storeStreaming(chat, reply);
  }, PARTIAL_SAVE_MS);
  const closing = () => storeStreaming(chat, reply, false);
  window.addEventListener("pagehide", closing);
  const startedFrom = chat.contextFrom;  // kept if leaving messages out does not make it fit
  try {
    let response;
    for (;;) {  // again with fewer old messages while the conversation is too long for the context
      response = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(), body: body(), signal: controller.signal,
      });
      if (response.ok) break;
      if (response.status === 401) {
        resendAfterKey = true;
        askKey("The server refused the key: enter another.");
      }
      const error = (await response.json().catch(() => ({}))).error ?? {};
      const tooLong = error.code === "context_length_exceeded";
      const tooMany = error.code === "array_above_max_length";  // more messages than the server takes
      const later = tooLong || tooMany ? laterStart(chat, reply) : null;
      if (later === null && tooLong && cap) {  // only the message being answered left: the rest of the context
        cap = null;
        continue;
      }
      if (later === null) {
        chat.contextFrom = startedFrom;
        const message = error.message ?? `HTTP ${response.status}`;
        const why = error.param === "max_tokens" ? TOO_LONG_WITH_MAX_TOKENS : TOO_LONG;
        throw Object.assign(new Error(tooLong ? `${message}. ${why}` : message), { status: response.status });
      }
      chat.contextFrom = later;
      storeStreaming(chat, reply);
      drawMessages(false);
    }
    for await (const event of serverEvents(response)) {
      if (event.error) throw Object.assign(new Error(event.error.message), { status: 500 });
      const choice = event.choices?.[0];
      tokens += choice?.logprobs?.content?.length ?? 0;
      if (choice?.delta?.reasoning) {
        first ??= performance.now();
        reply.reasoning = (reply.reasoning ?? "") + choice.delta.reasoning;
        paintLast(chat, reply);
      }
      if (choice?.delta?.content) {
        first ??= performance.now();
        reply.content += choice.delta.content;
        paintLast(chat, reply);
        if (performance.now() - savedAt > PARTIAL_SAVE_MS) {  // (the timer's ticks slow down in a hidden tab)
          savedAt = performance.now();
          storeStreaming(chat, reply);
        }
      }
      if (choice?.finish_reason) ending = CUT[choice.finish_reason] ?? null;
      if (event.usage) usage = event.usage;
    }
  } catch (error) {
    if (error.name === "AbortError") ending = "stopped";
    else {
      ending = "interrupted";
      const lost = error instanceof TypeError;  // fetch's own failure: no answer from the server at all
      showError(lost ? `The connection to the server was lost (${error.message}).` : error.message);
      serverError = lost || error.status >= 500 ? $("error").textContent : null;
    }
  } finally {
    clearInterval(saving);
    window.removeEventListener("pagehide", closing);
    reply.stats = statsLine(usage, tokens, sent, first, performance.now(), ending);
    const unstarted = reply.content === "" && !reply.reasoning && (ending === "stopped" || ending === "interrupted");
    if (unstarted) chat.messages.splice(chat.messages.indexOf(reply), 1);  // refused, failed or stopped at once
    streams.delete(chat.id);
    showBusy();
    if ($("error").textContent === ANSWERING_HERE && !streams.has(current)) showError("");
    if (chats.includes(chat)) save(chat);
    if (chat.id === current) drawMessages(false); else drawList();
    refreshCache();
  }
}

// where the sent conversation starts: at chat.contextFrom (a user message), never past the last user message
function sentFrom(chat) {
  const last = (chat?.messages ?? []).findLastIndex((m) => m.role === "user");
  return Math.max(0, Math.min(chat?.contextFrom ?? 0, last));
}

// the conversation is too long: it is sent from a later user message on, half of the older messages left out (so
// that the turns after it keep the prefix cache's hits until it overflows again); null where only the message
// being answered is left
function laterStart(chat, reply) {
  const from = sentFrom(chat);
  const end = chat.messages.indexOf(reply);
  const last = chat.messages.findLastIndex((m, i) => m.role === "user" && i < end);
  if (last <= from) return null;
  const half = from + Math.ceil((last - from) / 2);
  return chat.messages.findIndex((m, i) => i >= half && m.role === "user");
}

function showBusy() {  // Stop where the chat on screen streams an answer here, Send elsewhere
  const busy = streams.has(current);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
}

// ---- export and import (JSON)

function exportChat() {
  let chat = currentChat();
  if (!chat) return;
  if (streams.has(chat.id) || streamingElsewhere(chat)) {  // the answer so far (here or in another tab), marked
    const last = chat.messages.at(-1);
    const marked = { role: last.role, content: last.content, stats: EXPORTED_STREAMING,
                     ...(last.reasoning ? { reasoning: last.reasoning } : {}) };
    chat = { ...chat, messages: chat.messages.map((m) => (m === last ? marked : m)) };
  }
  const data = { format: EXPORT_FORMAT, version: 1, chats: [chat] };
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
  link.download = `${chat.title.replace(/[^\p{L}\p{N}._-]+/gu, "_").slice(0, 60) || "chat"}.json`;
  link.click();
  URL.revokeObjectURL(link.href);
}

function importedChat(raw) {  // only the fields the page uses, as text: an imported file is not trusted
  const messages = Array.isArray(raw?.messages) ? raw.messages : [];
  return {
    id: newId(),
    title: String(raw?.title ?? "Imported chat").slice(0, 200),
    system: String(raw?.system ?? ""),
    messages: answered(messages.filter((m) => ["user", "assistant"].includes(m?.role))
      .map((m) => ({ role: m.role, content: String(m.content ?? ""), stats: String(m.stats ?? ""),
                     ...(m.reasoning ? { reasoning: String(m.reasoning) } : {}) }))),
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
    showError("");  // (before the saves: a full storage's error stays)
    for (const chat of added) save(chat);
    render();
  } catch (error) {
    showError(`Import failed: ${error.message}`);
  }
}

// ---- the cache panel

function formatBytes(bytes) {
  return bytes >= 2 ** 30 ? `${(bytes / 2 ** 30).toFixed(1)} GiB` : `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}

let cacheShownAt = null;  // when the panel's figures were read

function cacheStale(why) {  // the figures stay, dimmed, with their age, until a refresh reads new ones
  $("cache-panel").classList.toggle("stale", Boolean(why));
  $("cache-status").hidden = !why;
  if (why) $("cache-status").textContent = `${why}: figures from ${cacheShownAt ?? "no time yet"}`;
}

function refreshCacheIn(ms) {  // one timer, whoever asks (an answer's end, the last refresh, the tab shown again)
  clearTimeout(cacheTimer);
  cacheTimer = setTimeout(refreshCache, ms);
}

async function refreshCache() {
  if (cacheFetching) {
    cacheAgain = true;
    return;
  }
  if (!model || document.visibilityState !== "visible") {  // (no model yet: waiting for a key)
    refreshCacheIn(cacheDelay);
    return;
  }
  clearTimeout(cacheTimer);
  cacheFetching = true;
  cacheAgain = false;
  try {
    const response = await fetch("/v1/cache/stats", { headers: headers(),
                                                      signal: AbortSignal.timeout(CACHE_TIMEOUT_MS) });
    if (!response.ok) {  // a server draining or restarting (503), a key revoked (401): asked less often too
      cacheStale(`not updated (HTTP ${response.status})`);
      cacheDelay = Math.min(2 * cacheDelay, RETRY_MAX_MS);
      return;
    }
    const s = await response.json();
    if (serverError !== null && $("error").textContent === serverError && !$("cache-status").hidden) {
      showError("");  // the server was away (the figures went stale) and answers again
    }
    serverError = null;
    $("cache-tenant").textContent = s.tenant;
    $("cache-hit-rate").textContent = `${(100 * s.hit_rate).toFixed(1)} %`;
    $("cache-tokens").textContent = `${s.cached_tokens} / ${s.prompt_tokens}`;
    $("cache-used").textContent = `${s.kv_blocks.used} / ${s.kv_blocks.total}`;
    $("cache-cached").textContent = String(s.kv_blocks.cached);
    $("cache-free-empty").textContent = String(s.kv_blocks.free_empty);
    $("cache-free-cached").textContent = String(s.kv_blocks.free_cached);
    $("cache-evicted").textContent = String(s.evicted_blocks);
    $("cache-disk").textContent = s.disk ? `${s.disk.blocks} blocks, ${formatBytes(s.disk.bytes)}` : "off";
    cacheShownAt = new Date().toTimeString().slice(0, 8);  // HH:MM:SS
    cacheStale(null);
    cacheDelay = CACHE_REFRESH_MS;
  } catch {  // the server down, restarting or not answering: the next refresh tries again, later each time
    cacheStale("server unreachable");
    cacheDelay = Math.min(2 * cacheDelay, RETRY_MAX_MS);
  } finally {
    cacheFetching = false;
    refreshCacheIn(cacheAgain ? 0 : cacheDelay);
  }
}

// ---- settings kept across reloads

function restoreSettings() {
  const saved = load(SETTINGS, {});
  for (const name of SAMPLING) {
    if (typeof saved[name] === "string") $(name).value = saved[name];
  }
  $("thinking").checked = saved.thinking !== false;
}

function saveSettings() {
  setItem(SETTINGS, JSON.stringify({ ...Object.fromEntries(SAMPLING.map((n) => [n, $(n).value])),
                                     thinking: $("thinking").checked }));
}

// A reasoning model whose template takes Qwen3's enable_thinking gets a switch for it in the settings.
async function showThinkingSwitch() {
  try {
    const response = await fetch("/tokenizer_info", { headers: headers() });
    const info = response.ok ? await response.json() : {};
    $("thinking-label").hidden = !String(info.chat_template ?? "").includes("enable_thinking");
  } catch {  // (the server away: no switch until the page starts again)
    $("thinking-label").hidden = true;
  }
}

function showChats() {  // the chats kept in this browser, the current one open
  if (!currentChat() && chats.length) current = chats[0].id;
  render();
}

async function start() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch (error) {
    response = { ok: false, status: error.message };
  }
  if (response.status === 401) {
    showChats();
    askKey(currentKey() ? "The server refused this key: enter another." : "");
    return;
  }
  if (!response.ok) {  // a server starting, restarting or draining: try again, later each time
    showChats();  // (the chats are the browser's: readable while the server is away)
    showError(`The server is not ready (${response.status}): trying again.`);
    notReady = true;
    setTimeout(start, startDelay);
    startDelay = Math.min(2 * startDelay, RETRY_MAX_MS);
    return;
  }
  startDelay = START_RETRY_MS;
  if (notReady || resendAfterKey) showError("");  // (its own message only: a full storage's stays)
  notReady = false;
  const card = (await response.json()).data[0];
  await showThinkingSwitch();  // (before `model` is set, which lets a message be sent)
  model = card.id;
  $("model-name").textContent = model;
  const cap = card.sampling_defaults?.max_tokens;  // what a request without max_tokens gets
  $("max_tokens").placeholder = cap ? `server default ${cap}` : "rest of the context";
  // (not one that leaves no room for a prompt: every request would be refused, then sent without it)
  serverCap = cap && cap < (card.max_model_len ?? Infinity) ? cap : null;
  if (!currentChat() && !chats.length) newChat();
  showChats();
  refreshCache();
  const chat = currentChat();
  if (resendAfterKey && chat?.messages.at(-1)?.role === "user" && free(chat)) answer(chat);
  resendAfterKey = false;
}

// ---- wiring

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || !model || !free(currentChat()) || !sampling()) return;  // (the text stays)
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => {
  streams.get(current)?.abort();
  $("input").focus();  // (Stop hides itself: the focus would fall to the page's body)
});
document.querySelector("main").addEventListener("click", (event) => {  // the phone layout: a tap beside a panel
  if (!event.target.closest("#topbar")) showPanel(null);
});
$("new-chat").addEventListener("click", newChat);
$("export").addEventListener("click", exportChat);
$("import").addEventListener("click", () => $("import-file").click());
$("import-file").addEventListener("change", (event) => {
  if (event.target.files[0]) importChats(event.target.files[0]);
  event.target.value = "";
});
$("system").addEventListener("change", () => {
  const chat = currentChat();
  if (chat) { chat.system = $("system").value; save(chat); }
});
for (const name of SAMPLING) $(name).addEventListener("input", saveSettings);
$("thinking").addEventListener("change", saveSettings);
function showPanel(open) {  // the phone layout: one panel at a time over the chat ("sidebar-open", "cache-open")
  document.body.classList.remove("sidebar-open", "cache-open");
  if (open) document.body.classList.add(open);
  $("toggle-sidebar").setAttribute("aria-expanded", String(open === "sidebar-open"));
  $("toggle-cache").setAttribute("aria-expanded", String(open === "cache-open"));
}
for (const [toggle, open] of [["toggle-sidebar", "sidebar-open"], ["toggle-cache", "cache-open"]]) {
  $(toggle).addEventListener("click", () => showPanel(document.body.classList.contains(open) ? null : open));
}
$("key-dialog").addEventListener("cancel", (event) => event.preventDefault());  // Escape: no page without a key
$("key-dialog").addEventListener("close", () => {  // (a second Escape closes it all the same: it opens again)
  if (!keyGiven) askKey($("key-error").textContent);
  keyGiven = false;
});
$("key-form").addEventListener("submit", (event) => {
  const key = $("key-input").value.trim();
  if (!/^[\x21-\x7e]+$/.test(key)) {  // (a header holds no other character: fetch refused it, a retry loop)
    event.preventDefault();
    askKey("An API key is printable ASCII without spaces: check for a character pasted with it (a long dash?).");
    return;
  }
  keyGiven = true;
  apiKey = key;
  if (!setItem(KEY, key)) localStorage.removeItem(KEY);  // (a full storage says so; the key is used all the same)
  start();
});
document.addEventListener("visibilitychange", () => {  // a tab shown again reads the figures at once
  if (document.visibilityState !== "visible") return;
  cacheDelay = CACHE_REFRESH_MS;
  refreshCacheIn(0);
});
restoreSettings();
start();

// Markdown to DOM nodes, for model text: every piece of text becomes a text node, never HTML, so a reply
// holding <img onerror=...> or <script> shows as those characters. Covers what chat answers use: fenced
// code (highlighted), tables, headings, lists, paragraphs, `code`, **bold**, *emphasis* and [links](http...).
import { highlight } from "./highlight.js";

const TABLE_ROW = /^\s*\|.*\|\s*$/;
const TABLE_RULE = /^\s*\|(\s*:?-+:?\s*\|)+\s*$/;
const FENCE = /^([ \t]*)```(\S*)/;  // (indented under a list item, as models write code in a numbered step)

export function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const code = [];
      const indent = new RegExp(`^[ \\t]{0,${fence[1].length}}`);  // the fence's own indent, off each line
      for (i += 1; i < lines.length && !/^[ \t]*```/.test(lines[i]); i += 1) code.push(lines[i].replace(indent, ""));
      i += 1;  // the closing fence (or the end of a text still streaming)
      const pre = document.createElement("pre");
      const el = document.createElement("code");
      if (fence[2]) el.dataset.language = fence[2];
      el.append(highlight(code.join("\n"), fence[2]));
      pre.append(el);
      root.append(pre);
      continue;
    }
    if (startsTable(lines, i)) {
      const head = cells(line);
      const align = cells(lines[i + 1]).map(alignment);
      const rows = [];
      for (i += 2; i < lines.length && TABLE_ROW.test(lines[i]); i += 1) rows.push(cells(lines[i]));
      root.append(table(head, rows, align));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      const h = document.createElement(`h${Math.min(heading[1].length + 2, 6)}`);
      appendInline(h, heading[2]);
      root.append(h);
      i += 1;
      continue;
    }
    if (/^\s*([-*]|\d+\.)\s+/.test(line)) {
      const ordered = /^\s*\d+\./.test(line);
      const list = document.createElement(ordered ? "ol" : "ul");
      if (ordered) list.start = parseInt(line, 10);  // (a list a code block split goes on at its own number)
      for (; i < lines.length && /^\s*([-*]|\d+\.)\s+/.test(lines[i]); i += 1) {
        const item = document.createElement("li");
        appendInline(item, lines[i].replace(/^\s*([-*]|\d+\.)\s+/, ""));
        list.append(item);
      }
      root.append(list);
      continue;
    }
    if (!line.trim()) { i += 1; continue; }
    const para = [];
    for (; i < lines.length && lines[i].trim() && !/^([ \t]*```|#{1,6}\s|\s*([-*]|\d+\.)\s)/.test(lines[i])
                              && !startsTable(lines, i); i += 1) {
      para.push(lines[i]);
    }
    const p = document.createElement("p");
    para.forEach((part, k) => {
      if (k) p.append(document.createElement("br"));
      appendInline(p, part);
    });
    root.append(p);
  }
  return root;
}

function startsTable(lines, i) {  // a header row, then a |---|:--:| rule
  return TABLE_ROW.test(lines[i]) && TABLE_RULE.test(lines[i + 1] ?? "");
}

function cells(row) {
  return row.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((cell) => cell.trim());
}

function alignment(rule) {  // :--- left (the default), :---: center, ---: right
  if (!rule.endsWith(":")) return "";
  return rule.startsWith(":") ? "center" : "right";
}

function table(head, rows, align) {
  const el = document.createElement("table");
  const line = (tag, values) => {
    const tr = document.createElement("tr");
    head.forEach((_, k) => {  // every row as wide as the header, as GitHub renders it
      const cell = document.createElement(tag);
      if (align[k]) cell.style.textAlign = align[k];
      appendInline(cell, values[k] ?? "");
      tr.append(cell);
    });
    return tr;
  };
  const thead = document.createElement("thead");
  thead.append(line("th", head));
  const tbody = document.createElement("tbody");
  tbody.append(...rows.map((row) => line("td", row)));
  el.append(thead, tbody);
  return el;
}

const INLINE = /(`[^`]+`)|(\*\*[^*]+\*\*)|(\*[^*\s][^*]*\*)|(\[[^\]]+\]\([^)\s]+\))/;

function appendInline(parent, text) {
  while (text) {
    const match = text.match(INLINE);
    if (!match) { parent.append(document.createTextNode(text)); return; }
    if (match.index) parent.append(document.createTextNode(text.slice(0, match.index)));
    const token = match[0];
    if (token.startsWith("`")) {
      parent.append(element("code", token.slice(1, -1)));
    } else if (token.startsWith("**")) {
      parent.append(element("strong", token.slice(2, -2)));
    } else if (token.startsWith("*")) {
      parent.append(element("em", token.slice(1, -1)));
    } else {
      const [, label, href] = token.match(/^\[([^\]]+)\]\(([^)\s]+)\)$/);
      if (/^https?:\/\//i.test(href)) {  // no javascript: or data: links
        const a = element("a", label);
        a.href = href;
        a.rel = "noopener noreferrer";
        a.target = "_blank";
        parent.append(a);
      } else {
        parent.append(document.createTextNode(token));
      }
    }
    text = text.slice(match.index + token.length);
  }
}

function element(tag, text) {
  const el = document.createElement(tag);
  el.textContent = text;
  return el;
}

// A small code highlighter for the chat page (no CDN, no vendored library): one pass of one regular
// expression marks comments, strings, numbers and keywords as <span class="tok-...">; everything is set as
// text, never HTML. Enough to read an answer's code at a glance, not a parser; a block whose fence names no
// language it knows stays plain text.

const KEYWORDS = {
  python: "and as assert async await break class continue def del elif else except False finally for from global "
    + "if import in is lambda None nonlocal not or pass raise return True try while with yield match case self",
  js: "async await break case catch class const continue default delete do else export extends false finally for "
    + "function if import in instanceof let new null of return static super switch this throw true try typeof "
    + "undefined var void while yield interface type enum implements",
  c: "auto bool break case char class const continue default delete do double else enum extern false float for "
    + "goto if inline int long namespace new nullptr private protected public return short signed sizeof static "
    + "struct switch template this true typedef typename union unsigned using virtual void volatile while",
  rust: "as async await break const continue crate else enum extern false fn for if impl in let loop match mod "
    + "move mut pub ref return self Self static struct super trait true type unsafe use where while",
  go: "break case chan const continue default defer else fallthrough for func go goto if import interface map "
    + "nil package range return select struct switch type var true false",
  java: "abstract boolean break byte case catch char class const continue default do double else enum extends "
    + "final finally float for if implements import instanceof int interface long new null package private "
    + "protected public return short static super switch this throw throws true false try void while",
  sh: "if then else elif fi for while do done case esac in function return export local echo exit",
  sql: "select from where insert into values update set delete create table drop alter join left right inner "
    + "outer on group by order having limit as and or not null is in like distinct union primary key",
};
const ALIASES = {
  py: "python", python3: "python", javascript: "js", ts: "js", typescript: "js", jsx: "js", tsx: "js",
  json: "js", cpp: "c", "c++": "c", h: "c", hpp: "c", cc: "c", cs: "c", csharp: "c", rs: "rust",
  golang: "go", kotlin: "java", bash: "sh", shell: "sh", zsh: "sh", console: "sh",
};
const HASH_COMMENTS = new Set(["python", "sh"]);
const SLASH_COMMENTS = new Set(["js", "c", "rust", "go", "java"]);

export function languageOf(name) {
  const lang = (name || "").toLowerCase();
  return ALIASES[lang] ?? (lang in KEYWORDS ? lang : null);
}

function pattern(lang) {
  const parts = [];
  if (SLASH_COMMENTS.has(lang)) parts.push(String.raw`(?<comment>\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$))`);
  else if (HASH_COMMENTS.has(lang)) parts.push(String.raw`(?<comment>#[^\n]*)`);
  else if (lang === "sql") parts.push(String.raw`(?<comment>--[^\n]*)`);
  parts.push(String.raw`(?<string>"""[\s\S]*?(?:"""|$)|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?|\x60(?:\\.|[^\x60\\])*\x60?)`);
  parts.push(String.raw`(?<number>\b(?:0[xX][\da-fA-F_]+|\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)\b)`);
  parts.push(String.raw`(?<word>[A-Za-z_]\w*)`);
  return new RegExp(parts.join("|"), "g");
}

// Code text -> a fragment of text nodes and <span class="tok-...">; `lang` as named after the fence.
export function highlight(code, lang) {
  const language = languageOf(lang);
  const fragment = document.createDocumentFragment();
  if (!language) {
    fragment.append(document.createTextNode(code));
    return fragment;
  }
  const keywords = new Set((KEYWORDS[language] ?? "").split(" "));
  let last = 0;
  for (const match of code.matchAll(pattern(language))) {
    const kind = Object.keys(match.groups).find((name) => match.groups[name] !== undefined);
    if (kind === "word" && !keywords.has(match[0])) continue;
    if (match.index > last) fragment.append(document.createTextNode(code.slice(last, match.index)));
    const span = document.createElement("span");
    span.className = `tok-${kind === "word" ? "keyword" : kind}`;
    span.textContent = match[0];
    fragment.append(span);
    last = match.index + match[0].length;
  }
  if (last < code.length) fragment.append(document.createTextNode(code.slice(last)));
  return fragment;
}

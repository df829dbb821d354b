"""Synthetic, seeded workloads built with the model's own tokenizer.

Every request carries its token ids (for the engine and `transformers`) and its chat messages or
raw text (for HTTP clients). Arrival times are offsets in seconds from the start of a run; a
request with `after` set arrives `think_s` after that request finished (a closed-loop user).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# Plain English words; random sequences of them tokenize like prose (~1.3 tokens per word).
WORDS = (
    "the of and to in is was that for it with as on be at by this had not are but from or have an they which "
    "one you were her all she there would their we him been has when who will more no if out so said what up "
    "its about into than them can only other new some could time these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know while last might us "
    "great old year off come since against go came right used take three house water room country company "
    "system number group problem fact place point case week government program question night hand part child "
    "eye woman area study family money story month lot book job word business issue side kind head service "
    "friend father power hour game line end member law car city community name president team minute idea kid "
    "body information school face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education foot boy age policy process music "
    "market sense nation plan college interest death experience effect class control field development role "
    "effort rate heart drug show leader light voice wife police mind price report decision son view relationship "
    "town road arm difference value building action model season society tax director position player record "
    "paper space ground form event official matter center couple site project activity star table need court "
    "oil situation cost industry figure street image phone data picture practice piece land product doctor wall "
    "patient worker news test movie north love support technology step baby computer type attention film tree "
    "source organization hair window evidence population truth song energy garden river network bridge engine"
).split()


@dataclass(slots=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    arrival_s: float
    max_tokens: int
    messages: list[dict] | None = None  # chat form; None: `text` is a raw completion prompt
    text: str | None = None
    after: str | None = None  # closed loop: arrives think_s after this request finished
    think_s: float = 0.0


@dataclass(slots=True)
class Workload:
    name: str
    description: str
    requests: list[BenchRequest]
    engine_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. a small KV pool

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)


@dataclass(frozen=True, slots=True)
class Scale:
    """Request counts; --quick scales them down (never the per-request sizes)."""

    chatbot_users: int = 32
    multiturn_convs: int = 8
    multiturn_turns: tuple[int, int] = (5, 10)
    rag_docs: int = 4
    rag_requests: int = 16
    nosharing_requests: int = 24
    bursty_hot: int = 32
    bursty_bursts: int = 6
    lpm_prefixes: int = 4
    lpm_per_prefix: int = 6
    lpm_unique: int = 8
    mixed_clients: int = 32
    max_tokens: int = 16
    time_scale: float = 1.0  # multiplies arrival offsets and think times (0: everything at once, for tests)


FULL = Scale()
# quick: fewer requests and 8 output tokens instead of 16 (decode dominates the wall time on 2 cores)
QUICK = Scale(chatbot_users=6, multiturn_convs=2, multiturn_turns=(5, 5), rag_docs=2, rag_requests=3,
              nosharing_requests=6, bursty_hot=6, bursty_bursts=2, lpm_prefixes=2, lpm_per_prefix=3,
              lpm_unique=3, mixed_clients=32, max_tokens=8)


class TextMaker:
    """Seeded random prose of about n tokens of the given tokenizer."""

    def __init__(self, tokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def text(self, num_tokens: int) -> str:
        parts: list[str] = []
        while len(self.tokenizer.encode(" ".join(parts))) < num_tokens:
            sentence = self.words(self.rng.randint(6, 16))
            parts.append(sentence[0].upper() + sentence[1:] + ".")
        ids = self.tokenizer.encode(" ".join(parts))
        return self.tokenizer.decode(ids[:num_tokens])

    def question(self, lo: int = 8, hi: int = 24) -> str:
        return self.text(self.rng.randint(lo, hi)).rstrip(".") + "?"


def _chat(tokenizer, rid: str, messages: list[dict], arrival_s: float, max_tokens: int, **kw) -> BenchRequest:
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return BenchRequest(rid, ids, arrival_s, max_tokens, messages=messages, **kw)


def _raw(tokenizer, rid: str, text: str, arrival_s: float, max_tokens: int) -> BenchRequest:
    return BenchRequest(rid, tokenizer.encode(text), arrival_s, max_tokens, text=text)


def _poisson(rng: random.Random, n: int, rate_per_s: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(round(t, 3))
        t += rng.expovariate(rate_per_s)
    return out


def chatbot(tokenizer, scale: Scale, seed: int = 1) -> Workload:
    """One ~1,024-token system prompt, many users with short questions, Poisson arrivals (1/s)."""
    tm = TextMaker(tokenizer, seed)
    system = "You are the support assistant of a large company. " + tm.text(1010)
    arrivals = _poisson(tm.rng, scale.chatbot_users, 1.0)
    reqs = [_chat(tokenizer, f"chat-{i}", [{"role": "system", "content": system},
                                          {"role": "user", "content": tm.question()}], a, scale.max_tokens)
            for i, a in enumerate(arrivals)]
    return Workload("chatbot", "1 shared ~1K-token system prompt, short user questions, 1 req/s", reqs)


def multiturn(tokenizer, scale: Scale, seed: int = 2) -> Workload:
    """Conversations of 5-10 turns; each turn resends the whole history (scripted assistant replies)."""
    tm = TextMaker(tokenizer, seed)
    system = "You are a concise assistant. Answer in a few sentences."
    starts = _poisson(tm.rng, scale.multiturn_convs, 0.5)
    reqs = []
    for c, start in enumerate(starts):
        history = [{"role": "system", "content": system}]
        previous = None
        for turn in range(tm.rng.randint(*scale.multiturn_turns)):
            history = history + [{"role": "user", "content": tm.question(20, 60)}]
            rid = f"conv-{c}-turn-{turn}"
            reqs.append(_chat(tokenizer, rid, history, start if previous is None else 0.0, scale.max_tokens,
                              after=previous, think_s=1.0 if previous else 0.0))
            # the next turn carries a scripted answer: the cache hits the previous prompt, not the model's reply
            history = history + [{"role": "assistant", "content": tm.text(tm.rng.randint(40, 80))}]
            previous = rid
    return Workload("multiturn", "conversations of 5-10 turns growing their history, 1 s think time", reqs)


def rag(tokenizer, scale: Scale, seed: int = 3) -> Workload:
    """A shared 256-token instruction + one of a few 2K-token documents + a question."""
    tm = TextMaker(tokenizer, seed)
    instruction = "Answer the question using only the document. " + tm.text(245)
    docs = [tm.text(2048) for _ in range(scale.rag_docs)]
    choice = [i % scale.rag_docs for i in range(scale.rag_requests)]
    tm.rng.shuffle(choice)
    arrivals = _poisson(tm.rng, scale.rag_requests, 0.25)
    reqs = [_chat(tokenizer, f"rag-{i}", [{"role": "system", "content": instruction},
                                         {"role": "user", "content": f"Document:\n{docs[d]}\n\nQuestion: {tm.question()}"}],
                  a, scale.max_tokens) for i, (d, a) in enumerate(zip(choice, arrivals))]
    return Workload("rag", f"256-token instruction + 1 of {scale.rag_docs} 2K-token documents + question, "
                           "0.25 req/s", reqs)


def nosharing(tokenizer, scale: Scale, seed: int = 4) -> Workload:
    """Unrelated raw prompts (128-384 tokens), all at once: throughput with nothing to hit."""
    tm = TextMaker(tokenizer, seed)
    reqs = [_raw(tokenizer, f"unique-{i}", tm.text(tm.rng.randint(128, 384)), 0.0, scale.max_tokens)
            for i in range(scale.nosharing_requests)]
    return Workload("nosharing", "unrelated 128-384-token raw prompts, all arriving at t=0", reqs)


def bursty(tokenizer, scale: Scale, seed: int = 5) -> Workload:
    """A hot 512-token system prompt at 1 req/s, and bursts of 3 unrelated 384-token prompts every
    4 s that push it out of a small (80-block, 1,280-token) LRU pool."""
    tm = TextMaker(tokenizer, seed)
    hot = "You are the assistant of a travel agency. " + tm.text(500)
    reqs = [_chat(tokenizer, f"hot-{i}", [{"role": "system", "content": hot},
                                         {"role": "user", "content": tm.question()}], float(i), scale.max_tokens)
            for i in range(scale.bursty_hot)]
    for b in range(scale.bursty_bursts):
        at = 2.5 + 4.0 * b
        reqs += [_raw(tokenizer, f"burst-{b}-{j}", tm.text(384), at, scale.max_tokens) for j in range(3)]
    reqs.sort(key=lambda r: r.arrival_s)
    return Workload("bursty", "hot 512-token system prompt 1 req/s + bursts of 3 unrelated 384-token prompts "
                              "every 4 s; KV pool of 80 blocks", reqs, {"num_kv_blocks": 80})


def prefix_mix(tokenizer, scale: Scale, seed: int = 6) -> Workload:
    """Issue 5's fcfs-vs-lpm mix: requests over a few 384-token shared prefixes plus unique ones,
    arriving shuffled within 1 s, with a KV pool (64 blocks) smaller than the working set."""
    tm = TextMaker(tokenizer, seed)
    prefixes = [tm.text(384) for _ in range(scale.lpm_prefixes)]
    bodies = [f"{p}\n\nTask: {tm.question()}" for p in prefixes for _ in range(scale.lpm_per_prefix)]
    bodies += [tm.text(400) for _ in range(scale.lpm_unique)]
    tm.rng.shuffle(bodies)
    arrivals = sorted(round(tm.rng.uniform(0, 1.0), 3) for _ in bodies)
    reqs = [_raw(tokenizer, f"mix-{i}", body, a, scale.max_tokens) for i, (body, a) in enumerate(zip(bodies, arrivals))]
    return Workload("prefix_mix", f"{len(reqs)} requests over {scale.lpm_prefixes} shared 384-token prefixes + "
                                  f"{scale.lpm_unique} unique, burst in 1 s; 64-block pool, 4 seqs",
                    reqs, {"num_kv_blocks": 64, "max_num_seqs": 4})


def mixed(tokenizer, scale: Scale, seed: int = 7) -> Workload:
    """32 concurrent clients at t=0: chatbot users, RAG questions and unrelated prompts, shuffled."""
    tm = TextMaker(tokenizer, seed)
    n = scale.mixed_clients
    n_chat, n_rag = n * 3 // 8, n // 8
    base = Scale(chatbot_users=n_chat, rag_docs=2, rag_requests=n_rag, nosharing_requests=n - n_chat - n_rag,
                 max_tokens=scale.max_tokens)
    reqs = chatbot(tokenizer, base, seed).requests + rag(tokenizer, base, seed).requests
    reqs += [_raw(tokenizer, f"unique-{i}", tm.text(tm.rng.randint(128, 256)), 0.0, scale.max_tokens)
             for i in range(base.nosharing_requests)]
    tm.rng.shuffle(reqs)
    for r in reqs:
        r.arrival_s = 0.0
    return Workload("mixed", f"{n} concurrent clients at t=0: {n_chat} chatbot, {n_rag} RAG, "
                             f"{n - n_chat - n_rag} unrelated", reqs)


BUILDERS = {"chatbot": chatbot, "multiturn": multiturn, "rag": rag, "nosharing": nosharing, "bursty": bursty,
            "prefix_mix": prefix_mix, "mixed": mixed}


def build(name: str, tokenizer, scale: Scale) -> Workload:
    workload = BUILDERS[name](tokenizer, scale)
    for r in workload.requests:
        r.arrival_s *= scale.time_scale
        r.think_s *= scale.time_scale
    return workload


def subset(workload: Workload, n: int) -> Workload:
    """n requests for the slow transformers baseline, stratified over the workload's kinds of request
    (the id's first word: chat, rag, unique, ...), at least one of each, the rest in proportion."""
    if n >= len(workload.requests):
        return workload
    groups: dict[str, list[BenchRequest]] = {}
    for r in workload.requests:
        groups.setdefault(r.request_id.split("-")[0], []).append(r)
    total = len(workload.requests)
    share = {k: len(g) * n / total for k, g in groups.items()}
    quota = {k: max(int(share[k]), 1 if n >= len(groups) else 0) for k in groups}
    for k in sorted(groups, key=lambda k: share[k] - int(share[k]), reverse=True):  # largest remainder
        if sum(quota.values()) < n and quota[k] < len(groups[k]):
            quota[k] += 1
    picked = {id(g[int(i * len(g) / quota[k])]) for k, g in groups.items() for i in range(quota[k])}
    chosen = [r for r in workload.requests if id(r) in picked]
    ids = {r.request_id for r in chosen}
    chosen = [r for r in chosen if r.after is None or r.after in ids]
    return Workload(workload.name, workload.description + f" (subset of {len(chosen)})", chosen,
                    workload.engine_overrides)

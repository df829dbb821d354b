"""OpenAI response bodies and stream chunks for chat completions and (text) completions."""
from __future__ import annotations

import codecs
import time
import uuid
from typing import Any

from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SampledToken
from gateway.generate import Choice
from gateway.reasoning import END, ThinkingSplit
from gateway.tool_parsers import StreamDelta, ToolCallStream, extract, parser_for
from gateway.tools import ToolRequest


class ChatFormat:
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, tokenizer: Any, *, fingerprint: str | None = None,
                 tools: ToolRequest | None = None, tool_call_parser: str = "hermes", token_ids: bool = False,
                 tokens_as_ids: bool = False, prompt_logprobs: int | None = None, echo: str = "",
                 thinking: bool | None = None, echo_continued: bool = False) -> None:
        """`token_ids`: vLLM's return_token_ids (the prompt's and the answer's token ids beside the text);
        `tokens_as_ids`: vLLM's return_tokens_as_token_ids (logprobs name each token `token_id:ID`);
        `prompt_logprobs`: vLLM's (the prompt's logprobs, with the top k of each position, beside the answer);
        `echo`: vLLM's (the continued assistant message's text, before each answer's content);
        `thinking`: None, answers are not split (gateway/reasoning.py); else whether they start in the thinking;
        `echo_continued`: the answer continues the echoed message (continue_final_message), which is split with it."""
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.token_ids = token_ids
        self.tokens_as_ids = tokens_as_ids
        self.prompt_logprobs = prompt_logprobs
        self.echo = echo
        self.thinking = thinking
        self.split_echo = thinking is not None and echo_continued
        self._thinking_splits: dict[int, ThinkingSplit] = {}  # per choice index, when streaming
        self.tool_parser = parser_for(tools, tool_call_parser)  # None: the text is never parsed for tool calls
        self.max_tool_calls = tools.max_calls if tools else None
        self.legacy_functions = tools is not None and tools.legacy  # answer with the deprecated `function_call`
        self.named_call = tools is not None and tools.choice == "function"  # a tool_choice naming the function
        self._tool_streams: dict[int, ToolCallStream] = {}  # per choice index, when streaming
        self._call_ids: dict[tuple[int, int], str] = {}  # (choice index, call index) -> the call's id

    def response(self, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(self.object_name), **self._response_ids(choices),
                "choices": [self.choice_body(c) for c in choices], "usage": usage}

    def _response_ids(self, choices: list[Choice]) -> dict[str, Any]:
        """A chat's one prompt: its token ids and logprobs at the top of the response."""
        return {**self._prompt_ids(choices[0]), **self._prompt_scores(choices[0])}

    def _prompt_scores(self, choice: Choice) -> dict[str, Any]:
        """vLLM's prompt_logprobs: per prompt token, null for the first, else {token id: {logprob, rank,
        decoded_token}} of the prompt's token and of the top k of its position (ranks 1..k)."""
        if self.prompt_logprobs is None:
            return {}
        scores: list[dict[str, Any] | None] = [None]
        for t in choice.prompt_logprobs[1:]:
            position = {str(t.token_id): self._scored(t.token_id, t.logprob, t.rank)}
            for rank, (token_id, logprob) in enumerate((t.top_logprobs or [])[:self.prompt_logprobs], 1):
                position.setdefault(str(token_id), self._scored(token_id, logprob, rank))
            scores.append(position)
        return {"prompt_logprobs": scores}

    def _scored(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        """vLLM's Logprob: the token's text (U+FFFD for part of a character), or token_id:ID with tokens_as_ids."""
        text = self.tokenizer.token_bytes(token_id).decode("utf-8", "replace")
        return {"logprob": logprob, "rank": rank,
                "decoded_token": f"token_id:{token_id}" if self.tokens_as_ids else text}

    def _prompt_ids(self, choice: Choice) -> dict[str, Any]:
        return {"prompt_token_ids": choice.prompt_ids} if self.token_ids else {}

    def _output_ids(self, token_ids: list[int]) -> dict[str, Any]:
        return {"token_ids": token_ids} if self.token_ids else {}

    def _split(self, choice: Choice) -> tuple[str, str, str, bool]:
        """(reasoning, echo, the answer's content, whether the answer thinks) of a whole choice, split as its stream
        is: an echo the answer continues first."""
        echo, text = self.echo, "".join(choice.text)
        if self.thinking is None:
            return "", echo, text, False
        split = ThinkingSplit(self.thinking)
        echo_reasoning, echo = split.feed(echo) if self.split_echo else ("", echo)
        thinks = split.thinks_next(text)
        text_reasoning, text = split.feed(text)
        held_reasoning, held = split.finish()
        return echo_reasoning + text_reasoning + held_reasoning, echo, text + held, thinks

    def count_reasoning_tokens(self, choice: Choice) -> None:
        """usage's reasoning_tokens: the answer's tokens up to the one whose bytes complete </think> (all of them
        where the thinking never ended; none where the answer does not think)."""
        if self.thinking is None:
            return
        choice.num_reasoning_tokens = 0
        if not self._split(choice)[3]:
            return
        data, end = bytearray(), END.encode()
        for count, token_id in enumerate(choice.token_ids, 1):
            start = max(0, len(data) - len(end) + 1)  # (where this token's bytes may complete it)
            data += self.tokenizer.token_bytes(token_id)
            if data.find(end, start) >= 0:
                choice.num_reasoning_tokens = count
                return
        choice.num_reasoning_tokens = len(choice.token_ids)

    def choice_body(self, choice: Choice) -> dict[str, Any]:
        reasoning, echo, text, _ = self._split(choice)
        message: dict[str, Any] = {"role": "assistant", "content": echo + text}
        finish_reason = choice.finish_reason
        if self.tool_parser is not None:
            parsed = extract(self.tool_parser, text, self.max_tool_calls, cut_short=_cut_short(choice))
            # (cut short: without what a stream held back as a call's start)
            message["content"] = echo + parsed.content
            if parsed.calls:
                message = {"role": "assistant", "content": message["content"] or None}
                if self.legacy_functions:
                    message["function_call"] = {"name": parsed.calls[0].name, "arguments": parsed.calls[0].arguments}
                else:
                    message["tool_calls"] = [_tool_call(self._call_id(choice.index, i), c.name, c.arguments)
                                             for i, c in enumerate(parsed.calls)]
                finish_reason = self._tool_finish(finish_reason)
        message.update(_reasoning(reasoning))
        return {"index": choice.index, "message": message,
                "logprobs": self.logprobs(choice, choice.logprobs),
                "finish_reason": finish_reason, "stop_reason": choice.stop_reason, **self._output_ids(choice.token_ids)}

    def first_chunks(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """Each choice's role (and echo), a chunk each (as OpenAI and vLLM stream them: one choice a chunk)."""
        return [self.chunk([{"index": c.index, "delta": self._first_delta(c), "logprobs": None,
                             "finish_reason": None}], **self._prompt_ids(c)) for c in choices]

    def _first_delta(self, choice: Choice) -> dict[str, Any]:
        if not self.split_echo:
            return {"role": "assistant", "content": self.echo}
        reasoning, content = self._thinking_split(choice).feed(self.echo)
        return {"role": "assistant", "content": content, **_reasoning(reasoning)}

    def delta_chunk(self, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        reasoning, text = "", out.new_text
        if self.thinking is not None:
            reasoning, text = self._thinking_split(choice).feed(text)
        if self.tool_parser is None:
            delta = {"content": text} if text else {}
        else:
            delta = self._tool_delta(choice.index, self._tool_stream(choice).feed(text))
        delta.update(_reasoning(reasoning))
        if not delta and not out.new_logprobs and not (self.token_ids and out.new_token_ids):
            return None
        delta = delta or {"content": ""}  # logprobs (or token ids) of held-back text
        return self.chunk([{"index": choice.index, "delta": delta,
                            "logprobs": self.logprobs(choice, out.new_logprobs),
                            "finish_reason": None, **self._output_ids(out.new_token_ids)}])

    def finish_chunk(self, choice: Choice) -> dict[str, Any]:
        self.count_reasoning_tokens(choice)  # (before the usage chunk)
        delta, finish_reason = {}, choice.finish_reason
        reasoning, text = self._thinking_split(choice).finish() if self.thinking is not None else ("", "")
        if self.tool_parser is not None:
            stream = self._tool_stream(choice)
            fed = stream.feed(text)  # what the split held back: whitespace, or the start of a <think> never written
            done = stream.finish(cut_short=_cut_short(choice))
            delta = self._tool_delta(choice.index, StreamDelta(fed.content + done.content, fed.calls + done.calls))
            if stream.num_calls:
                finish_reason = self._tool_finish(finish_reason)
        elif text:
            delta = {"content": text}
        delta.update(_reasoning(reasoning))
        return self.chunk([{"index": choice.index, "delta": delta, "logprobs": None,
                            "finish_reason": finish_reason, "stop_reason": choice.stop_reason}])

    def _tool_finish(self, finish_reason: str | None) -> str | None:
        """A call that ended normally finishes with "tool_calls" ("function_call" for legacy requests), but for a
        tool_choice that named the function, "stop", as OpenAI answers it (and vLLM since it aligned with it);
        "length" (cut short) stays."""
        if finish_reason != FinishReason.STOP or self.named_call:
            return finish_reason
        return "function_call" if self.legacy_functions else "tool_calls"

    def _thinking_split(self, choice: Choice) -> ThinkingSplit:
        if choice.index not in self._thinking_splits:
            self._thinking_splits[choice.index] = ThinkingSplit(self.thinking)
        return self._thinking_splits[choice.index]

    def _tool_stream(self, choice: Choice) -> ToolCallStream:
        if choice.index not in self._tool_streams:
            self._tool_streams[choice.index] = ToolCallStream(self.tool_parser, self.max_tool_calls)
        return self._tool_streams[choice.index]

    def _call_id(self, choice_index: int, call_index: int) -> str:
        """A tool call's id, the same in a stream's first delta of it as in the whole answer's body: the Responses API
        streams the one and stores the other, and a client's function_call_output must name the stored call."""
        return self._call_ids.setdefault((choice_index, call_index), "call_" + uuid.uuid4().hex[:24])

    def _tool_delta(self, choice_index: int, update: StreamDelta) -> dict[str, Any]:
        """OpenAI's shape: a call's first delta has its index, id, type and name; later ones only
        index and an arguments fragment (legacy: `function_call` with the name first, then fragments)."""
        delta: dict[str, Any] = {}
        if update.content:
            delta["content"] = update.content
        if self.legacy_functions:
            for call in update.calls:  # at most one: legacy requests are never parallel
                delta["function_call"] = ({"arguments": call.arguments} if call.name is None
                                          else {"name": call.name, "arguments": call.arguments})
            return delta
        calls = []
        for call in update.calls:
            if call.name is not None:
                calls.append({**_tool_call(self._call_id(choice_index, call.index), call.name, call.arguments),
                              "index": call.index})
            else:
                calls.append({"index": call.index, "function": {"arguments": call.arguments}})
        if calls:
            delta["tool_calls"] = calls
        return delta

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              **top: Any) -> dict[str, Any]:
        return {**self._head(self.chunk_name), **top, "choices": choices, "usage": usage}

    def logprobs(self, choice: Choice, tokens: list[SampledToken] | None) -> dict[str, Any] | None:
        if choice.params.logprobs is None or not tokens:
            return None
        return {"content": [{**self._token(t.token_id, t.logprob),
                             "top_logprobs": [self._token(i, lp) for i, lp in t.top_logprobs or ()]}
                            for t in tokens]}

    def _token(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        data = self.tokenizer.token_bytes(token_id)
        return {"token": self._token_name(token_id, data), "logprob": logprob, "bytes": list(data)}

    def _token_name(self, token_id: int, data: bytes) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else token_string(data)

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint}


def _cut_short(choice: Choice) -> bool:
    """The text ended before the model ended it: at max_tokens, a stop string or a stop token id (a call in it stays
    a call, as the stream sent it)."""
    return choice.finish_reason == FinishReason.LENGTH or choice.stop_reason is not None


def _reasoning(text: str) -> dict[str, str]:
    """The thinking under vLLM's name and DeepSeek's / llama.cpp's (clients read one or the other)."""
    return {"reasoning": text, "reasoning_content": text} if text else {}


def _tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}




class CompletionFormat(ChatFormat):
    object_name = "text_completion"
    chunk_name = "text_completion"

    def __init__(self, response_id: str, model: str, tokenizer: Any, echo_prompts: list[str] | None = None, *,
                 fingerprint: str | None = None, token_ids: bool = False, tokens_as_ids: bool = False,
                 prompt_logprobs: int | None = None, echo_logprobs: bool = False) -> None:
        """`echo_logprobs`: echo with logprobs (the prompt's tokens and logprobs before the answer's)."""
        super().__init__(response_id, model, tokenizer, fingerprint=fingerprint, token_ids=token_ids,
                         tokens_as_ids=tokens_as_ids, prompt_logprobs=prompt_logprobs)
        self.echo_prompts = echo_prompts  # echo: each prompt's text, put before its choices' text
        self.echo_logprobs = echo_prompts is not None and echo_logprobs
        self._offsets: dict[int, TextOffsets] = {}  # per choice, carried across a stream's chunks
        self._unsent_prompt_ids: set[int] = set()  # choices whose stream has not sent their prompt's ids yet
        self._unsent_echo: set[int] = set()  # choices whose echo waits for their prompt's logprobs (a stream's)

    def _response_ids(self, choices: list[Choice]) -> dict[str, Any]:
        return {}  # (each choice carries its own prompt's)

    def choice_body(self, choice: Choice) -> dict[str, Any]:
        echoed = self._echo_logprobs(choice)
        return {"index": choice.index, "text": self._echo(choice) + "".join(choice.text),
                "logprobs": self._completion_logprobs(choice, echoed + choice.logprobs, TextOffsets(),
                                                      self._echo(choice), len(echoed)),
                "finish_reason": _finish_reason(choice), "stop_reason": choice.stop_reason,
                **self._prompt_ids(choice), **self._output_ids(choice.token_ids), **self._prompt_scores(choice)}

    def first_chunks(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """With echo, each choice's prompt, a chunk each (with logprobs, in the choice's first chunk, once they are
        computed); else none."""
        self._unsent_prompt_ids = {c.index for c in choices} if self.token_ids else set()
        if self.echo_prompts is None:
            return []
        self._unsent_echo = {c.index for c in choices} if self.echo_logprobs else set()
        return [self.chunk([{"index": c.index, "text": self._echo(c), "logprobs": None, "finish_reason": None,
                             **self._first_prompt_ids(c)}]) for c in choices if c.index not in self._unsent_echo]

    def _echo_logprobs(self, choice: Choice) -> list[SampledToken]:
        """With echo and logprobs, the prompt's tokens and their logprobs (the first has none), before the answer's."""
        return choice.prompt_logprobs if self.echo_logprobs else []

    def _first_prompt_ids(self, choice: Choice) -> dict[str, Any]:
        """The prompt's token ids in a choice's first chunk only (vLLM's return_token_ids)."""
        if choice.index not in self._unsent_prompt_ids:
            return {}
        self._unsent_prompt_ids.discard(choice.index)
        return self._prompt_ids(choice)

    def _echo(self, choice: Choice) -> str:
        return "" if self.echo_prompts is None else self.echo_prompts[choice.prompt_index]

    def delta_chunk(self, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        echo, echo_logprobs = "", []
        if choice.index in self._unsent_echo:  # the first output: the prompt is scored
            self._unsent_echo.discard(choice.index)
            echo, echo_logprobs = self._echo(choice), self._echo_logprobs(choice)
        if not echo_logprobs and not out.new_text and not out.new_logprobs and not (
                self.token_ids and out.new_token_ids):
            return None
        offsets = self._offsets.setdefault(choice.index, TextOffsets())  # carried across the stream's chunks
        return self.chunk([{"index": choice.index, "text": echo + out.new_text,
                            "logprobs": self._completion_logprobs(choice, echo_logprobs + (out.new_logprobs or []),
                                                                  offsets, echo, len(echo_logprobs)),
                            "finish_reason": None, **self._first_prompt_ids(choice),
                            **self._output_ids(out.new_token_ids)}])

    def finish_chunk(self, choice: Choice) -> dict[str, Any]:
        return self.chunk([{"index": choice.index, "text": "", "logprobs": None,
                            "finish_reason": _finish_reason(choice), "stop_reason": choice.stop_reason,
                            **self._first_prompt_ids(choice)}])

    def _completion_logprobs(self, choice: Choice, tokens: list[SampledToken] | None, offsets: "TextOffsets",
                             echo: str = "", num_echoed: int = 0) -> dict[str, Any] | None:
        """`tokens`: the echoed prompt's first (`num_echoed` of them, their text `echo`), then the answer's."""
        if choice.params.logprobs is None or not tokens:
            return None
        tok = self.tokenizer
        data = [tok.token_bytes(t.token_id) for t in tokens]
        hidden = tok.special_token_ids if choice.params.skip_special_tokens else frozenset()  # no text in the answer
        starts = []
        for i, (d, t) in enumerate(zip(data, tokens)):
            if i < num_echoed:  # the echo holds a special token's text where the prompt did (not an added BOS)
                shown = t.token_id not in tok.special_token_ids or offsets.reads(echo, d)
            else:
                shown = t.token_id not in hidden
            starts.append(offsets.start(d, not shown))
        top = None
        if (k := choice.params.logprobs) > 0:  # (an echoed prompt's first token has no logprob: null, as vLLM's)
            top = [None if t.logprob is None else
                   {self._token_name(i, tok.token_bytes(i)): lp for i, lp in (t.top_logprobs or [])[:k]}
                   for t in tokens]
        return {"tokens": [self._token_name(t.token_id, d) for d, t in zip(data, tokens)],
                "token_logprobs": [t.logprob for t in tokens], "top_logprobs": top, "text_offset": starts}


def _finish_reason(choice: Choice) -> str | None:
    """A completion with max_tokens 0 (echo: the prompt scored, nothing generated) ends at its length, as OpenAI's."""
    return FinishReason.LENGTH if choice.params.pooling == "none" else choice.finish_reason


def token_string(data: bytes) -> str:
    """A token as text; a token holding part of a UTF-8 character is spelled `bytes:\\xe4\\xbd` (as
    OpenAI does), so two such tokens never look alike."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TextOffsets:
    """Where each output token starts in the output text, counted over the tokens' raw bytes: a token
    that continues a character starts where that character does; special tokens add no text; a character's start
    that no continuation followed is the text's U+FFFD before the next token."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def reads(self, text: str, data: bytes) -> bool:
        """Whether `text` (counted from where these offsets began) holds the token `data` at the current offset."""
        return text.startswith(data.decode("utf-8", "replace"), self._chars)

    def start(self, data: bytes, special: bool) -> int:
        if special:
            return self._chars
        held, _ = self._decoder.getstate()
        if held and data and not 0x80 <= data[0] <= 0xBF:  # no continuation byte: the held bytes end as U+FFFD
            self._chars += len(self._decoder.decode(b"", final=True))
        offset = self._chars
        self._chars += len(self._decoder.decode(data))
        return offset

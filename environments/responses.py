"""Reading what the policy wrote into a message, the way its chat template's family writes one.

transformers 5 gives a tokenizer a `response_template`: a declarative description of an assistant turn (where
the reasoning, the final content and each tool call begin and end, how a call's arguments are written) that
`tokenizer.parse_response(text, prefix=..., tools=...)` reads into a message

    {"role": "assistant", "content": "...", "reasoning_content": "...",
     "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]}

with each argument typed by the tool's JSON schema. Few checkpoints ship one yet, so, as TRL's
`add_response_schema` does for the families it knows, we set one at start for a template written in a known
family's format. Which family is not guessed from the template's text: a probe conversation (a user turn, an
assistant turn calling a probe tool) is rendered by the template, and the family whose response template reads
that very call back out of the rendering is the one (`find_response_template`). A tokenizer with no such family
keeps the Hermes parser of environments/__init__.py.

The formats (the published templates' tool-call syntax, as TRL 1.16's chat_template_utils.py describes them):
  qwen3     Qwen2.5 / Qwen3 / Qwen3-VL:  <think>...</think>, <tool_call>{"name": ..., "arguments": {...}}</tool_call>
  qwen3.5   Qwen3.5 / Qwen3.6:  <tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>
  gpt-oss   harmony channels: analysis (reasoning), final (content), to=functions.NAME ... json<|message|>{...}<|call|>
  llama3    Llama 3.1 / 3.2 / 3.3:  {"name": NAME, "parameters": {...}} as the whole turn, closed by <|eot_id|>
  gemma4    <|channel>thought ...<channel|> and <|tool_call>call:NAME{key:<|"|>text<|"|>}<tool_call|>
"""

import json

# ----------------------------------------------------------------------------- the families' response templates

_QWEN_REASONING = {"open_pattern": r"<think>\n?", "close_pattern": r"\n?</think>\s*", "content": "text"}
_CALL = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}  # a call whose name is captured

FAMILIES = {
    "qwen3": {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "reasoning_content": _QWEN_REASONING,
            # the body is the whole {"name": ..., "arguments": ...} object
            "tool_calls": {"open_pattern": r"<tool_call>\s*", "close_pattern": r"\s*</tool_call>\s*", "repeats": True,
                           "content": "json", "transform": {"type": "function", "function": "{content}"}},
            "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
        },
    },
    "qwen3.5": {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "reasoning_content": _QWEN_REASONING,
            # values are written as bare text: the tool's schema types them (parse_response's `tools`)
            "tool_calls": {"open_pattern": r"<tool_call>\s*<function=(?P<name>[^\n>]+)>", "close_pattern":
                           r"</tool_call>\s*", "repeats": True, "content": "xml-inline",
                           "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*"
                                                           r"</parameter>", "value_parser": {"name": "text"}},
                           "transform": _CALL},
            "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
        },
    },
    "gpt-oss": {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|start|>assistant",
        "fields": {
            "thinking": {"open": "<|channel|>analysis<|message|>", "close_pattern": r"<\|end\|>\s*", "content": "text"},
            "content": {"open": "<|channel|>final<|message|>", "close_pattern": r"(?:<\|return\|>|<\|end\|>)\s*",
                        "content": "text"},
            # the template writes the recipient before the channel, the model often after it: both are read
            "tool_calls": {"open_pattern": r"(?:<\|channel\|>commentary\s*)?to=functions\.(?P<name>[^\s<]+)\s*"
                                           r"(?:<\|channel\|>commentary)?\s*(?:<\|constrain\|>)?\s*json<\|message\|>",
                           "close_pattern": r"<\|call\|>\s*", "repeats": True, "content": "json", "transform": _CALL},
        },
    },
    "llama3": {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "fields": {
            "tool_calls": {"open_pattern": r'\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,\s*"(?:parameters|arguments)"\s*:\s*',
                           "close_pattern": r"\}\s*(?:<\|eot_id\|>|<\|eom_id\|>)\s*", "repeats": True, "content": "json",
                           "transform": _CALL},
            "content": {"close_pattern": r"<\|eot_id\|>\s*", "content": "text"},
        },
    },
    "gemma4": {
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": r"(?:<\|turn>model\n|<tool_response\|>)",
        "fields": {
            "reasoning_content": {"open": "<|channel>thought\n", "close_pattern": r"\n?<channel\|>\s*", "content": "text"},
            "tool_calls": {"open_pattern": r"<\|tool_call>call:(?P<name>[\w.-]+)", "close_pattern": r"<tool_call\|>\s*",
                           "repeats": True, "content": "json",
                           "content_args": {"string_delims": [['<|"|>', '<|"|>']], "unquoted_keys": True},
                           "transform": _CALL},
            "content": {"close_pattern": r"(?:<turn\|>|<\|tool_response>|<eos>)\s*|$", "content": "text"},
        },
    },
}

# a tool no real run has, so that finding its name in a rendering means the template rendered it
PROBE = {"type": "function", "function": {
    "name": "probe_tool_q7", "description": "Probe the chat template.",
    "parameters": {"type": "object", "properties": {"probe_arg_q7": {"type": "integer", "description": "A number."}},
                   "required": ["probe_arg_q7"]}}}
_PROBE_CALL = {"type": "function", "function": {"name": "probe_tool_q7", "arguments": {"probe_arg_q7": 7}}}


def render(tokenizer, messages, chat_template_kwargs=None, **kw):
    """The chat template's text for `messages`; the run's chat_template_kwargs (e.g. enable_thinking) go to every
    rendering, as TRL passes them."""
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw, **(chat_template_kwargs or {}))


def _parse(template, text, prefix, tools=None):
    from transformers.utils.chat_parsing import parse_response
    return parse_response(text, template, prefix=prefix, tools=tools)


def _probe(tokenizer, template, chat_template_kwargs):
    """(prompt, response) if `template` reads the probe call back out of the template's rendering of it, else None."""
    from transformers.utils.chat_parsing.response_templates import load_response_template
    user = [{"role": "user", "content": "Call the probe."}]
    try:
        prompt = render(tokenizer, user, chat_template_kwargs, tools=[PROBE], add_generation_prompt=True)
        full = render(tokenizer, user + [{"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}],
                      chat_template_kwargs, tools=[PROBE])
        if not full.startswith(prompt) or not load_response_template(template).start_anchor_re.search(prompt):
            return None
        message = _parse(template, full[len(prompt):], prompt, [PROBE])
    except Exception:  # a template that cannot render a call, a format this family cannot read: not this family
        return None
    return (prompt, full[len(prompt):]) if message.get("tool_calls") == [_PROBE_CALL] else None


def find_response_template(tokenizer, chat_template_kwargs=None):
    """(family, response template) of the tokenizer: its own `response_template` ("own"), else the known family
    whose response template reads back the call the chat template rendered; (None, None) when there is none."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return "own", own
    if not getattr(tokenizer, "chat_template", None):
        return None, None
    for family, template in FAMILIES.items():
        if _probe(tokenizer, template, chat_template_kwargs) is not None:
            return family, template
    return None, None


def set_response_template(tokenizer, chat_template_kwargs=None):
    """Give the tokenizer its family's response template, where it has none and the family is known (so that
    `tokenizer.parse_response` works, as after TRL's add_response_schema); returns the family or None."""
    family, template = find_response_template(tokenizer, chat_template_kwargs)
    if family not in (None, "own"):
        tokenizer.response_template = template
    return family


def stop_strings(tokenizer, chat_template_kwargs=None):
    """What ends a tool call in this template's format, as its rendering of the probe call writes it (Qwen:
    </tool_call>, gpt-oss: <|call|>, Gemma 4: <tool_call|>, Llama 3: the end of turn): a turn stops right
    after it, so that the call's result comes back before the policy writes on. [] when there is none."""
    template = getattr(tokenizer, "response_template", None)
    if template is None:
        return []
    from transformers.utils.chat_parsing.response_templates import load_response_template
    field = load_response_template(template).fields.get("tool_calls")
    probe = _probe(tokenizer, template, chat_template_kwargs)
    if field is None or field.open_re is None or field.close_re is None or probe is None:
        return []
    response = probe[1]
    opened = field.open_re.search(response)
    closed = field.close_re.search(response, opened.end()) if opened else None
    return [closed.group(0).strip()] if closed and closed.group(0).strip() else []


def call_opening(tokenizer, chat_template_kwargs=None):
    """The text a tool call opens with in this tokenizer's format, up to the tool's name, as its chat template
    renders a call and its response template reads it (Qwen `<tool_call>`, gpt-oss `to=functions.`, Llama 3
    `{"name": "`), without the special tokens a decoded completion leaves out; None where the family is not
    known (Hermes's `<tool_call>` then) or its template renders no call."""
    template = getattr(tokenizer, "response_template", None)
    probe = _probe(tokenizer, template, chat_template_kwargs) if template is not None else None
    if probe is None:
        return None
    from transformers.utils.chat_parsing.response_templates import load_response_template
    field = load_response_template(template).fields.get("tool_calls")
    opened = field.open_re.search(probe[1]) if field is not None and field.open_re is not None else None
    if opened is None:
        return None
    end = opened.start("name") if "name" in opened.re.groupindex else opened.end()
    text = probe[1][opened.start():end]
    for special in {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}:
        text = text.replace(special, "")
    return text.strip() or None


def read(tokenizer, text, prefix, tools=None):
    """The message `text` (a turn as written, special tokens included) is, after `prefix` (everything before
    it), through the tokenizer's response template. ValueError, in one line, when the turn cannot be read
    (for example a call whose arguments are not valid JSON)."""
    try:
        return _parse(tokenizer.response_template, text, prefix, tools)
    except Exception as e:  # the parser's messages span lines and quote the whole region
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(reason[:200]) from e


def calls_of(message):
    """A parsed message's tool calls as [(name, arguments dict)], or (None, problem) for one that is not a call."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            calls.append((None, 'a tool call names a function: {"name": ..., "arguments": {...}}'))
            continue
        args = fn.get("arguments", fn.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass
        if args is None:
            args = {}
        if not isinstance(args, dict):
            calls.append((None, f"the arguments of {name!r} must be a JSON object"))
            continue
        calls.append((name, args))
    return calls


def reasoning_of(message):
    """The reasoning of a parsed message, whatever the family calls it (gpt-oss: thinking), or ''."""
    return message.get("reasoning_content") or message.get("thinking") or ""


# ----------------------------------------------------------------------------- what reward functions get


def reward_parts(tokenizer, prompts, completion_ids, episodes=None, completions=None):
    """Each completion as its parts, for reward functions (TRL's names for a message's parts):

    completion_messages: what the policy and the tools wrote after the prompt, as messages (TRL's conversational
        `completions`): assistant turns with `content` and, where the template's family writes them,
        `reasoning_content` (gpt-oss: `thinking`) and `tool_calls`; tool messages between them;
    completion_content: the final answer, the last assistant turn's content without its reasoning;
    reasoning_content: the reasoning of every turn, joined by newlines ('' when there is none);
    tool_calls: every call the policy made, in order, {"type": "function", "function": {"name", "arguments"}}.

    Without a response template (no known family), a turn is its text as written: content is the completion
    (`completions`, the text the trainer decoded, where it is given).
    """
    if episodes is not None:
        turns = [ep.messages[ep.start:] for ep in episodes]
        calls = [[{"type": "function", "function": {"name": name, "arguments": args}}
                  for name, args, _ in ep.calls if name is not None] for ep in episodes]
    else:
        template = getattr(tokenizer, "response_template", None)
        turns, calls = [], []
        for i, (prompt, ids) in enumerate(zip(prompts, completion_ids)):
            # the completion's text as `completions` has it (special tokens dropped)
            text = completions[i] if completions is not None else tokenizer.decode(ids, skip_special_tokens=True)
            message = {"role": "assistant", "content": text}
            if template is not None:
                try:
                    message = read(tokenizer, tokenizer.decode(ids, skip_special_tokens=False), prompt)
                except ValueError:  # a turn the template cannot read (a cut-off call): its text as it is
                    pass
            turns.append([message])
            calls.append([c for c in message.get("tool_calls") or [] if isinstance(c, dict)])
    content, reasoning = [], []
    for messages in turns:
        said = [m for m in messages if m.get("role") == "assistant"]
        content.append(said[-1].get("content") or "" if said else "")
        reasoning.append("\n".join(r for r in map(reasoning_of, said) if r))
    return {"completion_messages": turns, "completion_content": content, "reasoning_content": reasoning,
            "tool_calls": calls}

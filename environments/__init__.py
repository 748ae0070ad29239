"""Tools and environments for multi-turn rollouts, with TRL's interfaces (`tools=`, `environment_factory=`).

    --tools=file.py:fn,...          plain functions with type hints and a docstring
    --environment=file.py:Class     one instance per rollout; its public methods are its tools

A rollout is a conversation: the policy writes a turn, which ends at its EOS
token (the chat template's end of turn) or right after a call. The turn is
read by the tokenizer's response template where its family has one (Qwen3,
Qwen3.5, gpt-oss, Llama 3.x, Gemma 4: environments/responses.py), into its content,
reasoning and tool calls typed by the tools' schemas; otherwise (a template
that writes no call in a known format) its text is searched for tool calls in
the Hermes format, as Qwen2.5 and many open models write them:

    <tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>

A turn without a call ends the rollout (it is the final answer). Otherwise
every call runs, each result becomes a tool message, and the chat template
renders those messages and the next assistant header: those tokens are the
environment's answer, appended to the row's KV cache (sampling.sample), and
the policy writes its next turn. The arguments are parsed, never evaluated;
a call that is malformed, names no tool, raises, returns
something that is not text, returns too much, or runs past the timeout is
answered with a one-line error as its result and counted (`tool_errors`).
docs/agents.md has the whole contract.

This folder: this file (tools, environments, the Agent that runs their turns) and responses.py (a turn read as
the model's family writes it, through the tokenizer's response template). Imports: rewards.py (to load a
tool's or an environment's file) and transformers; nothing above them.
"""

import inspect
import json
import re
import threading
import time
from dataclasses import dataclass, field

import rewards
from environments import responses

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_MARK = "\x00turn\x00"  # stands for an assistant turn's text where the template is rendered around one
_RESULT = "result7q9x"  # stands for a tool's result (letters and digits: it survives any escaping)


def load_tools(spec):
    """'file.py:fn,package.module:fn' -> the named functions; ValueError naming an entry that does not resolve
    or a function whose signature and docstring do not describe it (each becomes a JSON schema)."""
    tools = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        fn = rewards.resolve(item)
        if not callable(fn) or inspect.isclass(fn):
            raise ValueError(f"{item!r}: a tool is a function, got {type(fn).__name__}")
        if fn.__name__ in {t.__name__ for t in tools}:
            raise ValueError(f"{item!r}: a tool named {fn.__name__!r} is already given")
        tool_schema(fn, item)
        tools.append(fn)
    if not tools:
        raise ValueError(f"{spec!r} names no tool")
    return tools


def load_environment(spec):
    """'file.py:Class' -> the class; ValueError unless it makes instances with a callable `reset`."""
    cls = rewards.resolve(spec.strip())
    if not inspect.isclass(cls):
        raise ValueError(f"{spec!r}: an environment is a class (one instance per rollout), got {type(cls).__name__}")
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"{spec!r}: {cls.__name__} has no reset method (reset(**row) -> None or text)")
    return cls


def tool_schema(fn, where=None):
    """The JSON schema the chat template shows for `fn`, from its type hints and docstring (transformers')."""
    from transformers.utils import get_json_schema
    try:
        return get_json_schema(fn)
    except Exception as e:  # no docstring, an argument without a type hint or description
        raise ValueError(f"{where or fn.__name__!r}: cannot describe tool {fn.__name__!r} to the model ({e})") from e


def environment_tools(env):
    """An environment instance's tools: its public methods other than reset and get_reward (as TRL lists them,
    from the class, so that properties are not evaluated)."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")]


# ----------------------------------------------------------------------------- calls


def parse_calls(text):
    """The tool calls in a turn's text: [(name, arguments dict)] or, for a malformed call, [(None, problem)]."""
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body) if body.strip() else None
        except ValueError as e:
            calls.append((None, f"the tool call is not valid JSON ({e})"))
            continue
        if call is None or call == {}:  # an empty call: the only tool, if there is one (handy for tiny models)
            calls.append(("", {}))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append((None, 'a tool call is {"name": ..., "arguments": {...}}'))
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                pass
        if not isinstance(args, dict):
            calls.append((None, f"the arguments of {call['name']!r} must be a JSON object"))
            continue
        calls.append((call["name"], args))
    return calls


def _as_text(result, limit):
    """A tool's result as the text of its message, or raise ValueError saying why it cannot be one."""
    if isinstance(result, str):
        text = result
    elif isinstance(result, (bool, int, float)):
        text = str(result)
    elif isinstance(result, (dict, list)):
        try:
            text = json.dumps(result)
        except (TypeError, ValueError):
            raise ValueError(f"returned a {type(result).__name__} that is not JSON") from None
    else:
        raise ValueError(f"returned a {type(result).__name__}, not text")
    if len(text) > limit:
        raise ValueError(f"returned {len(text):,} characters, more than the limit of {limit:,}")
    return text


def run_calls(jobs, timeout, limit):
    """Run [(function or None, arguments or problem)] in parallel threads: [(text, failed)] in order.

    A call still running after `timeout` seconds is answered with an error and left to finish on its own
    (a thread cannot be stopped); it never holds up the rollout.
    """
    results = [None] * len(jobs)

    def call(i, fn, args):
        try:
            results[i] = (_as_text(fn(**args), limit), False)
        except Exception as e:  # the model's call, the user's code: anything may go wrong
            results[i] = (f"error: {type(e).__name__}: {str(e)[:300]}", True)

    threads = []
    for i, (fn, args) in enumerate(jobs):
        if fn is None:
            results[i] = (f"error: {args}", True)
            continue
        t = threading.Thread(target=call, args=(i, fn, args), daemon=True)
        t.start()
        threads.append((i, t))
    deadline = time.monotonic() + timeout
    for i, t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive() or results[i] is None:
            results[i] = (f"error: the tool ran past its {timeout:g} s limit", True)
    return results


# ----------------------------------------------------------------------------- rollouts


@dataclass
class Episode:
    """One rollout's conversation: its environment (or None), tools, messages and what its calls did."""
    env: object
    tools: dict                                   # name -> callable
    messages: list                                # the conversation, the prompt's messages first
    tool_calls: int = 0
    tool_errors: int = 0
    turns: int = 0                                # the policy's turns written into `messages`
    calls: list = field(default_factory=list)     # (name, arguments, result) of each call, in order
    prompt: str = ""                              # the prompt as the policy saw it (the chat template's text)
    start: int = 0                                # messages[start:] are the completion's: turns and results


class Agent:
    """The tools and environment of a run: starts each rollout's conversation and answers the policy's turns.

    tools: functions; environment: a class (one instance per rollout) or None. max_turns: the policy's turns
    per completion (so at most max_turns - 1 rounds of calls); timeout: seconds per round of calls;
    max_result_chars: the longest result a tool may return.
    """

    def __init__(self, tokenizer, eos_ids, tools=(), environment=None, max_turns=4, timeout=10.0,
                 max_result_chars=4000, system_prompt=None, chat_template_kwargs=None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tools and environments need a tokenizer with a chat template (it renders the tools "
                             "and their results)")
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids)
        self.tools, self.environment = list(tools), environment
        self.max_turns, self.timeout, self.max_result_chars = max_turns, timeout, max_result_chars
        self.system_prompt, self.chat_template_kwargs = system_prompt, dict(chat_template_kwargs or {})
        probe = environment() if environment is not None else None
        env_tools = environment_tools(probe) if probe is not None else []
        self.schemas = [tool_schema(f) for f in self.tools + env_tools]
        names = [s["function"]["name"] for s in self.schemas]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: two tools share a name ({', '.join(names)})")
        self.reward_funcs = []
        if probe is not None and callable(getattr(probe, "get_reward", None)):
            name = environment.__name__

            def environment_reward(environments, **_):
                return [e.get_reward() for e in environments]
            environment_reward.__name__ = name  # logged as reward/<class name>, as TRL does
            self.reward_funcs.append(environment_reward)
        # turns are read by the tokenizer's response template where its family has one (environments/responses.py), else
        # by the Hermes parser below; a turn also ends right after a call, where the format closes one, so that
        # its result comes back before the policy writes on
        self.family = responses.set_response_template(tokenizer, self.chat_template_kwargs)
        self.stops = responses.stop_strings(tokenizer, self.chat_template_kwargs) if self.family else ["</tool_call>"]
        self.stop_sequences = [ids for ids in (tokenizer(s, add_special_tokens=False).input_ids for s in self.stops)
                               if ids and ids[-1] not in self.eos_ids]  # one that ends a turn anyway needs none

    def render(self, messages, **kw):
        return responses.render(self.tokenizer, messages, self.chat_template_kwargs, **kw)

    def check_template(self):
        """ValueError, in one line, unless the chat template shows tools to the model (a probe tool's name is in
        the prompt it writes) and can write a tool's result after a call."""
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + \
            [{"role": "user", "content": "x"}]
        shown = self.render(messages, tools=[responses.PROBE], add_generation_prompt=True)
        if responses.PROBE["function"]["name"] not in shown:
            raise ValueError("the chat template does not render the tools (their schemas are absent from the "
                             "prompt it writes), so the model would never see them; use a model whose chat "
                             "template supports tools")
        if self.schemas:
            self.answer_text([{"role": "tool", "name": self.schemas[0]["function"]["name"], "content": "1"}], False)

    def start(self, rows):
        """One Episode per row, each with its own environment (reset with the row's fields), and the prompts
        they start from: the row's messages with the tools, through the chat template."""
        episodes, prompts = [], []
        for row in rows:
            env = self.environment() if self.environment is not None else None
            content = row.get("prompt_messages") or [{"role": "user", "content": row["prompt_text"]}]
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + \
                [dict(m) for m in content]
            if env is not None:
                observation = env.reset(**row)
                if observation is not None:  # appended to the last user message, as TRL does
                    messages[-1] = {**messages[-1], "content": messages[-1]["content"] + str(observation)}
            tools = {f.__name__: f for f in self.tools}
            if env is not None:
                tools.update({m.__name__: m for m in environment_tools(env)})
            prompt = self.render(messages, tools=self.schemas, add_generation_prompt=True)
            episodes.append(Episode(env, tools, messages, prompt=prompt, start=len(messages)))
            prompts.append(prompt)
        return prompts, episodes

    def read_turn(self, ep, ids, before):
        """A policy's turn (its token ids, the end of turn included if it wrote one; `before`: the row's
        completion ids ahead of it) as (message, calls). Through the response template, the message has the
        parsed parts (content, reasoning, tool_calls) and a turn it cannot read is one malformed call; else
        the message is the turn's text and the calls are the Hermes ones."""
        ended = bool(ids) and ids[-1] in self.eos_ids
        text = self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        if not self.family:
            return {"role": "assistant", "content": text}, parse_calls(text)
        prefix = ep.prompt + self.tokenizer.decode(before, skip_special_tokens=False)
        try:
            message = responses.read(self.tokenizer, self.tokenizer.decode(ids, skip_special_tokens=False), prefix,
                                     self.schemas)
        except ValueError as e:
            return {"role": "assistant", "content": text}, [(None, f"the tool call could not be read ({e})")]
        message.setdefault("content", "")
        return message, responses.calls_of(message)

    def responder(self, episodes):
        """`respond` for sampling.sample over rows that are these episodes, in order."""
        def respond(turns):
            jobs, owners, texts = [], [], []
            for turn in turns:
                ep = episodes[turn.row]
                ids = turn.ids[turn.start:]
                ended = bool(ids) and ids[-1] in self.eos_ids
                message, calls = self.read_turn(ep, ids, turn.ids[:turn.start])
                ep.messages.append(message)
                ep.turns += 1
                texts.append((ended, calls))
                for name, args in calls:
                    if name == "" and len(ep.tools) == 1:
                        name = next(iter(ep.tools))
                    fn = ep.tools.get(name) if name is not None else None
                    if name is not None and fn is None:
                        name, args = None, f"no tool is named {name!r} (tools: {', '.join(ep.tools) or 'none'})"
                    jobs.append((fn, args))
                    owners.append((turn.row, name, args))
            results = iter(run_calls(jobs, self.timeout, self.max_result_chars))
            owned = iter(owners)
            answers = []
            for turn, (ended, calls) in zip(turns, texts):
                if not calls:
                    answers.append(None)  # no call: this turn was the final answer
                    continue
                ep, tool_messages = episodes[turn.row], []
                for _ in calls:
                    (text, failed), (_, name, args) = next(results), next(owned)
                    ep.tool_calls += 1
                    ep.tool_errors += failed
                    ep.calls.append((name, args if name is not None else None, text))
                    tool_messages.append({"role": "tool", "name": name or "error", "content": text})
                ep.messages.extend(tool_messages)
                answers.append(self.tokenizer(self.answer_text(tool_messages, ended),
                                              add_special_tokens=False).input_ids)
            return answers
        return respond

    def finish(self, episodes, rollout):
        """Write each conversation's last turn into its messages: the one no tool answered (its final answer,
        or the turn the length limit cut), found in the rollout after the environment's last token."""
        for ep, ids, real, policy, turns in zip(episodes, rollout.completion_ids.tolist(),
                                               rollout.completion_mask.tolist(), rollout.policy_mask.tolist(),
                                               rollout.turns.tolist()):
            if ep.turns >= turns:
                continue
            n = sum(real)
            start = max((j + 1 for j in range(n) if not policy[j]), default=0)
            ep.messages.append(self.read_turn(ep, ids[start:n], ids[:start])[0])
            ep.turns += 1

    def answer_text(self, tool_messages, ended_with_eos):
        """What follows a turn that made calls: whatever the chat template writes after the turn's text when
        tool messages follow it, up to where the policy writes again (the next assistant header, if the
        template has one); less the end-of-turn token when the policy wrote that itself.

        With a response template the turn is rendered as the calls it made (templates such as gpt-oss's name
        the tool's turn after the call), and the answer starts where the format closes the last call."""
        if self.family:
            answer = self._answer_after_calls(tool_messages)
        else:
            base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
            full = self.render(base + tool_messages, add_generation_prompt=True)
            answer = full[full.rindex(_MARK) + len(_MARK):]
        if ended_with_eos:
            for i in self.eos_ids:
                token = self.tokenizer.convert_ids_to_tokens(i)
                if isinstance(token, str) and answer.startswith(token):
                    return answer[len(token):]
        return answer

    def _answer_after_calls(self, tool_messages):
        calls = [{"type": "function", "function": {"name": m["name"], "arguments": {}}} for m in tool_messages]
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        full = self.render(base + tool_messages, tools=self.schemas, add_generation_prompt=True)
        marked = self.render(base + [{**m, "content": _RESULT} for m in tool_messages], tools=self.schemas,
                             add_generation_prompt=True)
        first = marked.find(_RESULT)
        ends = [marked.rfind(s, 0, first) + len(s) for s in self.stops if marked.rfind(s, 0, first) >= 0]
        ends += [marked.rfind(t, 0, first) + len(t) for t in map(self.tokenizer.convert_ids_to_tokens, self.eos_ids)
                 if isinstance(t, str) and marked.rfind(t, 0, first) >= 0]
        if first < 0 or not ends or full[:ends[0]] != marked[:ends[0]]:
            raise ValueError(f"the chat template ({self.family} format) does not write a tool's result after a "
                             f"call where it can be found")
        return full[ends[0]:]


def episode_fields(episodes):
    """What reward functions get of each rollout besides its text: the conversation and the environment."""
    return {"messages": [ep.messages for ep in episodes], "environments": [ep.env for ep in episodes]}

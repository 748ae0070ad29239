"""Conversations as chat models write them: options for the chat template (`--chat_template_kwargs`, e.g.
Qwen3's enable_thinking), a completion read into its parts (content, reasoning, tool calls) for reward
functions, and tool calls in each family's own format (Qwen3, Qwen3.5, gpt-oss, Llama 3.x, Gemma 4) read by the
tokenizer's response template (environments/responses.py), run, and answered as the family's template writes a result.

Each family's chat template is written out below in the published template's format (compact: only what a
tool conversation uses), on the byte-level tiny tokenizer with the family's markers as tokens."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import environments  # noqa: E402
import model_loading  # noqa: E402
from environments import responses  # noqa: E402
import rewards  # noqa: E402
import tasks.gsm8k  # noqa: E402
import sampling  # noqa: E402
import tasks  # noqa: E402
from tasks import vault  # noqa: E402
import train  # noqa: E402

# ----------------------------------------------------------------------------- the families' chat templates

# Qwen3 (Qwen2.5 writes calls alike): tools as JSON lines in the system turn, calls as JSON in <tool_call> tags,
# results in a user turn in <tool_response> tags, an empty <think> block opening the turn when thinking is off
QWEN3 = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
    "{{- m.content }}"
    "{%- for tc in m.tool_calls or [] %}"
    "{%- if loop.first and m.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + (tc.function.arguments | tojson)"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{%- endif %}")
QWEN_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Qwen3.5 (and 3.6): its own tools prompt, calls written as XML (<function=NAME>, one <parameter=KEY> block per
# argument, the value as bare text), every assistant turn after the last user query with its <think> block, and
# the generation prompt opening one (closed at once when thinking is off)
QWEN3_5 = (
    "{%- set ns = namespace(last_query=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{% endif %}{%- endfor %}"
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n"
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
    "<parameter=example_parameter_2>\\nThis is the value for the second parameter\\nthat can span\\nmultiple lines\\n"
    "</parameter>\\n</function>\\n</tool_call>\\n\\n<IMPORTANT>\\nReminder:\\n- Function calls MUST follow the "
    "specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML "
    "tags\\n- Required parameters MUST be specified\\n- You may provide optional reasoning for your function call in "
    "natural language BEFORE the function call, but NOT after\\n- If there is no function call available, answer the "
    "question like normal with your current knowledge and do not tell the user about function calls\\n</IMPORTANT>' }}"
    "{%- if messages[0].role == 'system' %}{{ '\\n\\n' + messages[0].content }}{% endif %}{{ '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query %}{{ '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' }}{% endif %}"
    "{{- m.content }}"
    "{%- for tc in m.tool_calls or [] %}"
    "{%- if loop.first and m.content %}{{ '\\n\\n' }}{% elif not loop.first %}{{ '\\n' }}{% endif %}"
    "{{- '<tool_call>\\n<function=' + tc.function.name + '>\\n' }}"
    "{%- for k, v in tc.function.arguments.items() %}{{ '<parameter=' + k + '>\\n' + (v | string) + '\\n</parameter>\\n' }}"
    "{%- endfor %}{{ '</function>\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{% endif %}{%- endif %}")

# gpt-oss (harmony): a developer turn declaring the tools as a TypeScript namespace, channels in the assistant's
# turns (analysis: reasoning, final: the answer), a call addressed to=functions.NAME ending in <|call|>, the
# result in a turn from functions.NAME (the name of the call it answers) with the content as JSON
GPT_OSS = (
    "{%- set ns = namespace(last='') %}"
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\nKnowledge cutoff: "
    "2024-06\\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\\n\\nReasoning: ' + (reasoning_effort | default('medium'))"
    " + '\\n\\n# Valid channels: analysis, "
    "commentary, final. Channel must be included for every message.' }}"
    "{%- if tools %}{{ '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}{% endif %}"
    "{{- '<|end|>' }}"
    "{%- if tools or messages[0].role == 'system' %}{{ '<|start|>developer<|message|>' }}"
    "{%- if messages[0].role == 'system' %}{{ '# Instructions\\n\\n' + messages[0].content + '\\n\\n' }}{% endif %}"
    "{%- if tools %}{{ '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}"
    "{%- for t in tools %}{{ '// ' + t.function.description + '\\ntype ' + t.function.name + ' = (_: {\\n' }}"
    "{%- for k, v in t.function.parameters.properties.items() %}"
    "{{- '// ' + v.description + '\\n' + k + ': ' + ('number' if v.type in ['integer', 'number'] else v.type)"
    " + ',\\n' }}{% endfor %}"
    "{{- '}) => any;\\n\\n' }}{% endfor %}{{ '} // namespace functions' }}{% endif %}{{ '<|end|>' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '<|start|>user<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.thinking %}{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{% endif %}"
    "{%- set tc = m.tool_calls[0].function %}{%- set ns.last = tc.name %}"
    "{{- '<|start|>assistant to=functions.' + tc.name + '<|channel|>commentary json<|message|>'"
    " + (tc.arguments | tojson) + '<|call|>' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.thinking %}{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{% endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + ('<|return|>' if loop.last else '<|end|>') }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|start|>functions.' + ns.last + ' to=assistant<|channel|>commentary<|message|>' + (m.content | tojson)"
    " + '<|end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}")
GPT_OSS_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]

# Llama 3.1-3.3: the tools as indented JSON in the first user turn, a call as the whole assistant turn
# {"name": ..., "parameters": {...}}, the result in an ipython turn as JSON
LLAMA3 = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{ 'Environment: ipython\\n' }}{% endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + (date_string | default('26 Jul 2024')) + '\\n\\n'"
    " + system + '<|eot_id|>' }}"
    "{%- for m in rest %}"
    "{%- if m.role == 'user' %}{{ '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{%- if loop.first and tools %}{{ 'Given the following functions, please respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt.\\n\\nRespond in the format {\"name\": function "
    "name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{ (t | tojson(indent=4)) + '\\n\\n' }}{% endfor %}{% endif %}"
    "{{- m.content + '<|eot_id|>' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{%- set tc = m.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + tc.name + '\", \"parameters\": '"
    " + (tc.arguments | tojson) + '}<|eot_id|>' }}"
    "{%- elif m.role == 'assistant' %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + m.content"
    " + '<|eot_id|>' }}"
    "{%- elif m.role in ['tool', 'ipython'] %}{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n'"
    " + (m.content | tojson) + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
LLAMA3_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Gemma 4: tools declared in the system turn in its own notation (unquoted keys, strings between <|"|> marks), a
# call as <|tool_call>call:NAME{key:value}<tool_call|>, the result written right after it in the same model turn
# (<|tool_response>response:NAME{value:...}<tool_response|>), where the model goes on
GEMMA4 = (
    "{%- macro arg(v) %}{% if v is string %}{{ '<|\"|>' + v + '<|\"|>' }}{% else %}{{ v }}{% endif %}{% endmacro %}"
    "{%- set ns = namespace(role='', kind='') %}"
    "{%- set rest = messages[1:] if messages[0].role == 'system' else messages %}"
    "{%- if enable_thinking or tools or messages[0].role == 'system' %}{{ '<|turn>system\\n' }}"
    "{%- if enable_thinking %}{{ '<|think|>\\n' }}{% endif %}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content | trim }}{% endif %}"
    "{%- for t in tools or [] %}{%- set p = t.function.parameters %}"
    "{{- '<|tool>declaration:' + t.function.name + '{description:<|\"|>' + t.function.description + '<|\"|>"
    ",parameters:{properties:{' }}"
    "{%- for k, v in p.properties | dictsort %}{% if not loop.first %},{% endif %}"
    "{{- k + ':{description:<|\"|>' + v.description + '<|\"|>,type:<|\"|>' + v.type | upper + '<|\"|>}' }}{% endfor %}"
    "{{- '},required:[' }}{% for r in p.required %}{% if not loop.first %},{% endif %}{{ '<|\"|>' + r + '<|\"|>' }}"
    "{%- endfor %}{{ '],type:<|\"|>OBJECT<|\"|>}}<tool|>' }}{% endfor %}{{ '<turn|>\\n' }}{% endif %}"
    "{%- set last = namespace(user=-1) %}{% for m in rest %}{% if m.role == 'user' %}{% set last.user = loop.index0 %}"
    "{%- endif %}{% endfor %}"
    "{%- for m in rest %}{% if m.role != 'tool' %}"
    "{%- set role = 'model' if m.role == 'assistant' else m.role %}"
    "{%- if not (role == 'model' and ns.role == 'assistant') %}{{ '<|turn>' + role + '\\n' }}{% endif %}"
    "{%- set ns.role, ns.kind = m.role, '' %}"
    "{%- if m.reasoning_content and loop.index0 > last.user and m.tool_calls %}"
    "{{- '<|channel>thought\\n' + m.reasoning_content + '\\n<channel|>' }}{% endif %}"
    "{%- for tc in m.tool_calls or [] %}{{ '<|tool_call>call:' + tc.function.name + '{' }}"
    "{%- for k, v in tc.function.arguments | dictsort %}{% if not loop.first %},{% endif %}{{ k + ':' + arg(v) }}{% endfor %}"
    "{{- '}<tool_call|>' }}{% set ns.kind = 'call' %}{% endfor %}"
    "{%- set scan = namespace(stop=false) %}"
    "{%- for f in rest[loop.index0 + 1:] if m.tool_calls %}{% if f.role != 'tool' %}{% set scan.stop = true %}"
    "{%- elif not scan.stop %}{{ '<|tool_response>response:' + f.name + '{value:' + arg(f.content) + '}<tool_response|>' }}"
    "{%- set ns.kind = 'response' %}{% endif %}{% endfor %}"
    "{%- set content = (m.content or '') | trim %}{{ content }}"
    "{%- if ns.kind == 'call' %}{{ '<|tool_response>' }}"
    "{%- elif not (ns.kind == 'response' and not content) %}{{ '<turn|>\\n' }}{% endif %}"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt and ns.kind not in ['call', 'response'] %}{{ '<|turn>model\\n' }}{% endif %}")
GEMMA4_TOKENS = ["<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>',
                 "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|think|>"]

# family: (template, marker tokens, end of turn, a turn that reasons and calls add(x=5) as the family's models
# write it, a final answer, the result of add as the template appends it, the stop that ends a call turn)
FAMILIES = {
    "qwen3": (QWEN3, QWEN_TOKENS, "<|im_end|>",
              '<think>\nI add.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"x": 5}}\n</tool_call>',
              "The total is 5.<|im_end|>",
              "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
              "</tool_call>"),
    # the template opens the <think> block: the model writes on inside it
    "qwen3.5": (QWEN3_5, QWEN_TOKENS, "<|im_end|>",
                "I add.\n</think>\n\n<tool_call>\n<function=add>\n<parameter=x>\n5\n</parameter>\n</function>\n"
                "</tool_call>",
                "\n</think>\n\nThe total is 5.<|im_end|>",
                "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                "<think>\n",
                "</tool_call>"),
    "gpt-oss": (GPT_OSS, GPT_OSS_TOKENS, "<|return|>",
                # as the model writes it: the channel before the recipient, <|constrain|>json, the argument a string
                '<|channel|>analysis<|message|>I add.<|end|><|start|>assistant<|channel|>commentary to=functions.add '
                '<|constrain|>json<|message|>{"x": "5"}<|call|>',
                "<|channel|>final<|message|>The total is 5.<|return|>",
                '<|start|>functions.add to=assistant<|channel|>commentary<|message|>"5"<|end|><|start|>assistant',
                "<|call|>"),
    "llama3": (LLAMA3, LLAMA3_TOKENS, "<|eot_id|>",
               '{"name": "add", "parameters": {"x": 5}}<|eot_id|>',
               "The total is 5.<|eot_id|>",
               '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|><|start_header_id|>assistant<|end_header_id|>'
               '\n\n',
               None),  # the call is the whole turn: the end of turn ends it
    "gemma4": (GEMMA4, GEMMA4_TOKENS, "<turn|>",
               "<|channel>thought\nI add.\n<channel|><|tool_call>call:add{x:5}<tool_call|>",
               "The total is 5.<turn|>",
               '<|tool_response>response:add{value:<|"|>5<|"|>}<tool_response|>',
               "<tool_call|>"),
}


def family_tokenizer(family):
    template, tokens = FAMILIES[family][:2]
    tok = model_loading.build_byte_tokenizer(tokens)
    tok.chat_template = template
    return tok


class TRLStyleEnv:
    """An environment as TRL's documentation writes one: reset, tools as typed methods, get_reward."""

    def reset(self, **kwargs):
        self.total = 0

    def add(self, x: int) -> str:
        """Add x to the running total.

        Args:
            x: The number to add.
        """
        self.total += x
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total)


def encode(tok, text):
    return tok(text, add_special_tokens=False).input_ids


# ----------------------------------------------------------------------------- chat_template_kwargs


def test_chat_template_kwargs_render_every_prompt_as_apply_chat_template_does():
    """{"enable_thinking": false} changes a task's prompts, a tool rollout's prompt and the text appended after a
    tool's result exactly as apply_chat_template(..., enable_thinking=False) does; the setting parses as JSON."""
    cfg = train.parse_config(['--chat_template_kwargs={"enable_thinking": false}'])
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    tok = family_tokenizer("qwen3")
    off = tasks.get_task("countdown", tokenizer=tok, eval_prompts=3, chat_template_kwargs=cfg.chat_template_kwargs)
    on = tasks.get_task("countdown", tokenizer=tok, eval_prompts=3)
    for a, b in zip(off.eval_rows, on.eval_rows):
        user = [{"role": "user", "content": a["prompt_text"]}]
        assert a["prompt"] == tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=False)
        assert b["prompt"] == tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        assert a["prompt"] == b["prompt"] + "<think>\n\n</think>\n\n"  # the template's switch, and nothing else
    agent = environments.Agent(tok, [tok.convert_tokens_to_ids("<|im_end|>")], [], TRLStyleEnv,
                         chat_template_kwargs=cfg.chat_template_kwargs)
    prompts, eps = agent.start([{"prompt_text": "Add five."}])
    assert prompts[0] == tok.apply_chat_template([{"role": "user", "content": "Add five."}], tools=agent.schemas,
                                                 tokenize=False, add_generation_prompt=True, enable_thinking=False)
    answer = agent.responder(eps)([sampling.Turn(0, encode(tok, FAMILIES["qwen3"][3]), 0)])[0]
    assert tok.decode(answer) == FAMILIES["qwen3"][5] + "<think>\n\n</think>\n\n"


def test_chat_template_kwargs_reach_the_reward_model(tmp_path):
    """A reward model's inputs are rendered by its own template with the run's options too (as TRL does): its
    scores are those of the text the template writes with them."""
    template = "{% for m in messages %}{{ m.content }}{% if marker is defined %}{{ marker }}{% endif %}{% endfor %}"
    path = model_loading.write_tiny_reward_model(str(tmp_path / "rm"), chat_template=template, initializer_range=0.5)
    model, tok = model_loading.load_reward_model(path)
    marked = rewards.reward_model_scores(model, tok, ["ab", "c"], ["d", "ef"], chat_template_kwargs={"marker": "#"})
    plain = rewards.reward_model_scores(model, tok, ["ab", "c"], ["d", "ef"])
    tok.chat_template = None  # the texts as they are
    assert marked == rewards.reward_model_scores(model, tok, ["ab#", "c#"], ["d#", "ef#"])
    assert plain == rewards.reward_model_scores(model, tok, ["ab", "c"], ["d", "ef"]) and plain != marked


def test_a_chat_template_option_the_trainer_sets_itself_is_refused():
    with pytest.raises(SystemExit, match=r"--chat_template_kwargs: add_generation_prompt, tools: set by the trainer"):
        train.parse_config(['--chat_template_kwargs={"tools": [], "add_generation_prompt": true}'])
    with pytest.raises(SystemExit, match=r"--chat_template_kwargs"):
        train.parse_config(['--chat_template_kwargs=[1]'])


# ----------------------------------------------------------------------------- a completion's parts


def test_rewards_see_content_and_reasoning_apart():
    """Through the Qwen3 template's response template, a completion that thinks is read into its final content
    and its reasoning; a correctness reward reads the content, so a number said only while thinking does not
    count. Without a response template the content is the completion's text, as before."""
    tok = family_tokenizer("qwen3")
    assert responses.set_response_template(tok) == "qwen3"
    prompt = tok.apply_chat_template([{"role": "user", "content": "6*7?"}], tokenize=False, add_generation_prompt=True)
    texts = ["<think>\nSix sevens are 42.\n</think>\n\nI am not sure.<|im_end|>",
             "<think>\nSix sevens.\n</think>\n\nIt is 42.<|im_end|>", "It is 42.<|im_end|>"]
    ids = [encode(tok, t) for t in texts]
    parts = responses.reward_parts(tok, [prompt] * 3, ids)
    assert parts["completion_content"] == ["I am not sure.", "It is 42.", "It is 42."]
    assert parts["reasoning_content"] == ["Six sevens are 42.", "Six sevens.", ""]
    assert parts["completion_messages"][0] == [{"role": "assistant", "reasoning_content": "Six sevens are 42.",
                                                "content": "I am not sure."}]
    completions = [tok.decode(i, skip_special_tokens=True) for i in ids]
    gold = ["42"] * 3
    assert tasks.gsm8k.gsm8k_correctness_reward(None, completions, gold) == [1.0, 1.0, 1.0]  # the raw text: fooled
    assert tasks.gsm8k.gsm8k_correctness_reward(None, completions, gold, parts["completion_content"]) == [0.0, 1.0, 1.0]
    plain = model_loading.build_byte_tokenizer()  # no chat template: no family, the text is the content
    assert responses.set_response_template(plain) is None
    parts = responses.reward_parts(plain, ["q"] * 2, [encode(plain, "<think>a</think>b"), encode(plain, "c")])
    assert parts["completion_content"] == ["<think>a</think>b", "c"] and parts["reasoning_content"] == ["", ""]
    texts = ["<think>a</think>b", "c"]  # the trainer's decoded text, when it passes it, is the content as it is
    assert responses.reward_parts(plain, ["q"] * 2, [encode(plain, t) for t in texts], completions=texts) == parts
    # the trainer's own plain path (rollouts.plain_parts, no response parsing entered) gives the same parts
    import rollouts
    ids = [encode(plain, t) for t in texts]
    assert rollouts.plain_parts(plain, ids) == parts == rollouts.plain_parts(plain, ids, texts)
    assert rollouts.reward_fields({}, ids, None, plain, ["q"] * 2) == {"completion_ids": ids, **parts}


# ----------------------------------------------------------------------------- each family's tool calls


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_tool_calls_are_read_into_the_same_call_and_run(family):
    """A TRL-style environment, unchanged, with each family's template: the family is found from the template,
    the turn stops where the format closes a call, the call (written in the family's format, its argument
    typed by the tool's schema) runs, its result is appended as the template writes it, and the next turn is
    read after it; the rewards' parts hold the content, the reasoning and the call."""
    template, _, eot, call, final, result, stop = FAMILIES[family]
    tok = family_tokenizer(family)
    eos = tok.convert_tokens_to_ids(eot)
    agent = environments.Agent(tok, [eos], [], TRLStyleEnv, max_turns=3)
    agent.check_template()
    assert agent.family == family
    assert agent.stop_sequences == ([encode(tok, stop)] if stop else [])
    prompts, eps = agent.start([{"prompt_text": "Add five."}])
    assert "Add x to the running total." in prompts[0]  # the tool's schema is in the prompt
    respond = agent.responder(eps)
    turn0 = encode(tok, call)
    answer = respond([sampling.Turn(0, turn0, 0)])[0]
    assert tok.decode(answer) == result
    ep = eps[0]
    assert ep.env.total == 5 and ep.calls == [("add", {"x": 5}, "5")] and ep.tool_errors == 0
    assert ep.messages[-1] == {"role": "tool", "name": "add", "content": "5"}
    so_far = turn0 + answer
    turn1 = so_far + encode(tok, final)
    assert respond([sampling.Turn(0, turn1, len(so_far))]) == [None]  # no call: the final answer
    parts = responses.reward_parts(tok, prompts, [turn1], eps)
    assert parts["completion_content"] == ["The total is 5."]
    assert parts["reasoning_content"] == ["" if family == "llama3" else "I add."]
    assert parts["tool_calls"] == [[{"type": "function", "function": {"name": "add", "arguments": {"x": 5}}}]]
    assert [m["role"] for m in parts["completion_messages"][0]] == ["assistant", "tool", "assistant"]
    assert agent.reward_funcs[0](environments=[ep.env]) == [5.0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_malformed_call_is_answered_with_a_short_error(family):
    """A call whose arguments are not JSON, or that names no tool, gets a one-line error as its result; the
    rollout goes on."""
    call = FAMILIES[family][3]
    tok = family_tokenizer(family)
    agent = environments.Agent(tok, [tok.convert_tokens_to_ids(FAMILIES[family][2])], [], TRLStyleEnv, max_turns=3)
    _, eps = agent.start([{"prompt_text": "a"}, {"prompt_text": "b"}])
    broken = call.replace("5", "5,,") if family != "qwen3.5" else call.replace("<parameter=x>", "<parameter=y>")
    unknown = call.replace("add", "subtract")
    answers = agent.responder(eps)([sampling.Turn(0, encode(tok, broken), 0), sampling.Turn(1, encode(tok, unknown), 0)])
    for ep, answer in zip(eps, answers):
        assert answer and ep.tool_errors == 1 and ep.env.total == 0
        text = ep.messages[-1]["content"]
        assert text.startswith("error: ") and "\n" not in text and len(text) < 400
    assert "subtract" in eps[1].messages[-1]["content"]


# the vault task's call (read_code, no arguments) and a final answer, as each family's models write them
VAULT_TURNS = {
    "qwen3": ('<tool_call>\n{"name": "read_code", "arguments": {}}\n</tool_call>', "{code}<|im_end|>"),
    "gpt-oss": ("<|channel|>analysis<|message|>I look.<|end|><|start|>assistant<|channel|>commentary "
                "to=functions.read_code <|constrain|>json<|message|>{}<|call|>",
                "<|channel|>final<|message|>{code}<|return|>"),
}


@pytest.mark.parametrize("family", list(VAULT_TURNS))
def test_the_vault_tasks_format_reward_reads_calls_as_the_family_writes_them(family):
    """The tool task's rewards on a well-formed call in the family's own format, run, then the code: full credit
    from both; a call opened in that format that the tool cannot run: the format's half credit."""
    call, final = VAULT_TURNS[family]
    tok = family_tokenizer(family)
    assert responses.set_response_template(tok) == family
    task = tasks.get_task("vault", tokenizer=tok)
    agent = environments.Agent(tok, [tok.convert_tokens_to_ids(FAMILIES[family][2])], [], task.environment,
                               max_turns=3)
    _, eps = agent.start([{"prompt_text": "code?", "seed": 3}, {"prompt_text": "code?", "seed": 4}])
    respond = agent.responder(eps)
    broken = call.replace("read_code", "read_cod")  # opened as the format writes a call; no such tool
    first = [encode(tok, call), encode(tok, broken)]
    answers = respond([sampling.Turn(i, ids, 0) for i, ids in enumerate(first)])
    assert eps[0].tool_errors == 0 and eps[1].tool_errors == 1 and all(answers)
    finals = [final.format(code=eps[0].env.code), final.format(code="none")]
    whole = [ids + a + encode(tok, f) for ids, a, f in zip(first, answers, finals)]
    assert respond([sampling.Turn(i, ids, len(f) + len(a)) for i, (ids, f, a) in enumerate(zip(whole, first, answers))]) \
        == [None, None]
    completions = tok.batch_decode(whole, skip_special_tokens=True)  # as the run decodes them
    fields = environments.episode_fields(eps)
    scores = {rewards.reward_name(f): f(completions=completions, **fields) for f in task.reward_funcs}
    assert scores == {"vault_reward": [1.0, 0.0], "tool_format_reward": [1.0, 0.5]}
    # a turn cut off inside a call (nothing ran): the half credit where it opens a call, nothing where it does not
    cut = tok.decode(encode(tok, call)[:-4], skip_special_tokens=True)
    own = next(f for f in task.reward_funcs if rewards.reward_name(f) == "tool_format_reward")
    assert own(completions=[cut, "I do not know."], messages=[[{"role": "assistant", "content": "x"}]] * 2) \
        == [0.5, 0.0]


def test_hermes_calls_without_a_family_keep_the_built_in_parser():
    """A template that writes no tool calls of a known family (the vault task's tiny one) keeps the Hermes parser
    and stop, as before."""
    tok = model_loading.build_byte_tokenizer(vault.TINY_TOOL_TOKENS)
    tok.chat_template = vault.TINY_TOOL_TEMPLATE
    agent = environments.Agent(tok, [tok.eos_token_id], [], TRLStyleEnv)
    assert agent.family is None and agent.stop_sequences == [encode(tok, "</tool_call>")]


def test_a_template_that_does_not_render_tools_stops_the_run(tmp_path):
    """--tools with a chat template that ignores `tools`: the run stops at start, in one line, before a step."""
    tool_file = tmp_path / "my_tools.py"
    tool_file.write_text("def add(x: int) -> int:\n    '''Add.\n\n    Args:\n        x: a number\n    '''\n    return x\n")
    model_dir = model_loading.write_tiny_model(str(tmp_path / "m"), chat_template=model_loading.TINY_CHAT_TEMPLATE)
    with pytest.raises(SystemExit) as e:
        train.main([f"--model={model_dir}", f"--tools={tool_file}:add", "--max_steps=1", f"--out_dir={tmp_path / 'o'}"])
    assert "does not render the tools" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


# each family's options and the end of its prompt with them
TRAIN_RUNS = {"qwen3": ('{"enable_thinking": false}', "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
              "gpt-oss": ('{"reasoning_effort": "low"}', "<|start|>assistant"),
              "llama3": ('{"date_string": "1 Jan 2026"}', "<|start_header_id|>assistant<|end_header_id|>\n\n")}


@pytest.mark.parametrize("family", list(TRAIN_RUNS))
def test_an_environment_runs_unchanged_through_train(tmp_path, family):
    """A TRL-style environment on a tiny model with the family's template and its options: the run completes,
    whatever a random model writes, and the reward functions receive the parts of each completion."""
    env_file = tmp_path / "my_env.py"
    env_file.write_text(
        "import json, os\n"
        "class Counter:\n"
        "    def reset(self, **kwargs):\n"
        "        self.n = 0\n"
        "    def bump(self, k: int) -> str:\n"
        "        '''Bump.\n\n        Args:\n            k: by how much\n        '''\n"
        "        self.n += k\n        return str(self.n)\n"
        "    def get_reward(self):\n"
        "        return float(self.n > 0)\n"
        "def parts(prompts, completions, completion_content, reasoning_content, tool_calls, completion_messages, "
        "**kw):\n"
        "    with open(os.environ['PARTS_LOG'], 'a') as f:\n"
        "        f.write(json.dumps([prompts[0], completion_content, reasoning_content, tool_calls,\n"
        "                            completion_messages]) + '\\n')\n"
        "    return [0.0] * len(completions)\n")
    template, tokens = FAMILIES[family][:2]
    model_dir = model_loading.write_tiny_model(str(tmp_path / "m"), chat_template=template, extra_tokens=tokens)
    log = tmp_path / "parts.jsonl"
    os.environ["PARTS_LOG"] = str(log)
    try:
        out = tmp_path / "out"
        kwargs, prompt_end = TRAIN_RUNS[family]
        train.main([f"--model={model_dir}", f"--environment={env_file}:Counter", f"--reward_funcs={env_file}:parts",
                    f"--chat_template_kwargs={kwargs}", "--max_steps=1", "--max_completion_length=24",
                    "--prompts_per_step=2", "--num_generations=2", f"--out_dir={out}", "--save_every=0"])
    finally:
        del os.environ["PARTS_LOG"]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 1 and "reward/Counter" in rows[0] and "tool_calls" in rows[0]
    prompt, content, reasoning, calls, messages = json.loads(log.read_text().splitlines()[0])
    assert prompt.endswith(prompt_end)
    assert ("Reasoning: low" in prompt) == (family == "gpt-oss")
    assert ("Today Date: 1 Jan 2026" in prompt) == (family == "llama3")
    assert len(content) == len(reasoning) == len(calls) == len(messages) == 4
    assert all(m and m[0]["role"] == "assistant" for m in messages)


def test_without_a_template_the_content_is_the_completion(tmp_path):
    """The default tiny model (no chat template): through train.py, each completion's content is its text and
    it has no reasoning or calls, so rewards that read the content score as they always did."""
    reward_file = tmp_path / "check.py"
    reward_file.write_text(
        "def same(completions, completion_content, reasoning_content, tool_calls, completion_messages, **kw):\n"
        "    assert completion_content == completions and reasoning_content == [''] * len(completions)\n"
        "    assert tool_calls == [[]] * len(completions)\n"
        "    assert completion_messages == [[{'role': 'assistant', 'content': c}] for c in completions]\n"
        "    return [1.0] * len(completions)\n")
    out = tmp_path / "out"
    train.main([f"--reward_funcs={reward_file}:same", "--max_steps=1", "--prompts_per_step=2", "--num_generations=2",
                "--max_completion_length=8", f"--out_dir={out}", "--save_every=0"])
    assert json.loads(open(out / "metrics.jsonl").readline())["reward/same"] == 1.0

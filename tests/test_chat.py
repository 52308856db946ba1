"""Lesson 13's chat templates: rendering equals transformers' apply_chat_template, as text and as token ids.

Three templates: SmolLM2-135M-Instruct's (its stand-in ships chat_template.jinja), and the published Llama 3.2
Instruct and Qwen2.5 Instruct templates, written below verbatim and put into tokenizer folders next to a real
tokenizer (Llama 3.2's for Llama, SmolLM2's ChatML tokenizer for Qwen, whose special tokens are the same strings).
"""

import datetime as _datetime
import json
import shutil
from pathlib import Path

import jinja2
import pytest
import transformers.utils.chat_template_utils as hf_chat
from transformers import AutoTokenizer

import hardway.text.chat
from hardway.text.chat import ChatTemplate, ChatTemplateError, read_chat_template, read_special_tokens
from hardway.formats.hub import checkpoint

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
LLAMA_TOKENIZER = "meta-llama/Llama-3.2-tokenizer"
PINNED_DATE = "26 Jul 2024"  # Llama 3.2's template writes today's date unless date_string is given

# meta-llama/Llama-3.2-1B-Instruct, tokenizer_config.json "chat_template", verbatim.
LLAMA_3_2_TEMPLATE = (
    '{{- bos_token }}\n'
    '{%- if custom_tools is defined %}\n'
    '    {%- set tools = custom_tools %}\n'
    '{%- endif %}\n'
    '{%- if not tools_in_user_message is defined %}\n'
    '    {%- set tools_in_user_message = true %}\n'
    '{%- endif %}\n'
    '{%- if not date_string is defined %}\n'
    '    {%- if strftime_now is defined %}\n'
    '        {%- set date_string = strftime_now("%d %b %Y") %}\n'
    '    {%- else %}\n'
    '        {%- set date_string = "26 Jul 2024" %}\n'
    '    {%- endif %}\n'
    '{%- endif %}\n'
    '{%- if not tools is defined %}\n'
    '    {%- set tools = none %}\n'
    '{%- endif %}\n'
    '\n'
    '{#- This block extracts the system message, so we can slot it into the right place. #}\n'
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    '    {%- set messages = messages[1:] %}\n'
    '{%- else %}\n'
    '    {%- set system_message = "" %}\n'
    '{%- endif %}\n'
    '\n'
    '{#- System message #}\n'
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{%- if tools is not none %}\n'
    '    {{- "Environment: ipython\\n" }}\n'
    '{%- endif %}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    '{%- if tools is not none and not tools_in_user_message %}\n'
    '    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n'
    '    {{- "Do not use variables.\\n\\n" }}\n'
    '    {%- for t in tools %}\n'
    '        {{- t | tojson(indent=4) }}\n'
    '        {{- "\\n\\n" }}\n'
    '    {%- endfor %}\n'
    '{%- endif %}\n'
    '{{- system_message }}\n'
    '{{- "<|eot_id|>" }}\n'
    '\n'
    '{#- Custom tools are passed in a user message with some extra guidance #}\n'
    '{%- if tools_in_user_message and not tools is none %}\n'
    '    {#- Extract the first user message so we can plug it in here #}\n'
    '    {%- if messages | length != 0 %}\n'
    "        {%- set first_user_message = messages[0]['content']|trim %}\n"
    '        {%- set messages = messages[1:] %}\n'
    '    {%- else %}\n'
    '        {{- raise_exception("Cannot put tools in the first user message when there\'s no first user message!") }}\n'
    '{%- endif %}\n'
    "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    '    {{- "Given the following functions, please respond with a JSON for a function call " }}\n'
    '    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n'
    '    {{- "Do not use variables.\\n\\n" }}\n'
    '    {%- for t in tools %}\n'
    '        {{- t | tojson(indent=4) }}\n'
    '        {{- "\\n\\n" }}\n'
    '    {%- endfor %}\n'
    '    {{- first_user_message + "<|eot_id|>"}}\n'
    '{%- endif %}\n'
    '\n'
    '{%- for message in messages %}\n'
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- elif 'tool_calls' in message %}\n"
    '        {%- if not message.tool_calls|length == 1 %}\n'
    '            {{- raise_exception("This model only supports single tool-calls at once!") }}\n'
    '        {%- endif %}\n'
    '        {%- set tool_call = message.tool_calls[0].function %}\n'
    "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    '        {{- \'{"name": "\' + tool_call.name + \'", \' }}\n'
    '        {{- \'"parameters": \' }}\n'
    '        {{- tool_call.arguments | tojson }}\n'
    '        {{- "}" }}\n'
    '        {{- "<|eot_id|>" }}\n'
    '    {%- elif message.role == "tool" or message.role == "ipython" %}\n'
    '        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}\n'
    '        {%- if message.content is mapping or message.content is iterable %}\n'
    '            {{- message.content | tojson }}\n'
    '        {%- else %}\n'
    '            {{- message.content }}\n'
    '        {%- endif %}\n'
    '        {{- "<|eot_id|>" }}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '{%- if add_generation_prompt %}\n'
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    '{%- endif %}\n'
)

# Qwen/Qwen2.5-0.5B-Instruct (revision 7ae557604adf67be50417f59c2c2f167def9a775), tokenizer_config.json "chat_template", verbatim.
QWEN_2_5_TEMPLATE = (
    '{%- if tools %}\n'
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    '    {%- else %}\n'
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    '    {%- endif %}\n'
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n'
    '        {{- "\\n" }}\n'
    '        {{- tool | tojson }}\n'
    '    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    '{%- else %}\n'
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    '    {%- else %}\n'
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    '    {%- endif %}\n'
    '{%- endif %}\n'
    '{%- for message in messages %}\n'
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    '        {%- if message.content %}\n'
    "            {{- '\\n' + message.content }}\n"
    '        {%- endif %}\n'
    '        {%- for tool_call in message.tool_calls %}\n'
    '            {%- if tool_call.function is defined %}\n'
    '                {%- set tool_call = tool_call.function %}\n'
    '            {%- endif %}\n'
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    '            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n'
    '            {{- tool_call.arguments | tojson }}\n'
    "            {{- '}\\n</tool_call>' }}\n"
    '        {%- endfor %}\n'
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    '        {%- endif %}\n'
    "        {{- '\\n<tool_response>\\n' }}\n"
    '        {{- message.content }}\n'
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    '        {%- endif %}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '{%- if add_generation_prompt %}\n'
    "    {{- '<|im_start|>assistant\\n' }}\n"
    '{%- endif %}\n'
)

# Users and assistants must alternate, as Mistral's and Gemma's templates demand.
STRICT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n"
    "{% endfor %}"
)

SYSTEM = {"role": "system", "content": "You are a terse assistant.  "}
CONVERSATIONS = {
    "one user message": [{"role": "user", "content": "What is the capital of France?"}],
    "system and user": [SYSTEM, {"role": "user", "content": "Hi!"}],
    "multi-turn with system": [
        SYSTEM,
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one,\nplease."},
    ],
    "multi-turn without system": [
        {"role": "user", "content": "1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "3"},
        {"role": "assistant", "content": "4"},
    ],
    "whitespace, unicode, a special token typed by the user": [
        {"role": "user", "content": "  Ünïcödé ✓ 你好 <b>&amp;</b>\n\n\ttabs <|im_end|> <|eot_id|> "},
    ],
}


def _tokenizer_folder(folder: Path, tokenizer_json: Path, config: dict, jinja: str | None = None) -> Path:
    folder.mkdir(parents=True)
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: (folder, extra template variables)}: one folder per template under test."""
    smollm2 = checkpoint(SMOLLM2)
    llama_tok = checkpoint(LLAMA_TOKENIZER)
    tmp = tmp_path_factory.mktemp("chat")
    # Llama 3.2 Instruct keeps its template in tokenizer_config.json (the older layout), eos_token <|eot_id|>
    llama_config = json.loads((llama_tok / "tokenizer_config.json").read_text(encoding="utf-8"))
    llama_config.update(eos_token="<|eot_id|>", chat_template=LLAMA_3_2_TEMPLATE)
    llama = _tokenizer_folder(tmp / "llama-3.2-instruct", llama_tok / "tokenizer.json", llama_config)
    # Qwen2.5 Instruct: no bos_token, eos <|im_end|>; the template as chat_template.jinja (the newer layout)
    qwen_config = json.loads((smollm2 / "tokenizer_config.json").read_text(encoding="utf-8"))
    qwen_config.update(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    qwen = _tokenizer_folder(tmp / "qwen-2.5-instruct", smollm2 / "tokenizer.json", qwen_config, QWEN_2_5_TEMPLATE)
    return {"smollm2": (smollm2, {}), "llama-3.2": (llama, {"date_string": PINNED_DATE}), "qwen-2.5": (qwen, {})}


@pytest.fixture(scope="module")
def templates(folders):
    return {name: (ChatTemplate.from_folder(folder), AutoTokenizer.from_pretrained(folder), variables)
            for name, (folder, variables) in folders.items()}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", ["smollm2", "llama-3.2", "qwen-2.5"])
def test_render_and_encode_equal_apply_chat_template(templates, name, conversation, add_generation_prompt):
    chat, reference, variables = templates[name]
    messages = CONVERSATIONS[conversation]
    text = chat.render(messages, add_generation_prompt=add_generation_prompt, **variables)
    expected_text = reference.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **variables)
    assert text == expected_text
    ids = chat.encode(messages, add_generation_prompt=add_generation_prompt, **variables)
    expected_ids = reference.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                 add_generation_prompt=add_generation_prompt, **variables)
    assert ids == expected_ids
    if add_generation_prompt:  # the prompt ends with the assistant's header, so the model answers next
        assert text.endswith({"llama-3.2": "<|start_header_id|>assistant<|end_header_id|>\n\n"}.get(
            name, "<|im_start|>assistant\n"))


def test_the_templates_render_what_their_models_were_trained_on(templates):
    """Spot checks by eye, independent of transformers: the special tokens sit where each format puts them."""
    smollm2, llama, qwen = (templates[n][0] for n in ("smollm2", "llama-3.2", "qwen-2.5"))
    hi = [{"role": "user", "content": "Hi"}]
    assert smollm2.render(hi, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert llama.render(hi, add_generation_prompt=True, date_string=PINNED_DATE) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert qwen.render(hi) == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                               "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    # One id per special token, and BOS written once, by the template (add_special_tokens=False)
    ids = llama.encode(hi, date_string=PINNED_DATE)
    assert ids[0] == 128000 and ids.count(128000) == 1 and ids.count(128009) == 2


def test_strftime_now_gives_both_the_same_date(templates, monkeypatch):
    """Without date_string, Llama 3.2's template calls strftime_now: pin the clock on both sides."""

    class FixedClock(_datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2025, 3, 5, 12, 0, 0)

    monkeypatch.setattr(hf_chat, "datetime", FixedClock)
    monkeypatch.setattr(hardway.text.chat, "datetime", FixedClock)
    chat, reference, _ = templates["llama-3.2"]
    messages = CONVERSATIONS["multi-turn with system"]
    text = chat.render(messages, add_generation_prompt=True)
    assert "Today Date: 05 Mar 2025\n" in text
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("source", [
    "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}",  # no HTML escaping, no \\u
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% if ns.n > 1 %}{% break %}"
    "{% endif %}{{ m.role }}{% endfor %}{{ ns.n }}",  # namespace and loopcontrols
    "{% for m in messages %}\n    {% if m.role == 'user' %}\n        U: {{ m.content }}\n    {% else %}\n"
    "{% generation %}A: {{ m.content }}{% endgeneration %}\n    {% endif %}\n{% endfor %}",  # trim/lstrip_blocks
    "{{ bos_token }}{{ eos_token }}{{ pad_token }}{{ unk_token }}{{ sep_token is defined }}{{ tools }}{{ documents }}",
])
def test_environment_equals_transformers(templates, source):
    """Filters, globals, whitespace control and variables: the same text as transformers for the same source."""
    chat, reference, _ = templates["smollm2"]
    messages = CONVERSATIONS["multi-turn with system"] + CONVERSATIONS["whitespace, unicode, a special token typed by the user"]
    ours = ChatTemplate(source, chat.special_tokens, chat.tokenizer)
    assert ours.render(messages) == reference.apply_chat_template(messages, chat_template=source, tokenize=False)


def test_jinja_file_wins_over_tokenizer_config(folders, tmp_path):
    smollm2, _ = folders["smollm2"]
    config = json.loads((smollm2 / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = "{{ 'from tokenizer_config.json' }}"
    folder = _tokenizer_folder(tmp_path / "both", smollm2 / "tokenizer.json", config, "{{ 'from the .jinja file' }}")
    hi = [{"role": "user", "content": "Hi"}]
    assert ChatTemplate.from_folder(folder).render(hi) == "from the .jinja file"
    assert AutoTokenizer.from_pretrained(folder).apply_chat_template(hi, tokenize=False) == "from the .jinja file"


def test_named_templates_in_tokenizer_config(folders, tmp_path):
    smollm2, _ = folders["smollm2"]
    config = json.loads((smollm2 / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    folder = _tokenizer_folder(tmp_path / "named", smollm2 / "tokenizer.json", config)
    assert read_chat_template(folder) == "plain"
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ChatTemplateError, match="none is named 'default'"):
        read_chat_template(folder)


def test_special_tokens_read_as_strings_or_dicts(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "pad_token": None,
         "chat_template": "x"}), encoding="utf-8")
    assert read_special_tokens(tmp_path) == {"bos_token": "<s>", "eos_token": "</s>"}


# ---- where generation stops ------------------------------------------------------------------------------------

def test_end_of_turn_ids(templates, folders, tmp_path):
    assert templates["smollm2"][0].end_of_turn_ids() == [2]          # <|im_end|>
    assert templates["qwen-2.5"][0].end_of_turn_ids() == [2]         # <|im_end|>, also its eos_token
    assert templates["llama-3.2"][0].end_of_turn_ids() == [128009]   # <|eot_id|>, also the Instruct eos_token
    # With the base model's eos_token (<|end_of_text|>), the turn still ends at <|eot_id|>, read from the template
    llama, _ = folders["llama-3.2"]
    config = json.loads((llama / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["eos_token"] = "<|end_of_text|>"
    base = _tokenizer_folder(tmp_path / "base-eos", llama / "tokenizer.json", config)
    assert ChatTemplate.from_folder(base).end_of_turn_ids() == [128009, 128001]


def test_end_of_turn_ids_without_any_is_an_error(templates):
    """A template that closes turns with plain text, and no eos_token: nothing to stop at, and it says so."""
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}\n{% endfor %}", {}, templates["smollm2"][0].tokenizer)
    assert plain.render([{"role": "user", "content": "a"}]) == "a\n"
    with pytest.raises(ChatTemplateError, match="cannot tell where an assistant turn ends"):
        plain.end_of_turn_ids()


# ---- templates that raise ---------------------------------------------------------------------------------------

def test_a_template_that_raises(templates):
    chat, reference, _ = templates["smollm2"]
    strict = ChatTemplate(STRICT_TEMPLATE, chat.special_tokens, chat.tokenizer)
    alternating = CONVERSATIONS["multi-turn without system"]
    assert strict.render(alternating) == reference.apply_chat_template(alternating, chat_template=STRICT_TEMPLATE,
                                                                       tokenize=False)
    two_users = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="must alternate"):
        reference.apply_chat_template(two_users, chat_template=STRICT_TEMPLATE, tokenize=False)
    with pytest.raises(ChatTemplateError, match="refused the conversation: Conversation roles must alternate"):
        strict.render(two_users)


def test_the_published_llama_template_raises_on_two_tool_calls(templates):
    chat, reference, variables = templates["llama-3.2"]
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call, call]}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="single tool-calls"):
        reference.apply_chat_template(messages, tokenize=False, **variables)
    with pytest.raises(ChatTemplateError, match="refused the conversation: This model only supports single tool-calls"):
        chat.render(messages, **variables)


@pytest.mark.parametrize("source, problem", [
    ("{% for m in messages %}{{ m.content }", "not valid Jinja"),
    ("{{ messages[7]['content'] }}", "failed on this conversation: UndefinedError"),
    ("{{ ''.__class__.__mro__ }}", "failed on this conversation"),
    ("{{ messages.append(1) }}", "failed on this conversation: SecurityError"),
    ("{% set ns = namespace(_x=1) %}", "failed on this conversation: SecurityError"),
])
def test_broken_or_hostile_templates(source, problem):
    with pytest.raises(ChatTemplateError, match=problem):
        ChatTemplate(source).render([{"role": "user", "content": "Hi"}])


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_a_folder_without_a_chat_template():
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTemplate.from_folder(checkpoint("openai-community/gpt2"))


@pytest.mark.parametrize("messages, problem", [
    ([], "the conversation is empty"),
    ("Hi", "must be a list"),
    (None, "must be a list"),
    (["Hi"], "message 0 is a str"),
    ([{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Beep"}], "message 1 has the unknown role 'robot'"),
    ([{"content": "Hi"}], "message 0 has no 'role'"),
    ([{"role": "user"}], r"message 0 \(user\) has no 'content'"),
    ([{"role": "user", "content": None}], r"message 0 \(user\) has no 'content'"),
    ([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "content of type list"),
])
def test_bad_messages(templates, messages, problem):
    chat = templates["smollm2"][0]
    with pytest.raises(ChatTemplateError, match=problem) as error:
        chat.encode(messages, add_generation_prompt=True)
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)

"""Chat templates render exactly as Hugging Face transformers' apply_chat_template renders them."""
from __future__ import annotations

import json

import pytest

from capsulert.errors import InvalidRequestError
from capsulert.chat.template import DEFAULT_TEMPLATE, ChatTemplate

CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# trim_blocks / lstrip_blocks matter here: block tags on their own indented lines
INDENTED = """{{ bos_token }}
{% for m in messages %}
    {% if m.role == 'user' %}
[INST] {{ m.content }} [/INST]
    {% elif m.role == 'assistant' %}
{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}
    {% else %}
{{ raise_exception('unknown role ' + m.role) }}
    {% endif %}
{% endfor %}
{{ {'n': messages | length, 'text': 'é<b>'} | tojson }}"""

CONVERSATION = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hello <there> é"},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again?"}]


def hf_render(model_dir, template, messages, add_generation_prompt, **special):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), chat_template=template, **special)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_template_matches_transformers(default_model_dir, add_generation_prompt):
    ours = ChatTemplate.for_model(default_model_dir, eos_token="<|endoftext|>")
    assert ours.origin == "capsulert's default template"
    got = ours.render(CONVERSATION, add_generation_prompt)
    assert got == hf_render(default_model_dir, DEFAULT_TEMPLATE.read_text(), CONVERSATION, add_generation_prompt,
                            eos_token="<|endoftext|>")
    assert got.startswith("<|system|>\nBe brief. <|endoftext|>\n") and got.endswith(
        "<|assistant|>\n" if add_generation_prompt else "Again?<|endoftext|>\n")


@pytest.mark.parametrize("template", [CHATML, INDENTED])
def test_checkpoint_templates_match_transformers(default_model_dir, tmp_path, template):
    for f in ("tokenizer.json", "config.json"):
        (tmp_path / f).write_bytes((default_model_dir / f).read_bytes())
    # tokenizer_config.json as checkpoints write it: named templates, special tokens as AddedToken dicts
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": template}],
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    messages = CONVERSATION[1:] if template is INDENTED else CONVERSATION
    ours = ChatTemplate.for_model(tmp_path)
    assert ours.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert ours.render(messages) == hf_render(tmp_path, template, messages, True, bos_token="<s>", eos_token="</s>")
    # a chat_template.jinja file wins over tokenizer_config.json (what transformers writes since 4.43)
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert ChatTemplate.for_model(tmp_path).render(messages) == str(len(messages))


def test_template_refusals_are_invalid_requests(default_model_dir):
    ours = ChatTemplate(INDENTED, "test", {"bos_token": "", "eos_token": "</s>"})
    with pytest.raises(InvalidRequestError, match="unknown role tool"):
        ours.render([{"role": "tool", "content": "x"}])
    default = ChatTemplate.for_model(default_model_dir)
    with pytest.raises(InvalidRequestError, match="no role 'wizard'"):
        default.render([{"role": "wizard", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="does not compile"):
        ChatTemplate("{% for %}", "broken")


def test_the_sandbox_keeps_templates_away_from_python(default_model_dir):
    sneaky = ChatTemplate("{{ messages.__class__.__mro__ }}", "test")
    with pytest.raises(InvalidRequestError):
        sneaky.render([{"role": "user", "content": "x"}])
    mutating = ChatTemplate("{{ messages.append(1) }}", "test")
    with pytest.raises(InvalidRequestError):
        mutating.render([{"role": "user", "content": "x"}])


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city é",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]


def test_default_template_with_tools_matches_transformers(default_model_dir):
    from transformers import PreTrainedTokenizerFast

    ours = ChatTemplate.for_model(default_model_dir, eos_token="<|endoftext|>")
    got = ours.render(TOOL_CONVERSATION, True, tools=TOOLS)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(default_model_dir / "tokenizer.json"),
                                  chat_template=DEFAULT_TEMPLATE.read_text(), eos_token="<|endoftext|>")
    assert got == tok.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert got.startswith("<|system|>\nBe brief.\n\n# Tools\n") and "\n<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) in got
    assert ('<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|endoftext|>') in got
    assert "<|tool|>\n<tool_response>\nrain\n</tool_response><|endoftext|>\n<|assistant|>\n" in got
    # without tools the template writes what it always wrote
    assert ours.render(CONVERSATION, True) == ours.render(CONVERSATION, True, tools=None)

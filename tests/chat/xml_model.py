"""A checkpoint whose chat template writes tool calls as Qwen3.5's and Qwen3-Coder's do
(`<function=...><parameter=...>`): the default model's files beside that template."""
from __future__ import annotations

from pathlib import Path

XML_TEMPLATE = """{%- for message in messages %}
{{- '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}
{%- for call in message.get('tool_calls') or [] %}
{%- set call = call['function'] %}
{{- '<tool_call>\\n<function=' + call['name'] + '>\\n' }}
{%- for name, value in call['arguments'] | items %}
{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|endoftext|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"""


def xml_model_dir(default_model_dir: Path, dest: Path) -> Path:
    """`dest` made a model directory: the default model's files (linked) and XML_TEMPLATE."""
    for f in default_model_dir.iterdir():
        (dest / f.name).symlink_to(f)
    (dest / "chat_template.jinja").write_text(XML_TEMPLATE, encoding="utf-8")
    return dest

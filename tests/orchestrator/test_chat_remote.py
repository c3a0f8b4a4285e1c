"""The chat API through the orchestrator: RemoteSession.append_chat renders on the worker with the same code
as the in-process engine, and RemoteSession.chat's reply (constrained tool call, parsed) equals Engine.chat's."""
import json

import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                                          "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}}
CHAT = [{"role": "user", "content": "Weather in Oslo?"}]


async def test_remote_chat_equals_in_process(orch, fresh):
    want = fresh.chat(CHAT, 60, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    s = await orch.open()
    try:
        got = await s.chat(CHAT, 60, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    finally:
        await s.close()
    assert list(got.result) == list(want.result) and got.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == \
           [(c.name, json.loads(c.arguments)) for c in want.tool_calls]
    s = await orch.open()
    try:
        await s.append_chat(CHAT, tools=[WEATHER])
        assert await s.tokens() == fresh.codec.chat.encode(_prompt())
    finally:
        await s.close()


def _prompt():
    from capsulert.protocol.conversation import ChatPrompt

    return ChatPrompt.of(CHAT, [WEATHER])


async def test_remote_chat_forces_calls_in_the_workers_template_markup(ray_session, default_model_dir, tmp_path):
    """A checkpoint whose template writes Qwen3.5's XML calls: the orchestrator's session forces the call in
    that markup (the worker says which in its ping), as the in-process Engine.chat does."""
    from capsulert.engine.engine import Engine
    from capsulert.orchestrator import Orchestrator
    from tests.chat.xml_model import xml_model_dir

    cfg = dict(model=str(xml_model_dir(default_model_dir, tmp_path)), device="cpu", slots=2, max_seq=1024, prefill_chunk=128)
    local = Engine.from_config(cfg)
    want = local.chat(CHAT, 60, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    local.close()
    orch = await Orchestrator.start(dict(engine=cfg, call_timeout_s=60, torch_threads=1))
    try:
        s = await orch.open()
        got = await s.chat(CHAT, 60, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
        await s.close()
    finally:
        await orch.close()
    assert got.result.text.startswith("<tool_call>\n<function=get_weather>") and got.finish_reason == "tool_calls"
    assert list(got.result) == list(want.result)

"""What a program says about its model before its output: the embedded default model (and `random:<shape>`)
has random weights, so its text is noise by design, and a user should learn that, and how to use a real
checkpoint, from the first lines the demo, the examples and `capsulert serve` print."""
from __future__ import annotations

RANDOM_PREFIX = "random:"  # as capsulert/engine/engine.py reads EngineConfig.model
HOW_TO_USE_A_CHECKPOINT = ("pass --model DIR, a Qwen3.5 checkpoint directory in HF format (config.json, "
                           "model*.safetensors, tokenizer.json), for real text")


def random_weights_notice(model: str) -> str | None:
    """One line saying that `model` has random weights and how to use a real checkpoint; None for a checkpoint."""
    if model == "default":
        what = "the embedded default model"
    elif model.startswith(RANDOM_PREFIX):
        what = f"model {model}"
    else:
        return None
    return f"{what} has random weights (a test model for the runtime): its text is noise; {HOW_TO_USE_A_CHECKPOINT}"

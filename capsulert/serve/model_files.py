"""The served model's files as the server process reads them (tokenizer, chat template, vocabulary size),
found from the engine config the workers load."""
from __future__ import annotations

from pathlib import Path

from capsulert.config.engine import EngineConfig
from capsulert.config.model import ModelConfig
from capsulert.config.engine import RANDOM_PREFIX


def model_dir(engine: EngineConfig) -> Path | None:
    """The checkpoint directory of the served model (tokenizer, chat template); None for random weights."""
    if engine.model.startswith(RANDOM_PREFIX):
        return None
    if engine.model == "default":
        from capsulert.engine.default_model import ensure_default_model

        return ensure_default_model(Path(engine.cache_dir) if engine.cache_dir else None, engine.progress)
    return Path(engine.model)


def model_config(engine: EngineConfig) -> ModelConfig:
    """The served model's architecture: its config.json, or the YAML of random weights."""
    if engine.model.startswith(RANDOM_PREFIX):
        return ModelConfig.from_file(engine.model[len(RANDOM_PREFIX):])
    return ModelConfig.from_file(model_dir(engine) / "config.json")


def vocab_size(engine: EngineConfig) -> int:
    return model_config(engine).vocab_size

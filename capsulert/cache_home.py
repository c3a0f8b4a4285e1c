"""Where capsulert keeps what it makes once and reuses: the default model, checkpoint fingerprints."""
from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """capsulert's cache directory: $XDG_CACHE_HOME/capsulert, else ~/.cache/capsulert (not created here)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "capsulert"

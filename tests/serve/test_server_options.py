"""The server's options: where its orchestrator defaults differ from a library caller's, and that what the
user sets wins over them (config/server.py)."""
from pathlib import Path

import pytest

from capsulert.config.orchestrator import OrchestratorConfig
from capsulert.config.server import ServerOptions
from capsulert.errors import ConfigError


def test_a_server_reuses_prefixes_waits_longer_and_bounds_its_queue_where_a_library_caller_does_not():
    library, server = OrchestratorConfig(), ServerOptions.build()
    assert (library.engine.prefix_cache, library.call_timeout_s) == (False, 60.0)
    assert server.engine.prefix_cache is True and server.orchestrator.call_timeout_s == 600.0
    assert server.max_inflight == server.orchestrator.max_queued == 256
    assert ServerOptions().orchestrator == server.orchestrator  # the same defaults, built or not


def test_what_the_user_sets_wins_over_the_server_defaults_and_the_rest_stay():
    opts = ServerOptions.build(orchestrator={"call_timeout_s": 5, "engine": {"prefix_cache": False, "slots": 3}})
    assert opts.orchestrator.call_timeout_s == 5.0 and opts.engine.prefix_cache is False
    assert opts.engine.slots == 3 and opts.max_inflight == 256  # untouched: the server's default


def test_paths_become_absolute_for_the_workers_and_bad_values_are_typed():
    opts = ServerOptions.build(orchestrator={"engine": {"model": "random:configs/x.yaml", "disk_dir": "d"}})
    assert opts.engine.model == "random:" + str(Path("configs/x.yaml").resolve())
    assert opts.engine.disk_dir == str(Path("d").resolve())
    with pytest.raises(ConfigError, match="orchestrator.call_timeout_s"):
        ServerOptions.build(orchestrator={"call_timeout_s": -1})

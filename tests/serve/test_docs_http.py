"""The docs' Python blocks that talk to `capsulert serve` run as written against a server started as the docs
say (`capsulert serve`: no keys, model "default"), with its port in place of the docs' :8000."""
from __future__ import annotations

import pytest
from conftest import running_server
from docs_blocks import SERVER_URL, python_blocks, run_block

HTTP = [b for b in python_blocks() if b.no_run is None and b.needs_server]


@pytest.fixture(scope="module")
def open_server(default_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("docs-serve")
    # the suite's servers hold 512 tokens a session; the docs' prompts need `capsulert serve`'s own default
    with running_server(default_model_dir, work, "--max-seq", "4096", keys=False, model="default") as srv:
        yield srv


def test_the_docs_show_the_server_from_python():
    assert len(HTTP) >= 2


@pytest.mark.parametrize("block", HTTP, ids=[b.id for b in HTTP])
def test_http_block_runs_as_written(block, open_server, tmp_path):
    proc = run_block(block.code.replace(SERVER_URL, open_server.url), tmp_path, env=None)
    assert "Traceback" not in proc.stderr

"""Progress bars: drawn on a terminal (or when asked for), never otherwise: not off a terminal, not when the
caller turns them off, and so never in the test suite's captured output. Weight loading and long prefills
draw theirs through EngineConfig.progress. (Default-model generation: tests/worker/test_default_model.py;
shards named while loading: tests/worker/test_loader.py; graph capture: tests/worker/test_graphs.py, GPU.)"""
import io
import queue

import pytest

from capsulert import EngineConfig
from capsulert.progress import NullBar, progress_bar, wanted
from capsulert.engine.engine import LONG_PREFILL_CHUNKS

CHUNK = 128  # make_engine's prefill_chunk


def test_auto_means_a_terminal(terminal):
    assert wanted(True, io.StringIO()) and not wanted(False, terminal)
    assert wanted(None, terminal) and not wanted(None, io.StringIO())
    assert not wanted(None, object())  # a stream without isatty is no terminal


def test_a_bar_is_drawn_on_a_terminal_only(terminal, capsys):
    with progress_bar(3, "off a terminal", progress=None) as bar:  # pytest captures stderr: no terminal
        bar.update(3)
    assert isinstance(bar, NullBar) and capsys.readouterr() == ("", "")
    terminal.attach()
    with progress_bar(3, "refused", progress=False) as bar:
        bar.update(3)
    assert isinstance(bar, NullBar) and terminal.getvalue() == ""
    with progress_bar(3, "on a terminal", progress=None, unit="step") as bar:
        bar.set_postfix_str("first")
        bar.update()
    assert "on a terminal" in terminal.getvalue() and "0/3" in terminal.getvalue()


def test_progress_is_an_engine_setting():
    assert EngineConfig().progress is None  # auto
    assert EngineConfig(progress=False).progress is False


def test_engine_loading_and_long_prefills_draw_bars_when_asked(make_engine, text, capsys, monkeypatch):
    monkeypatch.setattr("capsulert.progress.SHOW_AFTER_S", 0)
    eng = make_engine(progress=True)  # drawn on the captured stderr: asked for
    assert "capsulert: loading weights" in capsys.readouterr().err
    ids = eng.tokenize(text * 3)
    assert len(ids) > (LONG_PREFILL_CHUNKS + 1) * CHUNK
    s = eng.open()
    s.append(ids[:LONG_PREFILL_CHUNKS * CHUNK])  # a few chunks: over before any bar would help
    assert capsys.readouterr().err == ""
    s.append(ids[LONG_PREFILL_CHUNKS * CHUNK:])
    chunks = -(-(len(ids) - LONG_PREFILL_CHUNKS * CHUNK) // CHUNK)
    assert chunks > LONG_PREFILL_CHUNKS
    err = capsys.readouterr().err
    assert "capsulert: prefill" in err and f"0/{chunks}" in err
    s.close()


@pytest.mark.parametrize("progress", [None, False])
def test_no_bar_in_captured_output_or_when_turned_off(make_engine, text, capsys, monkeypatch, progress):
    monkeypatch.setattr("capsulert.progress.SHOW_AFTER_S", 0)
    eng = make_engine(progress=progress)
    s = eng.open()
    s.append(text * 3)  # a long prefill
    s.close()
    assert capsys.readouterr() == ("", "")


def test_a_long_prefill_through_the_step_scheduler_draws_one_bar_over_its_pieces(make_engine, text, capsys,
                                                                                monkeypatch):
    from capsulert.scheduler.step_scheduler import StepScheduler, queue_sink
    from capsulert.protocol.requests import Open

    monkeypatch.setattr("capsulert.progress.SHOW_AFTER_S", 0)
    eng = make_engine(progress=True)
    capsys.readouterr()
    ids = eng.tokenize(text * 3)
    chunks = -(-len(ids) // CHUNK)
    assert chunks > LONG_PREFILL_CHUNKS
    sch = StepScheduler(eng)  # its loop cuts the prompt into one chunk per step
    try:
        for prompt, drawn in ((ids[:LONG_PREFILL_CHUNKS * CHUNK], False), (ids, True)):
            out = queue.Queue()
            sch.submit(Open(prompt), queue_sink(out.put))
            kind, value = out.get(timeout=60)
            assert kind == "done" and value.length == len(prompt)
            err = capsys.readouterr().err
            assert ("capsulert: prefill (session" in err) is drawn
            if drawn:  # one bar over the whole prompt, not one per piece
                assert err.count(f"| 0/{chunks} ") == 1
    finally:
        sch.stop()

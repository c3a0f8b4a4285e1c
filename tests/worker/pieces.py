"""What the engine runs, seen from a test."""


def count_pieces(eng, monkeypatch) -> list[int]:
    """The length of every prefill piece the engine runs from now on (a graph replay on CUDA, else a forward)."""
    pieces = []
    if eng.graphs is not None:
        prefill = eng.graphs.prefill
        monkeypatch.setattr(eng.graphs, "prefill", lambda slot, tokens, **k: (pieces.append(len(tokens)),
                                                                              prefill(slot, tokens, **k))[1])
    else:
        forward = eng.model.forward
        monkeypatch.setattr(eng.model, "forward", lambda *a, **k: (pieces.append(a[2].shape[1]), forward(*a, **k))[1])
    return pieces

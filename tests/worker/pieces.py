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
        def counted(*a, **k):  # the real rows: a CPU piece is padded to whole rows (Engine.cpu_piece_rows)
            pieces.append(int(k["valid"][0]) if k.get("valid") is not None else a[2].shape[1])
            return forward(*a, **k)
        monkeypatch.setattr(eng.model, "forward", counted)
    return pieces

"""An aggregator's checkpoint: its global weights, outer state and downlink view.

Written under the server's checkpoint round directory as ``aggregator_{i}/`` (safetensors and
JSON only: nothing that runs code when loaded), inside the round's manifest, so the server's
checkpoint verifies and commits it with the rest. After a load the groups get full snapshots
(the encoded delta of the last round is not kept).
"""

from __future__ import annotations

import json
from pathlib import Path

STATE = "state.json"
ARRAYS = "arrays.safetensors"


def save(state, directory: Path) -> None:
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    arrays = dict(state.buffers())
    if state.view is not None:
        arrays["view"] = state.view
    save_file(arrays, str(directory / ARRAYS))
    meta = {"round": state.round, "index": state.index, "numel": state.numel}
    (directory / STATE).write_text(json.dumps(meta) + "\n")


def load(state, directory: Path) -> None:
    from safetensors.numpy import load_file

    meta = json.loads((directory / STATE).read_text())
    if (meta["index"], meta["numel"]) != (state.index, state.numel):
        raise ValueError(
            f"{directory}: a checkpoint of aggregator {meta['index']} ({meta['numel']} values), "
            f"not of aggregator {state.index} ({state.numel})"
        )
    arrays = load_file(str(directory / ARRAYS))
    for name, buf in state.buffers().items():
        buf[:] = arrays[name]
    if state.view is not None:
        state.view[:] = arrays["view"]
    with state._lock:
        state.round = int(meta["round"])
        state.delta, state.delta_round = None, -1
        state.pipe.forget()

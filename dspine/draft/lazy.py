"""A draft whose weights are read on first use: its config now, its tensors when a stream keeps it.

Why: under ``proposers=auto`` a stream decides before its first prefill whether the draft can pay at the rows it
admits (``decoding.rounds.draft_cannot_pay``); on the 2-core EPYC of issue 44 it cannot at 8 rows and more, so the
README main job and every larger batch read, convert and pack a draft that never proposes (0.1-0.2 s of a job's
start and ~25 MB at its peak). A ``LazyDraft`` answers what the loop reads before that choice (block size, the
target layers it taps, whether dynamic stopping is on) from ``config.json`` and the checkpoint's header, and loads
the draft itself only when something asks for more (a prefill computing its taps, a proposal, a calibration).

What can be checked without reading a tensor is checked at once, so a broken draft directory still fails before
the model loads, in one line (``io.read_draft_header``, which ``load_draft`` starts from too): the config, that the
weights exist and their header reads, and a ``confidence_trained`` config without the head's tensors. The rest of
``load_draft``'s strict checks (every tensor present with its shape, a sorted draft vocabulary) run at the first
use; a failure there is a ``RuntimeError`` naming the directory (the engine's one-line fatal error), never a
half-loaded draft.

``release`` forgets the loaded draft (a retired draft, ``decoding.rounds``), so the next use loads it again: one
handle serves every stream of a long-lived engine, whichever of them retire it. Its weights go with the last
reference to it, at once (nothing in a loaded draft refers back to it, so no garbage collection is needed): a stream
that retires it frees them, and another stream of the engine still proposing with it keeps it whole until it lets
go. (``DSpineDraft.release`` would turn the parameters into meta tensors under that stream's feet; a lock makes two
streams asking at once read the draft once.) Tokens never depend on when the draft was loaded (the same file, the
same packing).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dspine.draft.io import read_draft_header


class LazyDraft:
    """The draft in ``path``, loaded by ``open_draft(path)`` on first use (see the module docstring). Attributes
    the decoding loop reads before it decides (``block_size``, ``target_layer_ids``, ``confidence_enabled``,
    ``config``) come from the config; any other attribute is the loaded draft's."""

    def __init__(self, path: str | Path, open_draft: Callable[[Path], Any]):
        path = Path(path)
        cfg, spec, has_head = read_draft_header(path)  # the config and the checkpoint's header: no tensor is read
        self.path, self.config = path, cfg
        self.block_size = spec.block_size
        self.target_layer_ids = list(spec.target_layer_ids)
        self.confidence_enabled = has_head and spec.confidence_trained
        self._open = open_draft
        self._model: Any = None
        self._lock = threading.Lock()
        self.loads = 0  # how many times the weights were read (tests; a job reads them at most once a stream)

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def model(self) -> Any:
        """The loaded draft (read now if it is not)."""
        with self._lock:
            if self._model is None:
                try:
                    self._model = self._open(self.path)
                except (ValueError, OSError) as e:  # ModelLoadError is a ValueError
                    raise RuntimeError(f"cannot load the draft {self.path}: {e}") from e
                self.loads += 1
            return self._model

    def release(self) -> None:
        """Forget the loaded draft: its weights go with the last reference to it, the next use loads it again."""
        with self._lock:
            self._model = None

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not found on the handle: everything else is the draft's own
        if name.startswith("__") or name in ("_model", "_open", "_lock"):
            raise AttributeError(name)
        return getattr(self.model(), name)

    def __repr__(self) -> str:
        return f"LazyDraft({str(self.path)!r}, loaded={self.loaded})"

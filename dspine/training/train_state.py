"""What ``dspine train`` needs besides the weights to continue a run exactly where it stopped.

A CPU run that spans days is stopped and restarted many times; it must end where an uninterrupted run ends.
So a checkpoint holds, next to the draft's weights: the optimiser state, the schedule position (the next step
and the training time spent, which paces the schedules under a time budget), every random state the loop
draws from (anchor/replacement generator, the shuffle's ``random.Random``, torch's global RNGs) and the data
cursor (epoch and the indices left in the current shuffled order). Loaded into the same loop on the same
data, the remaining steps then replay bit for bit on CPU fp32.

Resuming with different data or a setting that changes the result is refused with one line naming the
setting: silently mixing two runs would make a checkpoint's history a lie. ``steps``, ``time_budget_s``,
``save_every`` and ``log_every`` may change (extending a finished run is the point of resuming), and so may
``alignment_warmup_steps``, which ``train_embedded.py`` derives from ``steps``. A resumed run with other
values continues correctly but is no longer bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

STATE_FILE = "trainer_state.pt"
MAY_CHANGE = frozenset({"steps", "time_budget_s", "save_every", "log_every", "alignment_warmup_steps"})


class ResumeError(ValueError):
    """A checkpoint that cannot be resumed by this run; the message names the file and the reason."""


@dataclass
class TrainerState:
    step: int  # the next optimiser step to run
    elapsed_s: float  # training seconds spent before this session (time budgets count across sessions)
    optimizer: dict
    py_rng: tuple  # random.Random.getstate() of the shuffler
    gen: torch.Tensor  # anchor / replacement generator state
    torch_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    order: list[int]  # indices left in the current epoch's shuffled order (popped from the end)
    epoch: int
    config: dict
    data_fingerprint: str
    history: list[dict] = field(default_factory=list)


def data_fingerprint(examples: Sequence) -> str:
    """sha256 over every example's ids, loss mask and label mode: resuming on other data is refused."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(ex.ids.to(torch.int64).cpu().numpy().tobytes())
        h.update(ex.loss_mask.to(torch.uint8).cpu().numpy().tobytes())
        h.update(b"T" if getattr(ex, "teacher_forced", False) else b"R")
    return f"{len(examples)}:{h.hexdigest()}"


def write_state(directory: str | Path, state: TrainerState) -> None:
    """Write ``trainer_state.pt`` into ``directory`` (the caller makes the directory swap atomic)."""
    torch.save(state.__dict__, Path(directory) / STATE_FILE)


def read_state(directory: str | Path) -> TrainerState | None:
    """The state saved in ``directory``, or None when there is none (a fresh run)."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        return None
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
        return TrainerState(**raw)
    except Exception as e:  # noqa: BLE001 - any unreadable state is the same user error
        reason = " ".join(str(e).split())[:200]
        raise ResumeError(f"{path}: unreadable trainer state ({type(e).__name__}: {reason})") from None


def check_resumable(state: TrainerState, config: dict, fingerprint: str, where: str | Path) -> None:
    """Refuse a resume whose data or result-changing settings differ from the checkpoint's."""
    if state.data_fingerprint != fingerprint:
        n_old, n_new = state.data_fingerprint.split(":")[0], fingerprint.split(":")[0]
        raise ResumeError(
            f"{where}: the checkpoint was trained on other data ({n_old} examples then, {n_new} now, or changed "
            "contents); resume with the same data or train into a new output directory"
        )
    for key, value in config.items():
        if key in MAY_CHANGE or key not in state.config:
            continue
        if state.config[key] != value:
            raise ResumeError(
                f"{where}: the checkpoint was trained with {key}={state.config[key]!r}, this run asks {value!r}; "
                "use the same setting or train into a new output directory"
            )

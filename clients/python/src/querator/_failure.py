"""Failure text: an exception as the ``error`` a Retry carries (the item's ``last_error``)."""

from __future__ import annotations

import traceback

#: What the server keeps of a Retry's error text, in bytes of UTF-8 (RetryItem.error);
#: it cuts longer text and marks the cut.
MAX_ERROR_BYTES = 2048

_TRACEBACK = "Traceback (most recent call last):\n"
# Where an exception raised in another process (a handler run with executor="process")
# keeps its frames there, as text: its own traceback did not cross the pickle.
_FRAMES = "_querator_frames"


def remember_frames(error: BaseException, frames: list[str]) -> None:
    """Keep ``frames`` (traceback.format_tb of where ``error`` was raised, in another
    process) for :func:`failure_text`, which shows them as the latest frames."""
    try:
        setattr(error, _FRAMES, list(frames))
    except AttributeError:  # an exception type with __slots__: its local frames only
        pass


def failure_text(error: BaseException) -> str:
    """``error`` as failure text: its type and message first, then the last frames of
    its traceback, as many as fit in :data:`MAX_ERROR_BYTES` (the frame that raised
    is kept before the ones that called it; a line says how many earlier frames were
    left out). A message that alone passes the bound is sent whole: the server cuts it
    and marks the cut.
    """
    head = "".join(traceback.format_exception_only(type(error), error)).rstrip("\n")
    # The frames here called into the other process, whose frames are the latest.
    frames = traceback.format_tb(error.__traceback__) if error.__traceback__ is not None else []
    frames += getattr(error, _FRAMES, None) or []
    size = len(head.encode()) + 1 + len(_TRACEBACK)
    if not frames or size > MAX_ERROR_BYTES:
        return head
    kept: list[str] = []
    for frame in reversed(frames):
        cost = len(frame.encode())
        left_out = len(frames) - len(kept) - 1
        note = len(_omitted(left_out)) if left_out else 0
        if size + cost + note > MAX_ERROR_BYTES:
            break
        kept.append(frame)
        size += cost
    if not kept:
        return head
    left_out = len(frames) - len(kept)
    return head + "\n" + _TRACEBACK + (_omitted(left_out) if left_out else "") + "".join(reversed(kept)).rstrip("\n")


def _omitted(count: int) -> str:
    return f"  ... {count} earlier frame{'' if count == 1 else 's'} left out\n"

"""One error for every rank of a manager: what each rank reports of its part of a collective
step (its error, if any) and the error all ranks raise from those reports."""

from __future__ import annotations

from ...errors import DeepNVMeIOError, DistributedSaveError

__all__ = ["Failure", "describe", "failed"]

Failure = tuple[str, str, "int | None"]  # (error type, message, errno) as sent to the other ranks


def describe(exc: BaseException | None) -> Failure | None:
    """What a rank sends the others about its ``exc`` (None: it succeeded)."""
    if exc is None:
        return None
    return type(exc).__name__, str(exc), exc.errno if isinstance(exc, OSError) else None


def failed(what: str, votes: list[Failure | None], own: BaseException | None) -> BaseException:
    """One error for every rank: what failed on which rank (an I/O error's errno kept)."""
    bad = [(r, v) for r, v in enumerate(votes) if v is not None]
    text = "; ".join(f"rank {r}: {kind}: {msg}" for r, (kind, msg, _) in bad)
    codes = [code for _, (_, _, code) in bad if code is not None]
    err: BaseException
    if codes:
        err = DeepNVMeIOError(f"{what} failed on rank {', '.join(str(r) for r, _ in bad)} ({text})",
                              path=getattr(own, "filename", None), offset=None, size=None, errno=codes[0])
    else:
        err = DistributedSaveError(f"{what} failed on rank {', '.join(str(r) for r, _ in bad)} ({text})")
    err.__cause__ = own
    return err

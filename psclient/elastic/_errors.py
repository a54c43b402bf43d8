"""The exceptions of elastic training, each naming a recovery decision (as Horovod's do)."""

from __future__ import annotations

from pscore.errors import AbortedError, UnavailableError


class HorovodInternalError(AbortedError, RuntimeError):
    """A collective failed because the ring broke (a rank died, left or stopped answering).

    In elastic mode (``hvd.elastic.run``) this is recoverable: the ranks that are left restore
    the last committed state, form a new ring and go on. Outside elastic mode it ends the job.

    Attributes:
        generation: the ring generation (1, 2, ... in a psrun elastic job; 0 outside one) that broke.
        lost_ranks: the ranks (of that generation) known or suspected to be gone; may be empty.
        reason: what broke it, e.g. ``"rank 1 (worker 1) exited with status -9"``.
    """

    def __init__(self, reason: str, *, generation: int = 0, lost_ranks: tuple[int, ...] = ()) -> None:
        self.reason = reason
        self.generation = generation
        self.lost_ranks = lost_ranks
        lost = f" (lost rank(s) {list(lost_ranks)})" if lost_ranks else ""
        super().__init__(f"the ring of generation {generation} broke{lost}: {reason}")  # a PSError (ABORTED)


class HostsUpdatedInterrupt(RuntimeError):
    """Ranks can join (or were removed): raised by ``State.commit`` on every rank at the same commit.

    The ranks then form a new ring without restoring (the state was just committed) and sync the
    state to the new ranks from rank 0, unless ``skip_sync``.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        self.skip_sync = skip_sync
        super().__init__("the set of ranks changed: re-forming the ring at this commit")


class RendezvousError(UnavailableError, RuntimeError):
    """psrun's rendezvous cannot be reached, refused this worker, or ended the job (the message says).

    A ``PSError`` (UNAVAILABLE), and a ``RuntimeError`` as before.
    """

"""Horovod's elastic state objects and the run loop, framework-free (``horovod.common.elastic``'s names)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from psclient.elastic._errors import HostsUpdatedInterrupt, RendezvousError

log = logging.getLogger(__name__)

R = TypeVar("R")


class State:
    """State that every rank keeps in memory and that survives a reset of the ring.

    ``commit()`` saves it (a copy in host memory) and then checks, with one small collective,
    whether ranks are waiting to join: if so, every rank raises :class:`HostsUpdatedInterrupt` at
    this same commit. ``restore()`` goes back to the last commit; ``sync()`` gives every rank rank
    0's state. Subclasses implement ``save``, ``restore`` and ``sync``.

    Args:
        bcast_object: broadcasts a picklable object from rank 0 (``hvd.broadcast_object``).
        get_rank: this process's current rank (``hvd.rank``).
        hosts_updated: the collective check behind ``commit`` (the elastic session's), or None outside a
            psrun elastic job (then ``commit`` only saves).
    """

    def __init__(
        self,
        bcast_object: Callable[[Any], Any],
        get_rank: Callable[[], int],
        hosts_updated: Callable[[], bool] | None = None,
    ) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._hosts_updated = hosts_updated
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions to call after each reset (new ring, before the state is synced): e.g. to scale the
        learning rate with the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs ``reset()`` then the registered reset callbacks (the run loop calls it)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state, then raises :class:`HostsUpdatedInterrupt` (on every rank) if ranks wait to join.

        A commit copies the state to host memory: commit every few batches rather than every batch when
        the model is large (a failure loses the work since the last commit).

        Raises:
            HostsUpdatedInterrupt: ranks are waiting to join; the run loop re-forms the ring.
            HorovodInternalError: the ring broke during the check.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises :class:`HostsUpdatedInterrupt` on every rank when ranks wait to join (a collective)."""
        if self._hosts_updated is not None and self._hosts_updated():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Saves the state in host memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Goes back to the last committed state."""
        raise NotImplementedError

    def sync(self) -> None:
        """Gives every rank rank 0's state (a collective)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adjusts to a new ring (before ``sync``); nothing by default."""


class ObjectState(State):
    """State made of picklable Python objects, given as keyword arguments and kept as attributes.

    Example::

        state = ObjectState(hvd.broadcast_object, hvd.rank, epoch=0, batch=0)
        state.epoch += 1
        state.commit()

    Args:
        bcast_object, get_rank, hosts_updated: as for :class:`State`.
        **kwargs: the attributes to keep (their committed values are restored and synced).
    """

    def __init__(
        self,
        bcast_object: Callable[[Any], Any],
        get_rank: Callable[[], int],
        hosts_updated: Callable[[], bool] | None = None,
        **kwargs: Any,
    ) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank, hosts_updated)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


def run_fn(
    func: Callable[..., R],
    reset: Callable[[], None] | None,
    is_ring_failure: Callable[[BaseException], bool],
) -> Callable[..., R]:
    """Horovod's elastic run loop around ``func(state, *args, **kwargs)``.

    Syncs the state, then runs ``func``. When a collective fails because the ring broke
    (``is_ring_failure``), restores the last commit, calls ``reset`` (a new ring with the ranks that
    are left and any new ones), runs the state's reset callbacks, syncs and runs ``func`` again; when
    ``commit`` raised :class:`HostsUpdatedInterrupt`, the same without the restore. A ring that breaks
    during the reset callbacks or the sync is handled the same way. :class:`RendezvousError` (psrun
    ended the job) and any other error propagate.

    Args:
        func: the training function; its first argument is the :class:`State`.
        reset: forms the next ring, or None outside a psrun elastic job (nothing is retried).
        is_ring_failure: whether an exception means the ring broke (and so recovery can help).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        skip_sync, pending_reset = False, False
        while True:
            try:
                if pending_reset:
                    assert reset is not None
                    reset()
                    pending_reset = False
                    state.on_reset()  # may run collectives: a ring that breaks here is handled below
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except RendezvousError:
                raise  # psrun ended the job: nothing to retry
            except HostsUpdatedInterrupt as interrupt:
                if reset is None:
                    raise
                log.info("ranks are waiting to join: re-forming the ring at this commit")
                skip_sync, pending_reset = interrupt.skip_sync, True
            except Exception as err:
                if reset is None or not is_ring_failure(err):
                    raise
                log.warning("%s; restoring the last commit and re-forming the ring", err)
                state.restore()
                skip_sync, pending_reset = False, True

    return wrapper

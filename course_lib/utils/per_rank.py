"""State that belongs to a rank: one per process, and one per simulated rank.

The course counts what each rank sends in module-level objects (``hooks.traffic``,
``collectives.sent``): a process is a rank. In a simulation (:mod:`course_lib.simulated`) the ranks
are threads of one process, and each must count its own. :class:`PerRank` holds one object per
simulated rank, and the process's own for everything else (a real process, and any thread a rank
starts of its own), and hands attribute reads and writes to the one of the rank asking.
"""

import threading

_local = threading.local()


def simulated_rank() -> int | None:
    """The rank this thread simulates, or ``None`` outside a simulation."""
    return getattr(_local, "rank", None)


def set_simulated_rank(rank: int | None) -> None:
    """Called by :func:`course_lib.simulated.simulate` in each rank's thread."""
    _local.rank = rank


class PerRank:
    """``PerRank(factory)``: behaves as ``factory()``, one instance per simulated rank."""

    def __init__(self, factory):
        object.__setattr__(self, "_factory", factory)
        object.__setattr__(self, "_own", factory())
        object.__setattr__(self, "_by_rank", {})
        object.__setattr__(self, "_lock", threading.Lock())

    def _current(self):
        rank = simulated_rank()
        if rank is None:
            return self._own
        with self._lock:
            if rank not in self._by_rank:
                self._by_rank[rank] = self._factory()
            return self._by_rank[rank]

    def forget_simulated_ranks(self) -> None:
        """Drop the simulated ranks' instances (a new simulation starts them afresh)."""
        with self._lock:
            self._by_rank.clear()

    def __getattr__(self, name):
        return getattr(self._current(), name)

    def __setattr__(self, name, value):
        setattr(self._current(), name, value)

    def __repr__(self):
        return f"PerRank({self._current()!r})"

"""Sessions: each holds one sequence's recurrent state between requests.

A session is created empty; its first prefill fixes its head configuration (Hq, Hv, K, V, state dtype) and
every later one must match it (409). Its state lives in one of three places:

* nowhere yet (new session): it continues from zeros;
* a row of the state pool on the backend's device (*resident*);
* its file under ``--state-dir`` (*spilled*): written when the pool needs the row for another session (least
  recently used first) and at shutdown; read back into the pool on the session's next use, and the file is then
  removed (it would go stale with the next turn).

So a clean shutdown (SIGTERM) loses nothing, and a crash loses exactly the sessions that were resident or never
spilled: after the restart they answer 404, never a stale or zero state.

Thread model: every method takes the store's lock. The launch worker calls :meth:`acquire` for each request
(pins the sessions' rows), :meth:`gather` once for the launch (one device op for all its session rows), computes
without the lock, then :meth:`commit` (one scatter) and :meth:`release`.
"""
from __future__ import annotations

import fcntl
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from . import state_files
from .errors import SessionConflict, SessionNotFound, StateMemoryFull
from .state_pool import StatePool, StateShape

log = logging.getLogger("server.sessions")

SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{22}$")  # secrets.token_urlsafe(16); also safe as a file name
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_REMEMBERED_EXPIRED = 4096  # expired ids still answered with reason session_expired


class SessionConfig(NamedTuple):
    num_qk_heads: int
    num_v_heads: int
    head_dim_k: int
    head_dim_v: int
    state_dtype: str  # "float32" | "float64"

    @property
    def shape(self) -> StateShape:
        return StateShape(self.num_v_heads, self.head_dim_k, self.head_dim_v, _DTYPES[self.state_dtype])

    def describe(self) -> str:
        return (f"Hq={self.num_qk_heads}, Hv={self.num_v_heads}, K={self.head_dim_k}, V={self.head_dim_v}, "
                f"state {self.state_dtype}")


@dataclass(eq=False)
class Session:
    session_id: str
    created_at: float
    last_used: float
    ttl_s: Optional[float]
    tokens: int = 0
    config: Optional[SessionConfig] = None
    slot: Optional[int] = None     # row in its pool when resident
    on_disk: bool = False          # its state is in its file under --state-dir
    pins: int = 0                  # launches using its row right now
    pending: int = 0               # admitted requests not answered yet
    deleted: bool = False

    def expired(self, now: float) -> bool:
        return self.ttl_s is not None and now - self.last_used > self.ttl_s

    def record(self) -> state_files.SessionRecord:
        return state_files.SessionRecord(self.session_id, self.created_at, self.last_used, self.ttl_s, self.tokens,
                                         None if self.config is None else tuple(self.config))


@dataclass
class Lease:
    """The rows one request's sessions occupy for the length of a launch."""
    sessions: List[Session]
    pool: StatePool
    slots: List[int]               # the sessions' rows, one per sequence
    released: bool = field(default=False)


class SessionStore:
    def __init__(self, device: torch.device, max_state_bytes: int, state_dir: Optional[Path] = None,
                 default_ttl_s: Optional[float] = None, max_sessions: int = 1_000_000,
                 clock: Callable[[], float] = time.time):
        self.device = device
        self.max_state_bytes = max_state_bytes
        self.state_dir = state_dir
        self.default_ttl_s = default_ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._lock = threading.RLock()
        self._sessions: Dict[str, Session] = {}
        self._expired: "OrderedDict[str, None]" = OrderedDict()
        self._resident: "OrderedDict[str, Session]" = OrderedDict()  # least recently used first
        self._pools: Dict[StateShape, StatePool] = {}
        self._dir_lock = None
        self.spills = 0   # states written to disk to make room (for metrics and tests)
        self.loads = 0    # states read back from disk

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def open(self) -> int:
        """Take the state directory (one server per directory) and register the sessions it holds; returns how
        many. Their states are read on first use."""
        if self.state_dir is None:
            return 0
        self.state_dir.mkdir(parents=True, exist_ok=True)
        lock_file = open(self.state_dir / ".lock", "a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise RuntimeError(f"--state-dir {self.state_dir} is in use by another server process") from None
        self._dir_lock = lock_file
        now = self._clock()
        with self._lock:
            for stale in self.state_dir.glob("*" + state_files.SUFFIX + ".tmp"):
                stale.unlink()  # an interrupted write; the previous file (if any) is intact
            for path in sorted(self.state_dir.glob("*" + state_files.SUFFIX)):
                try:
                    record = state_files.read_record(path)
                    if path.name != record.session_id + state_files.SUFFIX or not SESSION_ID.match(record.session_id):
                        raise ValueError("its file name does not match the session id it holds")
                except Exception as error:  # noqa: BLE001 - set aside, never read as some other session's state
                    aside = path.with_name(path.name + ".unreadable")
                    path.rename(aside)
                    log.warning("state file %s is unreadable (%s); moved to %s", path, error, aside.name)
                    continue
                session = Session(record.session_id, record.created_at, record.last_used, record.ttl_s,
                                  record.tokens, None if record.config is None else SessionConfig(*record.config),
                                  on_disk=record.has_state)
                if session.expired(now):
                    state_files.remove(self.state_dir, session.session_id)
                    continue
                self._sessions[session.session_id] = session
            return len(self._sessions)

    def close(self) -> int:
        """Write every session to the state directory (SIGTERM / shutdown); returns how many were written."""
        with self._lock:
            written = 0
            if self.state_dir is None:
                if self._sessions:
                    log.warning("%d sessions dropped at shutdown: no --state-dir to keep them in", len(self._sessions))
            else:
                for session in self._sessions.values():
                    if session.on_disk:
                        continue  # its file is current: spilled states are not changed until loaded back
                    state = None if session.slot is None else self._pools[session.config.shape].read(session.slot)
                    state_files.write(self.state_dir, session.record(), state)
                    session.on_disk = state is not None
                    written += 1
            self._sessions.clear()
            self._resident.clear()
            self._pools.clear()
            if self._dir_lock is not None:
                self._dir_lock.close()
                self._dir_lock = None
            return written

    # -- the routes' operations --------------------------------------------------------------------------------------

    def create(self, ttl_s: Optional[float] = None) -> Session:
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise StateMemoryFull(f"{len(self._sessions)} sessions exist (--max-sessions {self.max_sessions}); "
                                      f"delete some first", reason="too_many_sessions")
            now = self._clock()
            session = Session(secrets.token_urlsafe(16), now, now, ttl_s if ttl_s is not None else self.default_ttl_s)
            self._sessions[session.session_id] = session
            return session

    def get(self, session_id: str) -> Session:
        """The live session (raises 404 for unknown, deleted or expired ids)."""
        with self._lock:
            return self._live(session_id, self._clock())

    def delete(self, session_id: str) -> None:
        with self._lock:
            self._drop(self._live(session_id, self._clock()))

    def read_state(self, session_id: str) -> tuple:
        """(host copy of the state [Hv, K, V], session) of a session that has one; 409 before its first prefill."""
        with self._lock:
            session = self._live(session_id, self._clock())
            if session.slot is not None:
                return self._pools[session.config.shape].read(session.slot), session
            if session.on_disk:
                return state_files.read_state(self.state_dir, session_id), session
            raise SessionConflict(f"session {session_id} has no state yet: its first prefill sets its head "
                                  f"configuration", reason="no_state_yet")

    def admit(self, session_ids: Sequence[str], config: SessionConfig, blocking: bool = True) -> bool:
        """At the door of /v1/prefill: the sessions exist and fit ``config`` (a new session takes it). Each is
        marked pending until :meth:`finish`, so it cannot expire while the request waits. With ``blocking=False``
        (an event loop calling) nothing is done and False returned when another thread holds the store (a launch
        may be reading or writing a state file); True once admitted."""
        if not self._lock.acquire(blocking=blocking):
            return False
        try:
            now = self._clock()
            sessions = [self._live(sid, now) for sid in session_ids]
            for session in sessions:
                if session.config is not None and session.config != config:
                    raise SessionConflict(f"session {session.session_id} holds a state of {session.config.describe()}; "
                                          f"this request has {config.describe()}")
            for session in sessions:
                session.config = config
                session.pending += 1
            return True
        finally:
            self._lock.release()

    def finish(self, session_ids: Sequence[str], blocking: bool = True) -> bool:
        """The admitted request on these sessions is done with (answered or given up). ``blocking`` as in
        :meth:`admit`."""
        if not self._lock.acquire(blocking=blocking):
            return False
        try:
            now = self._clock()
            for sid in session_ids:
                session = self._sessions.get(sid)
                if session is not None:
                    session.pending -= 1
                    session.last_used = now
            return True
        finally:
            self._lock.release()

    def expire_idle(self) -> int:
        """Drop sessions idle past their TTL (none of whose requests is waiting); returns how many."""
        with self._lock:
            now = self._clock()
            idle = [s for s in self._sessions.values() if s.expired(now) and s.pending == 0 and s.pins == 0]
            for session in idle:
                self._drop(session, expired=True)
            return len(idle)

    # -- the launch worker's operations -----------------------------------------------------------------------------

    def acquire(self, session_ids: Sequence[str]) -> Lease:
        """Pin the sessions' rows (reading spilled states back, zeroing new ones, spilling others if the pool is
        full). Raises 404 for a session deleted since it was admitted, 507 when the pool cannot hold them."""
        with self._lock:
            sessions = []
            for sid in session_ids:
                session = self._sessions.get(sid)
                if session is None or session.deleted:
                    raise SessionNotFound(f"session {sid} was deleted before its request ran")
                sessions.append(session)
            shape = sessions[0].config.shape
            pool = self._pool_for(shape)
            for session in sessions:
                session.pins += 1
            try:
                for session in sessions:
                    if session.slot is None:
                        self._make_resident(session, pool)
                    self._resident.move_to_end(session.session_id)
            except BaseException:
                for session in sessions:
                    session.pins -= 1
                raise
            return Lease(sessions, pool, [s.slot for s in sessions])

    def gather(self, leases: Sequence[Lease]) -> tuple:
        """(rows, states): the leases' rows as an int64 tensor on the pool's device and their stored states
        [len(rows), Hv, K, V], in lease order. The leases of one launch share one pool (one batch key)."""
        with self._lock:
            pool = leases[0].pool
            if any(lease.pool is not pool for lease in leases):
                raise ValueError("the sessions of one launch must share one state pool")
            # queued behind the launch's other work: no wait for the device while the store is locked
            rows = torch.tensor([slot for lease in leases for slot in lease.slots], dtype=torch.int64)
            rows = rows.to(self.device, non_blocking=True)
            return rows, pool.gather(rows)

    def commit(self, leases: Sequence[Lease], rows: torch.Tensor, final_states: torch.Tensor,
               tokens: Sequence[Sequence[int]]) -> None:
        """Store a launch's final states into the leased ``rows`` (from :meth:`gather`) and count each lease's
        sequences' tokens."""
        with self._lock:
            leases[0].pool.scatter(rows, final_states)
            now = self._clock()
            for lease, lengths in zip(leases, tokens):
                for session, n in zip(lease.sessions, lengths):
                    session.tokens += n
                    session.last_used = now

    def release(self, lease: Lease) -> None:
        with self._lock:
            if not lease.released:
                lease.released = True
                for session in lease.sessions:
                    session.pins -= 1
                    if session.deleted and session.pins == 0 and session.slot is not None:
                        self._free_row(session)

    # -- numbers for /metrics and tests ------------------------------------------------------------------------------

    def stats(self) -> Dict[str, int]:
        with self._lock:
            return {"sessions": len(self._sessions), "resident": len(self._resident),
                    "on_disk": sum(s.on_disk for s in self._sessions.values()),
                    "pool_bytes": sum(p.nbytes for p in self._pools.values()),
                    "resident_bytes": sum(p.used * p.shape.nbytes for p in self._pools.values()),
                    "spills": self.spills, "loads": self.loads}

    # -- internals (lock held) ----------------------------------------------------------------------------------------

    def _live(self, session_id: str, now: float) -> Session:
        session = self._sessions.get(session_id) if SESSION_ID.match(session_id or "") else None
        if session is None:
            if session_id in self._expired:
                raise SessionNotFound(f"session {session_id} expired", reason="session_expired")
            raise SessionNotFound(f"no session {session_id!r} (unknown, deleted, or lost in a crash)")
        if session.expired(now) and session.pending == 0 and session.pins == 0:
            self._drop(session, expired=True)
            raise SessionNotFound(f"session {session_id} expired after {session.ttl_s} s idle",
                                  reason="session_expired")
        return session

    def _drop(self, session: Session, expired: bool = False) -> None:
        session.deleted = True
        self._sessions.pop(session.session_id, None)
        if session.slot is not None:
            self._resident.pop(session.session_id, None)
            if session.pins == 0:  # a launch using the row frees it when it lets go (release)
                self._free_row(session)
        if self.state_dir is not None:
            state_files.remove(self.state_dir, session.session_id)
        if expired:
            self._expired[session.session_id] = None
            while len(self._expired) > _REMEMBERED_EXPIRED:
                self._expired.popitem(last=False)

    def _free_row(self, session: Session) -> None:
        """Give a deleted session's row back (never while a launch holds it: a later acquire in that launch could
        take the row, and the launch's one scatter would then write it twice)."""
        pool = self._pools.get(session.config.shape)
        if pool is not None:
            pool.release(session.slot)
        session.slot = None

    def _pool_for(self, shape: StateShape) -> StatePool:
        pool = self._pools.get(shape)
        if pool is None:
            max_rows = self.max_state_bytes // shape.nbytes
            if max_rows < 1:
                raise StateMemoryFull(f"one state of {shape.nbytes / 2**20:.1f} MiB exceeds --max-state-mb "
                                      f"({self.max_state_bytes / 2**20:.1f} MiB)")
            pool = self._pools[shape] = StatePool(shape, self.device, max_rows)
        return pool

    def _make_resident(self, session: Session, pool: StatePool) -> None:
        slot = self._free_slot(pool)
        state = None
        if session.on_disk:
            state = state_files.read_state(self.state_dir, session.session_id)
            self.loads += 1
        pool.write(slot, state)
        session.slot = slot
        self._resident[session.session_id] = session
        if session.on_disk:
            # the next turn changes the state: a file left behind would come back stale after a crash
            state_files.remove(self.state_dir, session.session_id)
            session.on_disk = False

    def _free_slot(self, pool: StatePool) -> int:
        slot = pool.allocate()
        if slot is not None:
            return slot
        if self._grow(pool):
            return pool.allocate()
        victim = next((s for s in self._resident.values() if s.pins == 0 and s.config.shape == pool.shape), None)
        if victim is None and self._reclaim_other_pools(pool.shape) and self._grow(pool):
            return pool.allocate()
        if victim is None:
            raise StateMemoryFull(f"the state pool ({self.max_state_bytes / 2**20:.1f} MiB, --max-state-mb) is "
                                  f"taken by sessions of launches in progress")
        self._spill(victim)
        return pool.allocate()

    def _grow(self, pool: StatePool) -> bool:
        other = sum(p.nbytes for p in self._pools.values() if p is not pool)
        affordable = (self.max_state_bytes - other) // pool.shape.nbytes
        rows = min(pool.can_grow_to(pool.capacity + 1), affordable)
        if rows <= pool.capacity:
            return False
        pool.grow(rows)
        return True

    def _spill(self, session: Session) -> None:
        if self.state_dir is None:
            raise StateMemoryFull(f"the state pool is full ({self.max_state_bytes / 2**20:.1f} MiB, --max-state-mb) "
                                  f"and there is no --state-dir to move least-recently-used sessions to; "
                                  f"delete sessions or start the server with --state-dir")
        pool = self._pools[session.config.shape]
        state_files.write(self.state_dir, session.record(), pool.read(session.slot))
        pool.release(session.slot)
        self._resident.pop(session.session_id, None)
        session.slot = None
        session.on_disk = True
        self.spills += 1

    def _reclaim_other_pools(self, shape: StateShape) -> bool:
        """Spill whole pools of other shapes whose rows are all unpinned, and free their tensors."""
        freed = False
        for other_shape, other in list(self._pools.items()):
            if other_shape == shape:
                continue
            members = [s for s in self._resident.values() if s.config.shape == other_shape]
            if any(s.pins for s in members) or (members and self.state_dir is None):
                continue
            for session in members:
                self._spill(session)
            del self._pools[other_shape]
            freed = True
        return freed

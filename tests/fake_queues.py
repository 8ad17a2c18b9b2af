"""A real kernel queue (io_uring or Linux AIO) with injected faults: shortened, interrupted and
failed completions, and failed system calls, to drive the kernel movers' retry and error paths
(:class:`FaultyQueue`; :func:`install_faulty_queue` puts it under every new handle)."""

from __future__ import annotations

import errno


class FaultyTable:
    """A real queue's table (``rows``) with its entries as lists, for :class:`FaultyQueue`."""

    def __init__(self, rows, write, fd, addresses, offsets, sizes):
        self.rows, self.write, self.fd = rows, write, fd
        self.addresses, self.offsets, self.sizes = addresses, offsets, sizes


class FaultyQueue:
    """A real kernel queue (io_uring or Linux AIO) whose completions can be shortened,
    interrupted or failed, to drive the kernel mover's retry and error paths.

    ``max_len`` shortens what is really submitted (so the kernel completes short);
    ``eintr_every``/``eagain_every`` answer every n-th entry with ``-EINTR``/``-EAGAIN``
    instead of submitting it; ``fail_write_at``/``fail_read_at`` answer entries at or past that
    file offset with ``-errno_``; ``zero_read``/``zero_write`` answer 0 bytes.
    """

    def __init__(self, inner, *, max_len=None, eintr_every=0, eagain_every=0, fail_write_at=None,
                 fail_read_at=None, errno_=errno.ENOSPC, zero_read=False, zero_write=False):
        self.inner, self.name, self.depth = inner, inner.name, inner.depth
        self.wait_share, self.small_wait_share = inner.wait_share, inner.small_wait_share
        self.max_len, self.eintr_every, self.eagain_every = max_len, eintr_every, eagain_every
        self.fail_write_at, self.fail_read_at, self.errno_ = fail_write_at, fail_read_at, errno_
        self.zero_read, self.zero_write = zero_read, zero_write
        self.calls = {"prep": 0, "eintr": 0, "eagain": 0, "failed": 0, "short": 0}
        self.faked: list[tuple[int, int]] = []

    def fixed_slot(self, address, length):
        return self.inner.fixed_slot(address, length)

    def prep(self, tag, write, fd, address, length, offset, buf_index=-1, table=None):
        """One entry, faked or really queued (as row ``tag`` of ``table`` where given)."""
        self.calls["prep"] += 1
        n = self.calls["prep"]
        fail_at = self.fail_write_at if write else self.fail_read_at
        if fail_at is not None and offset >= fail_at:
            self.calls["failed"] += 1
            self.faked.append((tag, -self.errno_))
        elif self.eintr_every and n % self.eintr_every == 0:
            self.calls["eintr"] += 1
            self.faked.append((tag, -errno.EINTR))
        elif self.eagain_every and n % self.eagain_every == 0:
            self.calls["eagain"] += 1
            self.faked.append((tag, -errno.EAGAIN))
        elif (self.zero_write if write else self.zero_read):
            self.faked.append((tag, 0))
        else:
            if self.max_len and length > self.max_len:
                self.calls["short"] += 1
                length = self.max_len
            if table is not None:
                self.inner.set_row(table.rows, tag, address, length, offset)
                self.inner.prep_rows(table.rows, tag, 1)
                return length
            return self.inner.prep(tag, write, fd, address, length, offset, buf_index)
        return length

    def prep_many(self, tags, write, fd, addresses, lengths, offsets, slots):
        for i, tag in enumerate(tags):  # each entry through prep, so every fault applies
            self.prep(tag, write, fd, addresses[i], lengths[i], offsets[i],
                      -1 if slots is None else slots[i])

    def submit_and_wait(self, wait, single=False):
        faked, self.faked = self.faked, []
        return faked + self.inner.submit_and_wait(0 if faked else wait, single)

    # tables (deepnvme.io.small): each row queued goes through the faults above

    def table(self, write, fd, addresses, offsets, sizes):
        rows = self.inner.table(write, fd, addresses, offsets, sizes)
        return FaultyTable(rows, write, fd, addresses.tolist(), offsets.tolist(), sizes.tolist())

    def set_row(self, table, i, address, length, offset):
        table.addresses[i], table.sizes[i], table.offsets[i] = address, length, offset
        self.inner.set_row(table.rows, i, address, length, offset)

    def prep_rows(self, table, start, count):
        for i in range(start, start + count):
            self.prep(i, table.write, table.fd, table.addresses[i], table.sizes[i], table.offsets[i],
                      table=table)

    def submit_wait(self, wait, most=0):
        self.calls["most"] = most
        events = self.submit_and_wait(wait, most == 1)
        return [t for t, _ in events], [r for _, r in events]

    def tidy(self):
        return self.inner.tidy()

    def close(self):
        self.inner.close()


def install_faulty_queue(monkeypatch, engine: str, queue_class=None, **faults) -> list:
    """Make every new handle on ``engine`` use a :class:`FaultyQueue` (or ``queue_class``, a
    subclass); returns the list the queues are appended to as workers start."""
    from deepnvme.io import movers

    real = movers._FACTORIES[engine]
    made: list[FaultyQueue] = []
    cls = queue_class or FaultyQueue

    def factory(depth):
        q = cls(real(depth), **faults)
        made.append(q)
        return q

    monkeypatch.setitem(movers._FACTORIES, engine, factory)
    return made

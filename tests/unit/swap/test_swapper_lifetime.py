"""TensorSwapper over a handle whose I/O completes when the test says: buffer hand-offs."""

from concurrent.futures import Future

import pytest
import torch

from deepnvme.swap import SwapBufferError, TensorSwapper


class ManualHandle:
    """submit_read/submit_write queue the transfer; ``run(kind)`` performs the queued ones of
    that kind then, so a write reads its buffer late, like a slow disk."""

    def __init__(self) -> None:
        self.files: dict[str, torch.Tensor] = {}
        self.queue: list[tuple[str, torch.Tensor, str, Future]] = []
        self._engine = self  # the swapper drains a handle it does not own at exit

    def submit_write(self, data, path, *, offset=0, keep_open=False):
        assert offset == 0, "this fake holds whole files: ranges are tested elsewhere"
        return self._queue("w", data, path)

    def submit_read(self, target, path, *, offset=0, keep_open=False):
        assert offset == 0, "this fake holds whole files: ranges are tested elsewhere"
        return self._queue("r", target, path)

    def close_files(self, paths=(), *, under=None):
        """Nothing is kept open here (the swapper asks keep_open; the files are a dict)."""

    def _queue(self, kind, tensor, path):
        f = Future()
        self.queue.append((kind, tensor, path, f))
        return f

    def run(self, kind: str) -> int:
        todo = [q for q in self.queue if q[0] == kind]
        self.queue = [q for q in self.queue if q[0] != kind]
        for _, tensor, path, f in todo:
            if kind == "w":
                self.files[path] = tensor.clone()
            else:
                tensor.copy_(self.files[path][: tensor.numel()])
            f.set_result(tensor.numel())
        return len(todo)

    def drain(self) -> None:
        """Complete everything queued (so a failing test does not leave close() waiting)."""
        while self.run("w") + self.run("r"):
            pass


def _swapper(tmp_path, h, **kw):
    s = TensorSwapper(tmp_path, buffer_bytes=64, min_swap_bytes=0, handle=h, **kw)
    real_close = s.close
    s.close = lambda: (h.drain(), real_close())
    return s


def test_released_buffer_stays_out_of_the_pool_while_another_keys_write_reads_it(tmp_path):
    """swap_out(k, j's buffer), release(j): the buffer must not be lent (and read into) before
    k's write has read it, or k's file gets another key's bytes."""
    h = ManualHandle()
    with _swapper(tmp_path, h, buffer_count=1, acquire_timeout=0.05) as s:
        s.swap_out("m", torch.full((16,), 3.0))
        h.run("w")
        buf = s.new_buffer("j", (16,), torch.float32)
        buf.fill_(7.0)
        written = s.swap_out("k", buf)          # the disk reads buf later
        s.release("j")
        with pytest.raises(SwapBufferError, match="no free pool buffer for 'm'"):
            s.swap_in("m")
        h.run("r")
        assert h.run("w") == 1 and written.result() is None
        assert s.buffers_in_use() == 0
        out = torch.empty(16)
        s.swap_in("k", out=out)
        h.run("r")
        assert out.tolist() == [7.0] * 16


def test_swap_in_result_is_not_read_into_again(tmp_path):
    """Two swap_ins of a key rewritten in between return different buffers: the first result
    keeps the old value while the second read is in flight and after."""
    h = ManualHandle()
    with _swapper(tmp_path, h, buffer_count=2) as s:
        s.swap_out("k", torch.full((16,), 1.0))
        first = s.swap_in("k")
        h.run("w"), h.run("r")
        s.swap_out("k", torch.full((16,), 2.0))
        second = s.swap_in("k")
        h.run("w"), h.run("r")
        assert first.result().tolist() == [1.0] * 16 and second.result().tolist() == [2.0] * 16


def test_swap_out_of_a_tensor_too_large_issues_no_io(tmp_path):
    h = ManualHandle()
    with _swapper(tmp_path, h) as s:
        with pytest.raises(SwapBufferError, match=r"key 'x'.* 68 bytes .* 64 bytes.*buffer_bytes >= 68"):
            s.swap_out("x", torch.zeros(17))
        assert h.queue == [] and "x" not in s

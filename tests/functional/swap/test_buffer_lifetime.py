"""The buffer-lifetime rule: what swap_in/new_buffer hand out is the caller's until release(key)."""

import pytest
import torch

from deepnvme.swap import SwapBufferError, TensorSwapper


def test_swap_in_result_survives_a_new_value_of_its_key(tmp_path):
    """A held swap_in result keeps its data when the key is rewritten from another tensor and
    swapped in again (the second read used to land in the same buffer)."""
    with TensorSwapper(tmp_path, buffer_bytes=4096, buffer_count=2, min_swap_bytes=0) as s:
        s.swap_out("k", torch.full((16,), 1.0)).result()
        first = s.swap_in("k").result()
        s.swap_out("k", torch.full((16,), 2.0)).result()
        second = s.swap_in("k").result()
        assert second.tolist() == [2.0] * 16
        assert first.tolist() == [1.0] * 16 and first.data_ptr() != second.data_ptr()
        assert s.buffers_in_use() == 2
        s.release("k")
        assert s.buffers_in_use() == 0


def test_swap_in_leaves_the_buffer_a_view_was_written_from(tmp_path):
    """swap_out(k, a view inside k's buffer), then swap_in(k): the read must not overwrite the
    buffer the caller passed (part of) to swap_out."""
    with TensorSwapper(tmp_path, buffer_bytes=4096, buffer_count=2, min_swap_bytes=0) as s:
        buf = s.new_buffer("k", (16,), torch.float32)
        buf.copy_(torch.arange(16.0))
        s.swap_out("k", buf[4:]).result()
        assert s.swap_in("k").result().tolist() == torch.arange(4.0, 16.0).tolist()
        assert buf.tolist() == torch.arange(16.0).tolist()


def test_results_of_other_keys_are_never_reused_before_release(tmp_path):
    """Many keys through a pool: each held result keeps its data until its key is released."""
    with TensorSwapper(tmp_path, buffer_bytes=4096, buffer_count=3, min_swap_bytes=0,
                       acquire_timeout=0.05) as s:
        for k in range(6):
            s.swap_out(k, torch.full((16,), float(k))).result()
        held = {k: s.swap_in(k).result() for k in range(3)}
        s.release(0)
        got = s.swap_in(3).result()                     # may take key 0's buffer: released
        s.swap_out(1, torch.full((16,), 9.0)).result()  # key 1 rewritten while held
        with pytest.raises(SwapBufferError, match="no free pool buffer for 1"):
            s.swap_in(1)                                # needs a fresh buffer: none is free
        assert held[1].tolist() == [1.0] * 16 and held[2].tolist() == [2.0] * 16
        assert got.tolist() == [3.0] * 16

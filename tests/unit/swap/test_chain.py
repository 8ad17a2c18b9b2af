"""Per-key op ordering: each op starts only once the one before it ended."""

from concurrent.futures import Future

import pytest

from deepnvme.swap._chain import Chain


def test_ops_start_in_order_and_only_after_the_previous_one_ended():
    chain = Chain()
    started: list[str] = []
    io = {name: Future() for name in "abc"}

    def op(name):
        return chain.then(lambda: started.append(name) or io[name], lambda exc, n: (name, exc, n))

    fa, fb, fc = op("a"), op("b"), op("c")
    tail = chain.last()
    assert started == ["a"] and tail is not fc and not tail.done()  # fc's end, not its value
    io["a"].set_result(4)
    assert fa.result() == ("a", None, 4) and started == ["a", "b"]
    io["b"].set_exception(OSError(5, "EIO"))
    name, exc, n = fb.result()                 # settle saw the error and returned a value
    assert name == "b" and isinstance(exc, OSError) and n == 0
    assert started == ["a", "b", "c"]
    io["c"].set_result(1)
    assert fc.result() == ("c", None, 1)
    assert tail.done() and tail.result() is None


def test_a_failing_start_or_settle_fails_only_its_own_future():
    chain = Chain()

    def boom():
        raise OSError(28, "ENOSPC")

    def settle(exc, n):
        if exc is not None:
            raise RuntimeError(f"wrapped: {exc}")
        return n

    failed = chain.then(boom, settle)
    ok_io: Future = Future()
    ok = chain.then(lambda: ok_io, settle)
    with pytest.raises(RuntimeError, match="wrapped: .*ENOSPC"):
        failed.result()
    ok_io.set_result(8)
    assert ok.result() == 8

"""bench/anchors.py's answer check: what makes the router comparison count only correct answers."""

from __future__ import annotations

import orjson
import pytest

from bench.anchors import check_tokens


def sse(*texts: str, done: bool = True) -> bytes:
    chunks = [b"data: " + orjson.dumps({"choices": [{"index": 0, "text": t}]}) + b"\n\n" for t in texts]
    return b"".join(chunks) + (b"data: [DONE]\n\n" if done else b"")


def test_check_tokens_counts_each_token_once() -> None:
    check_tokens(sse(" t1", " t2", " t3"), True, 3)
    check_tokens(orjson.dumps({"choices": [{"text": " t5 t6"}]}), False, 2)
    with pytest.raises(RuntimeError, match="4 tokens, not 3"):   # token 0 relayed twice
        check_tokens(sse(" t1", " t1", " t2", " t3"), True, 3)
    with pytest.raises(RuntimeError, match="DONE"):
        check_tokens(sse(" t1", done=False), True, 1)
    with pytest.raises(RuntimeError, match="1 tokens, not 2"):
        check_tokens(orjson.dumps({"choices": [{"text": " t5"}]}), False, 2)


def test_syscall_counts_sum_perf_stat_lines_by_group() -> None:
    """`bench.procs.Syscalls.parse` on `perf stat -x,` output as perf 6 writes it (comment line,
    counted and uncounted events)."""
    from bench.procs import Syscalls

    csv = ("# started on Sun Dec  6 18:40:01 2026\n\n"
           "2950,,syscalls:sys_enter_read,4001230,100.00,,\n"
           "12,,syscalls:sys_enter_recvfrom,4001230,100.00,,\n"
           "<not counted>,,syscalls:sys_enter_recvmsg,0,0.00,,\n"
           "2012,,syscalls:sys_enter_write,4001230,100.00,,\n"
           "1872,,syscalls:sys_enter_writev,4001230,100.00,,\n"
           "0,,syscalls:sys_enter_sendto,4001230,100.00,,\n"
           "545,,syscalls:sys_enter_epoll_pwait,4001230,100.00,,\n"
           "7,,syscalls:sys_enter_epoll_wait,4001230,100.00,,\n")
    assert Syscalls.parse(csv) == {"reads": 2962, "writes": 3884, "waits": 552}

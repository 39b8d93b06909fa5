"""The service's merge thread is paced: its own FAISS thread count, a lower priority."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import faiss

from vitrieval.service import maintenance
from vitrieval.service.maintenance import MERGE_NICE, pace_this_thread


def _threads_and_niceness() -> tuple[int, int]:
    return faiss.omp_get_max_threads(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_a_paced_thread_has_its_own_faiss_threads_and_a_lower_priority() -> None:
    before = _threads_and_niceness()
    threads = before[0] + 1  # a count the caller does not have, so a change shows
    with ThreadPoolExecutor(1, initializer=pace_this_thread, initargs=(threads,)) as pool:
        paced = pool.submit(_threads_and_niceness).result()
    assert paced == (threads, min(19, before[1] + MERGE_NICE))
    # the caller (the service's other threads) keeps its FAISS threads and priority
    assert _threads_and_niceness() == before
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(_threads_and_niceness).result()[1] == before[1]


def test_merges_default_to_half_the_cores_this_process_may_use(monkeypatch) -> None:
    monkeypatch.setattr(maintenance, "cpu_count", lambda: 5)
    assert maintenance.default_merge_threads() == 2
    monkeypatch.setattr(maintenance, "cpu_count", lambda: 1)
    assert maintenance.default_merge_threads() == 1

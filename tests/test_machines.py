"""Several machines check in with machine 0 before the launch (issue 33, point 6): a missing, duplicate or wrong
machine rank, or a machine that cannot reach machine 0, is an error at launch naming the rank, host or address,
within strategy.rank_timeout, never a hang. Machines are threads on 127.0.0.1 here (one store, as across hosts);
tests/test_multinode.py runs two machines in two network namespaces."""

import os
import threading
import time

import pytest

from tests.support import free_port
from hftrain.errors import LaunchError
from hftrain.launch.machines import check_in, is_local_address

HOST = "127.0.0.1"


def machines(ranks: list[int], count: int, timeout: float = 20) -> dict:
    """check_in on each rank in its own thread (rank 0 first); rank index -> None (checked in) or the error text."""
    port, results, threads = free_port(), {}, []

    def one(i, rank):
        try:
            check_in(HOST, port, rank, count, timeout, say=lambda m: None)
            results[i] = None
        except LaunchError as e:
            results[i] = str(e)

    for i, rank in enumerate(ranks):
        threads.append(threading.Thread(target=one, args=(i, rank), daemon=True))
        threads[-1].start()
        time.sleep(0.3 if rank == 0 else 0.1)  # machine 0 serves first (the others wait for it anyway)
    for t in threads:
        t.join(timeout + 30)
    assert not any(t.is_alive() for t in threads), "a machine hung"
    return results


def test_every_rank_once_checks_in():
    assert machines([0, 1, 2], 3) == {0: None, 1: None, 2: None}


def test_a_duplicate_rank_is_refused_naming_the_first_machine():
    results = machines([0, 1, 1], 2)
    assert results[0] is None and sorted([results[1] is None, results[2] is None]) == [False, True], results
    refused = results[1] or results[2]
    assert "machine rank 1 is taken:" in refused and "checked in with it first" in refused


def test_a_missing_rank_is_named_within_the_timeout():
    t0 = time.monotonic()
    results = machines([0, 1], 3, timeout=4)
    took = time.monotonic() - t0
    assert "machine rank(s) 2 did not check in at 127.0.0.1:" in results[0] and "within 4 s" in results[0]
    assert results[1] is not None and "did not start the job" in results[1]
    assert took < 60, took  # not forever (there is no other end), whatever the machine's load


def test_a_machine_that_cannot_reach_machine_0_stops_within_the_timeout_naming_the_address():
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=rf"machine 1 cannot reach machine 0 at 127.0.0.1:{port} within 3 s"):
        check_in(HOST, port, 1, 2, 3, say=lambda m: None)
    assert time.monotonic() - t0 < 60  # not forever (torch's own connect retries for 15 min)


def test_rank_0_on_a_machine_without_the_main_address_is_refused_at_once():
    assert is_local_address(HOST) and not is_local_address("192.0.2.7")  # TEST-NET-1: nobody's address
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="strategy.machine_rank is 0 but strategy.main_process_ip 192.0.2.7 is not "
                                          "an address of this machine"):
        check_in("192.0.2.7", free_port(), 0, 2, 60, say=lambda m: None)
    assert time.monotonic() - t0 < 30  # at once: not after the 60 s of the time-out, whatever the machine's load


def test_launch_refuses_a_multi_machine_recipe_without_this_machines_rank(tmp_path, tiny_model_dir, capsys):
    from hftrain.cli import main

    from .test_bad_input import W

    w = W(str(tmp_path), tiny_model_dir)
    with pytest.raises(SystemExit) as e:
        main(["launch", w.recipe(), "strategy.num_machines=2", "strategy.num_processes=2",
              "strategy.main_process_ip=10.0.0.1", "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert ("strategy.num_machines is 2 but this machine's rank is unset: left out, every machine would take rank 0"
            in err)
    assert not os.path.exists(w.out)

"""loadtests/gray_des.py: the shipped routing engine on the virtual clock with the gateway's latency outlier detection
fed as dispatch feedback feeds it. A replica slowed 6x is ejected and kept to its probes; one slowed 1x (the
detector on, nothing slow) is never ejected; the oracle takes the replica out of routing at the fault exactly."""

from gateway_lab.sim.fleet import Record
from loadtests.gray_des import CLEAR, FAULT, PartialFleet, simulate

LAST = "mi355x-3"


def _served_in_window(fleet: PartialFleet, name: str = LAST) -> list[Record]:
    return [r for r in fleet.records if r.name == name and FAULT + 30 <= r.arrival < CLEAR]


def test_prefill_slowed_replica_is_ejected_and_kept_to_probes() -> None:
    fleet = simulate(0, 2.0, FAULT, CLEAR, 5.0, "prefill", 6.0)
    assert fleet.ejected_at, "a replica 6x slower on prefill was never ejected"
    assert FAULT < fleet.ejected_at[0] < FAULT + 30
    assert set(fleet.reasons) == {"latency_ttft"}
    # from 30 s into the fault: only its probes, one at a time (a few, against ~25% of ~450 requests unprotected)
    assert len(_served_in_window(fleet)) <= 3
    # its forwards really were slower: its probes' TTFT is several times its peers' median
    served = [(r.name, r.ttft) for r in fleet.records if FAULT <= r.arrival < CLEAR and r.ttft is not None]
    mine = sorted(t for name, t in served if name == LAST)
    peers = sorted(t for name, t in served if name != LAST)
    assert mine and mine[len(mine) // 2] > 2 * peers[len(peers) // 2]


def test_decode_slowed_replica_is_ejected_on_inter_token_latency() -> None:
    fleet = simulate(1, 2.0, FAULT, CLEAR, 5.0, "decode", 6.0)
    assert fleet.ejected_at and fleet.ejected_at[0] < FAULT + 30
    assert set(fleet.reasons) == {"latency_itl"}


def test_detector_on_and_nothing_slow_ejects_nobody() -> None:
    fleet = simulate(0, 2.0, FAULT, CLEAR, 5.0, "prefill", 1.0)
    assert fleet.outliers is not None and not fleet.outliers.ejections and not fleet.ejected_at
    assert len(_served_in_window(fleet)) > 30  # it kept a share


def test_oracle_takes_the_replica_out_at_the_fault_and_back_at_the_clear() -> None:
    fleet = simulate(0, 2.0, FAULT, CLEAR, 5.0)
    assert fleet.outliers is None
    assert not [r for r in fleet.records if r.name == LAST and FAULT <= r.arrival < CLEAR]
    assert [r for r in fleet.records if r.name == LAST and r.arrival >= CLEAR]
    assert fleet.busy[LAST] == 0.0 and fleet.busy["mi355x-0"] > 0  # its utilisation over the window

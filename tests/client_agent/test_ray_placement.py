"""The placement rule and [simulation.resources], against cases worked out by hand (no Ray needed)."""

from __future__ import annotations

import pytest

from client_agent.ray_placement import TierResources, parse_resources, place


def test_one_cpu_per_client_by_default_spreads_clients_round_robin_over_the_cpus():
    slots = place([1.0] * 5, parse_resources(None, [1.0]), {"CPU": 2.0})
    assert [s.indices for s in slots] == [(0, 2, 4), (1, 3)]
    assert all(s.resources == TierResources(1.0, 0.0, 0) for s in slots)


def test_tier_eighth_clients_pack_four_to_a_cpu_beside_a_gpu_tier():
    """2 CPUs, 1 GPU; 8 clients alternating tiers 1 and 1/8 (round-robin), tier 1 on half a GPU each.

    One actor per tier: tier 1 takes 1 CPU + 0.5 GPU, tier 1/8 takes 0.25 CPU (0.75 CPU left).
    Tier 1 could still take 0.5 GPU but needs a whole CPU: only tier 1/8 fits, three times more.
    """
    resources = parse_resources(
        {"1": {"num_cpus": 1, "num_gpus": 0.5}, "1/8": {"num_cpus": 0.25, "memory": "256MiB"}}, [1.0, 0.125]
    )
    assert resources[0.125] == TierResources(0.25, 0.0, 256 * 2**20)
    slots = place([1.0, 0.125] * 4, resources, {"CPU": 2.0, "GPU": 1.0, "memory": 8e9})
    assert [(s.tier, s.indices) for s in slots] == [
        (1.0, (0, 2, 4, 6)),
        (0.125, (1,)),
        (0.125, (3,)),
        (0.125, (5,)),
        (0.125, (7,)),
    ]
    assert slots[0].resources.actor_options() == {"num_cpus": 1.0, "num_gpus": 0.5}


def test_more_actors_go_to_the_tier_with_more_clients_per_actor():
    # 4 CPUs, 6 clients of tier 1 and 2 of tier 0.5 (tiers [1, 1, 1, 0.5]): one actor each, then tier 1 (6/1 > 2/1)
    # gets the third; then 6/2 = 3 > 2/1: tier 1 gets the fourth
    slots = place([1.0, 1.0, 1.0, 0.5] * 2, parse_resources(None, [1.0, 0.5]), {"CPU": 4.0})
    assert [(s.tier, s.indices) for s in slots] == [
        (1.0, (0, 4)),
        (1.0, (1, 5)),
        (1.0, (2, 6)),
        (0.5, (3, 7)),
    ]


def test_never_more_actors_than_clients():
    assert len(place([1.0, 1.0], parse_resources(None, [1.0]), {"CPU": 16.0})) == 2


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"0.3": {"num_cpus": 1}}, "no client has tier 0.3"),
        ({"1": {"num_cpu": 1}}, "unknown keys num_cpu"),
        ({"1": {"num_cpus": -1}}, "num_cpus must be a finite number"),
        ({"1": {"num_cpus": float("nan")}}, "num_cpus must be a finite number"),
        ({"1": {"num_cpus": 0}}, "must take some num_cpus or num_gpus"),
        ({"1": {"num_gpus": 1.5}}, "must be whole"),
        ({"1": {"memory": "2 parsecs"}}, "not a size"),
        ({"1": {"memory": "2TiB"}}, "unknown unit"),
        ({"1": 4}, "give a table"),
        (5, "must be a table of tiers, got 5"),  # `resources = 5` in [simulation]: was a TypeError from dict()
        ({"one": {"num_cpus": 1}}, "is not a tier"),
    ],
)
def test_bad_resources_are_refused_with_the_key_named(table, message):
    with pytest.raises(ValueError, match=message):
        parse_resources(table, [1.0])


def test_a_client_larger_than_the_cluster_is_refused_before_any_actor_starts():
    with pytest.raises(ValueError, match=r"asks for CPU=1, GPU=1 but the cluster \(CPU=2, GPU=0\) has CPU=2, GPU=0"):
        place([1.0], parse_resources({"1": {"num_gpus": 1}}, [1.0]), {"CPU": 2.0})


def test_what_is_left_after_the_larger_tiers_is_what_the_refusal_names():
    """Two CPUs, two tiers of one CPU each, then a third: the smallest finds none left (it said 2 before)."""
    tiers = parse_resources({"default": {"num_cpus": 1}}, [1.0, 0.5, 0.25])
    with pytest.raises(ValueError, match=r"tier-0.25 client asks for CPU=1 but the cluster \(CPU=2\) has CPU=0 left"):
        place([1.0, 0.5, 0.25], tiers, {"CPU": 2.0})

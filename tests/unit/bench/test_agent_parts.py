"""bench.agent_parts: the figures docs/benchmarks.md quotes come out of it."""

from bench.agent_parts import (
    LEFT_OUT,
    MODULES,
    left_out_rss,
    module_rss,
    parse_and_translate,
    record_bytes,
)


def test_it_prints_each_module_a_record_size_and_a_time_per_service() -> None:
    rss = module_rss()
    assert [name for name, _ in rss] == ["(the interpreter)", *MODULES]
    added = dict(rss)
    assert added["(the interpreter)"] > 1 and added["numpy"] > 1  # (small ones vary by pages)
    left_out = dict(left_out_rss())  # the framework and the netlink library cost something
    assert list(left_out) == LEFT_OUT and all(mb > 1 for mb in left_out.values())
    sizes = record_bytes()
    assert 0 < sizes["Backend"] < sizes["an IPv4Address (what a backend held before)"]
    assert 0 < sizes["packed endpoint (a slice of 10, with node names)"] < 64
    times = parse_and_translate(20, 1)
    ways = {"read from a list page", "read as watch events"}  # (checked equal by it)
    assert set(times) == ways | {"translate"} and all(t > 0 for t in times.values())

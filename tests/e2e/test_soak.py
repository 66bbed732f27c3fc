"""The bounded soak: 300 requests through `unison serve --tokenizer-worker-num 4` from 64 clients,
10 % of them disconnecting; `make soak` runs the same with 2,000 (unison/bench/soak.py)."""

from __future__ import annotations

import pytest

from unison.bench.soak import Output, format_report, greedy_verdict, make_plans, run_soak


def _out(tokens: str, tops: list[dict[str, float]] | None = None) -> Output:
    return Output(tokens=list(tokens), top=tops or [{t: 0.0} for t in tokens])


def test_greedy_verdict():
    tie = [{"a": -1.0}, {"b": -0.50, "x": -0.55, "y": -3.0}, {"c": -1.0}]
    solo = _out("abc", tie)
    assert greedy_verdict(solo, _out("abc"), 3) == ("exact", None)
    assert greedy_verdict(solo, _out("ab"), 2) == ("exact", None)  # a shorter max_tokens
    assert greedy_verdict(solo, _out("axz", [{}, {"x": -0.5, "b": -0.52}, {}]), 3)[0] == "near-tie"
    assert greedy_verdict(solo, _out("zbc", [{"z": -0.1, "a": -0.2}, {}, {}]), 3)[0] == "wrong"  # no tie
    assert greedy_verdict(solo, _out("axc", [{}, {"x": -0.5}, {}]), 3)[0] == "wrong"  # b not in got's top
    assert greedy_verdict(_out("abc"), _out("ab"), 3)[0] == "wrong"  # stopped early


def test_plans_seeded():
    plans = make_plans(300, 8, 8, 32, 0.1, seed=0)
    assert plans == make_plans(300, 8, 8, 32, 0.1, seed=0)
    assert sum(p.cut is not None for p in plans) == 30
    assert all(8 <= p.max_tokens <= 32 for p in plans) and {p.stream for p in plans} == {True, False}


@pytest.mark.timeout(600)
def test_soak_300():
    # RSS is compared idle to idle, after 150 requests and after 300. That early the core is still
    # warming up: its oneDNN caches (bounded, see core_process.ONEDNN_CACHES, about 51 MiB full)
    # fill between the two, so this short run allows 128 MiB (measured: -11 to +81); `make soak`
    # holds every process to 64 MiB from request 500 on (measured: core +48 MiB over 1,500).
    report = run_soak(300, clients=64, workers=4, disconnect=0.1, max_tokens=24,
                      max_rss_growth_mib=128, server_args=("--num-threads", "1"))
    print("\n" + format_report(report))
    assert report["problems"] == [], format_report(report)
    assert report["failed"] == 0 and report["greedy"]["wrong"] == 0
    assert report["completed"] + report["disconnected"] == 300 and report["disconnected"] > 0
    assert report["idle_ok"] and report["exit_code"] == 0 and not report["log_errors"]

"""Boolean environment switches: ``LEANOPT_NO_NATIVE`` and
``LEANOPT_NO_COMPILE`` read as booleans by one parser (``leanopt.environment.flag``), so
``=false``/``no``/``off`` keeps the fast path on; a value that is neither a ``ValueError`` naming
the variable; a fast path switched off says so, once per process. No build and no compile here:
the build and ``torch.compile`` are replaced by recorders."""

from __future__ import annotations

import logging

import pytest
import torch

from leanopt.kernels import cpu, cpu_native

ON = ["1", "true", "TRUE", "Yes", "on", " on "]
OFF = ["", "0", "false", "False", "no", "NO", "off"]


def flag(name: str) -> bool:
    from leanopt.environment import flag  # here, so the switches' tests below run on any leanopt

    return flag(name)


@pytest.mark.parametrize("value", ON)
def test_flag_reads_truthy_values(monkeypatch, value: str) -> None:
    monkeypatch.setenv("LEANOPT_TEST_FLAG", value)
    assert flag("LEANOPT_TEST_FLAG") is True


@pytest.mark.parametrize("value", OFF)
def test_flag_reads_falsy_values(monkeypatch, value: str) -> None:
    monkeypatch.setenv("LEANOPT_TEST_FLAG", value)
    assert flag("LEANOPT_TEST_FLAG") is False


def test_flag_unset_is_false(monkeypatch) -> None:
    monkeypatch.delenv("LEANOPT_TEST_FLAG", raising=False)
    assert flag("LEANOPT_TEST_FLAG") is False


@pytest.mark.parametrize("value", ["maybe", "2", "enable", "-1", "n"])
def test_flag_refuses_what_is_not_a_boolean(monkeypatch, value: str) -> None:
    monkeypatch.setenv("LEANOPT_TEST_FLAG", value)
    with pytest.raises(ValueError, match=f"LEANOPT_TEST_FLAG='{value}' is not a boolean: use 1, true, yes or on to turn it on, 0, false"):
        flag("LEANOPT_TEST_FLAG")


# ---- LEANOPT_NO_NATIVE ----------------------------------------------------------------------------
@pytest.fixture
def fresh_native(monkeypatch):
    """cpu_native as before its first use, its build replaced by a recorder (no compiler runs)."""
    built: list[object] = []

    def build() -> object:
        built.append(object())
        return built[-1]

    monkeypatch.setattr(cpu_native, "_state", {})
    monkeypatch.setattr(cpu_native, "_build_extension", build)
    monkeypatch.setattr(cpu_native, "_cached", lambda: True)  # a load, not a build: no "building" line
    return built


@pytest.mark.parametrize("value", OFF)
def test_no_native_false_keeps_the_kernel_on(monkeypatch, fresh_native, caplog, value: str) -> None:
    monkeypatch.setenv("LEANOPT_NO_NATIVE", value)
    with caplog.at_level(logging.WARNING, logger="leanopt"):
        assert cpu_native.available(), cpu_native.build_error()
    assert len(fresh_native) == 1
    assert not caplog.records


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_no_native_true_turns_it_off_with_one_warning(monkeypatch, fresh_native, caplog, value: str) -> None:
    monkeypatch.setenv("LEANOPT_NO_NATIVE", value)
    with caplog.at_level(logging.WARNING, logger="leanopt"):
        assert not cpu_native.available()
        assert not cpu_native.available()  # asked again: no second line
    assert not fresh_native
    assert "LEANOPT_NO_NATIVE" in cpu_native.build_error()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "LEANOPT_NO_NATIVE" in lines[0] and "slower" in lines[0], lines


def test_no_native_refuses_what_is_not_a_boolean(monkeypatch, fresh_native) -> None:
    monkeypatch.setenv("LEANOPT_NO_NATIVE", "disable")
    with pytest.raises(ValueError, match="LEANOPT_NO_NATIVE='disable' is not a boolean"):
        cpu_native.available()
    assert not fresh_native


# ---- LEANOPT_NO_COMPILE ---------------------------------------------------------------------------
@pytest.fixture
def compile_calls(monkeypatch):
    """torch.compile replaced by a recorder; the eager-mode announcement not yet made."""
    calls: list[object] = []

    def fake_compile(fn, **kwargs):
        calls.append(fn)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(cpu, "_told", set())
    return calls


def _two_rules() -> list:
    return [cpu.compiled(lambda x: x + 1), cpu.compiled(lambda x: x * 2)]


@pytest.mark.parametrize("value", OFF)
def test_no_compile_false_compiles(monkeypatch, compile_calls, caplog, value: str) -> None:
    monkeypatch.setenv("LEANOPT_NO_COMPILE", value)
    with caplog.at_level(logging.WARNING, logger="leanopt"):
        assert [f(torch.ones(2)).tolist() for f in _two_rules()] == [[2.0, 2.0], [2.0, 2.0]]
    assert len(compile_calls) == 2
    assert not caplog.records


@pytest.mark.parametrize("value", ["1", "True", "yes", "ON"])
def test_no_compile_true_runs_eagerly_with_one_warning(monkeypatch, compile_calls, caplog, value: str) -> None:
    monkeypatch.setenv("LEANOPT_NO_COMPILE", value)
    with caplog.at_level(logging.WARNING, logger="leanopt"):
        for f in _two_rules():
            assert f(torch.ones(2)).tolist() == [2.0, 2.0]
            f(torch.ones(2))  # a second call: still eager, still one line
    assert not compile_calls
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "LEANOPT_NO_COMPILE" in lines[0] and "eagerly" in lines[0], lines


def test_no_compile_refuses_what_is_not_a_boolean(monkeypatch, compile_calls) -> None:
    monkeypatch.setenv("LEANOPT_NO_COMPILE", "nope")
    with pytest.raises(ValueError, match="LEANOPT_NO_COMPILE='nope' is not a boolean"):
        _two_rules()[0](torch.ones(2))
    assert not compile_calls


# ---- LEANOPT_CPU_SPREAD ---------------------------------------------------------------------------
def _ways(monkeypatch, value: str | None) -> set[str]:
    """Which threads ran a spread()'s items: Python worker threads ("spread") or the caller ("in order")."""
    import threading

    if value is None:
        monkeypatch.delenv("LEANOPT_CPU_SPREAD", raising=False)
    else:
        monkeypatch.setenv("LEANOPT_CPU_SPREAD", value)
    monkeypatch.setattr(cpu, "_choices", {})
    seen: set[str] = set()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(8):
            cpu.spread(lambda item: seen.add("in order" if threading.current_thread() is threading.main_thread() else "spread"),
                       range(4), choose="test-environment")  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return seen


@pytest.mark.parametrize("value", ["1", "true", "On", " yes "])
def test_cpu_spread_on_spreads(monkeypatch, value: str) -> None:
    assert _ways(monkeypatch, value) == {"spread"}


@pytest.mark.parametrize("value", ["0", "false", "off", "NO"])
def test_cpu_spread_off_runs_in_order(monkeypatch, value: str) -> None:
    assert _ways(monkeypatch, value) == {"in order"}


@pytest.mark.parametrize("value", [None, "", "  "])
def test_cpu_spread_unset_measures_both_ways(monkeypatch, value: str | None) -> None:
    assert _ways(monkeypatch, value) == {"spread", "in order"}  # the first calls alternate (cpu.Choice)


def test_cpu_spread_refuses_what_is_not_a_boolean(monkeypatch) -> None:
    with pytest.raises(ValueError, match="LEANOPT_CPU_SPREAD='sometimes' is not a boolean"):
        _ways(monkeypatch, "sometimes")


# ---- every variable documented ------------------------------------------------------------------
def test_every_leanopt_variable_read_in_src_is_in_docs_environment_md() -> None:
    """A variable name is a whole string literal ``"LEANOPT_..."`` in src/ (read through
    os.environ, environment.flag or setting, or a constant holding its name)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    literal = re.compile(r"""["'](LEANOPT_[A-Z0-9_]+)["']""")
    read = {m for path in (root / "src").rglob("*.py") for m in literal.findall(path.read_text())}
    documented = set(re.findall(r"`(LEANOPT_[A-Z0-9_]+)", (root / "docs" / "environment.md").read_text()))
    assert {"LEANOPT_NO_NATIVE", "LEANOPT_NO_COMPILE", "LEANOPT_CACHE", "LEANOPT_CPU_SPREAD"} <= read, read
    assert read <= documented, f"read in src/ but not in docs/environment.md: {sorted(read - documented)}"

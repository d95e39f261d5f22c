"""What a newcomer meets first (issue 25): a mistyped model name is answered with the nearest
presets at once, before any network; a value that starts with '-' reaches its own check."""

from __future__ import annotations

import pytest

from leanopt.memory import presets

pytest.importorskip("transformers")


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    asked: list[str] = []

    def unreachable(timeout: float = presets.HUB_TIMEOUT_S) -> str:
        asked.append("hub")
        return "ConnectError (test)"

    monkeypatch.setattr(presets, "hub_unreachable", unreachable)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return asked


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("distilbert", "distilbert-base-cased"), ("llama-7b", "llama-2-7b"), ("Roberta", "roberta-base"), ("tinylama", "tinyllama-1.1b")],
)
def test_a_name_near_a_preset_suggests_it_without_the_network(no_network: list[str], typed: str, meant: str) -> None:
    with pytest.raises(ValueError) as err:
        presets.resolve_model(typed)
    message = str(err.value)
    assert f"{typed!r} is not a preset: did you mean " in message and meant in message.split("?")[0], message
    assert "\n" not in message and "organisation/name" in message
    assert all(name in message for name in presets.PRESETS)  # the list
    assert no_network == []  # answered before any request


def test_names_far_from_every_preset_and_full_hub_ids_still_ask_the_hub(no_network: list[str]) -> None:
    assert presets.nearest_presets("zzzz-qqqq") == []
    for spec in ("zzzz-qqqq", "some-org/distilbert"):
        with pytest.raises(ValueError, match="cannot be reached"):
            presets.resolve_model(spec)
    assert no_network == ["hub", "hub"]


def test_every_preset_alias_still_resolves_to_itself() -> None:
    for alias, preset in presets._PRESET_INDEX.items():
        if "/" not in alias:
            assert presets.nearest_presets(alias)[0] == preset


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["plan", "gpt2", "--batch", "1", "--seq", "8", "--budget", "-1GiB"], "budget '-1GiB': expected a size"),
        (["plan", "gpt2", "--batch", "-1", "--seq", "8"], "batch must be a whole number >= 1, got -1"),
    ],
)
def test_a_value_starting_with_a_dash_reaches_its_own_check(capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    from leanopt.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "expected one argument" not in err[0], err


def test_an_option_after_an_option_is_still_an_option(capsys: pytest.CaptureFixture[str]) -> None:
    from leanopt.cli import main

    assert main(["plan", "gpt2", "--batch", "--json"]) == 2
    assert "argument --batch: expected one argument" in capsys.readouterr().err

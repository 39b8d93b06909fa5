"""API keys that no request could ever match are refused at start: a key with leading
or trailing whitespace (a newline left by reading it from a file: clients strip a
header value's ends) or with a character an HTTP header cannot carry (non-ASCII,
control characters) would start a server on which every mutation is a 401. Every key
setting is checked; the message names the setting, never the key."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from vitrieval.service.cli import main
from vitrieval.service.settings import Settings

GOOD = "a-good-key-0123"
BAD = {
    "trailing newline": GOOD + "\n",
    "trailing space": GOOD + " ",
    "leading tab": "\t" + GOOD,
    "non-ASCII": "a-göod-key-0123",
    "control character": "a-good\x01key-0123",
    "DEL": "a-good\x7fkey-0123",
}


@pytest.mark.parametrize("setting", ["VITRIEVAL_API_KEY", "VITRIEVAL_READ_API_KEY"])
@pytest.mark.parametrize("name", list(BAD))
def test_a_key_no_header_can_match_stops_the_start(
    setting: str, name: str, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("VITRIEVAL_API_KEY", GOOD)
    monkeypatch.setenv(setting, BAD[name])
    # no model or index given: a start that got past the settings would exit 2 too,
    # saying that both are needed
    assert main(["--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"vitrieval-serve: {setting} "), err
    assert BAD[name].strip() not in err  # a secret is not echoed


def test_keys_with_inner_spaces_and_punctuation_are_fine() -> None:
    settings = Settings(api_key="two words, ok!", read_api_key="~!@#$%^&*()_+{}|:<>?")
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "two words, ok!"
    for key in ("short", "   ", " " * 20):
        with pytest.raises(ValidationError, match="at least 12 characters"):
            Settings(api_key=key)

"""An API key may carry a default priority class: 'KEY priority=batch' as a key-file line, an
--api-key value or a TOKQ_API_KEYS entry. The check of a key returns its class (None: none); a
bad option, or one key given two classes, stops the gateway in one line naming the entry and
never the key. What a call is queued in is tested in tests/gateway/test_priority_classes.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokq import config as cfg
from tokq.gateway.auth import ApiKeys
from tokq.gateway.errors import Unauthenticated


def keys_of(**values) -> ApiKeys | None:
    return ApiKeys.from_config(cfg.load(cfg.GatewayConfig, values, env={}))


def test_a_key_files_lines_and_flags_carry_their_default_class(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# live traffic\nsearch-3f9a\n\nindexer-c41d   priority=batch\n"
                        "  reports-77 priority=interactive  \n")
    keys = keys_of(api_keys=("flag-key priority=batch", "other-flag-key"), api_key_file=str(key_file))
    assert keys.has_defaults
    assert keys.check("Bearer search-3f9a") is None
    assert keys.check("Bearer indexer-c41d") == "batch"
    assert keys.check("bearer reports-77") == "interactive"
    assert keys.check("Bearer flag-key") == "batch"
    assert keys.check("Bearer other-flag-key") is None
    for wrong in ("Bearer indexer-c41d priority=batch", "Bearer priority=batch", "Bearer indexer"):
        with pytest.raises(Unauthenticated, match="not accepted"):
            keys.check(wrong)
    assert not keys_of(api_keys=("a", "b")).has_defaults


def test_tokq_api_keys_entries_carry_a_class_too():
    config = cfg.load(cfg.GatewayConfig, {}, env={"TOKQ_API_KEYS": "live-key, bulk-key priority=batch"})
    keys = ApiKeys.from_config(config)
    assert keys.check("Bearer live-key") is None and keys.check("Bearer bulk-key") == "batch"


@pytest.mark.parametrize("entry, message", [
    ("s3cret-key priority=urgent", "api_keys entry 2: priority='urgent' is not one of interactive, batch"),
    ("s3cret-key priority=", "api_keys entry 2: priority='' is not one of interactive, batch"),
    ("s3cret-key prio=batch", "api_keys entry 2: after the key only priority=interactive|batch may follow"),
    ("s3cret key", "api_keys entry 2: after the key only priority=interactive|batch may follow"),
])
def test_a_bad_option_is_one_line_naming_the_entry_not_the_key(entry, message):
    with pytest.raises(cfg.ConfigError) as err:
        cfg.load(cfg.GatewayConfig, {"api_keys": ("fine-key", entry)}, env={})
    assert str(err.value).startswith(message) and "s3cret" not in str(err.value)


def test_a_bad_key_file_line_is_named_by_line_number(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("fine-key\n# a comment\ns3cret-key priority=low\n")
    with pytest.raises(cfg.ConfigError) as err:
        keys_of(api_key_file=str(key_file))
    assert str(err.value) == (f"api_key_file {str(key_file)!r} line 3: priority='low' is not one of "
                              "interactive, batch")
    key_file.write_text("s3cret-key priority=batch\ns3cret-key\n")
    with pytest.raises(cfg.ConfigError) as err:
        keys_of(api_key_file=str(key_file))
    assert "line 2: this key is listed before with another priority" in str(err.value)
    assert "s3cret" not in str(err.value)
    key_file.write_text("same-key priority=batch\nsame-key priority=batch\n")  # repeated alike: fine
    assert keys_of(api_key_file=str(key_file)).check("Bearer same-key") == "batch"


@pytest.mark.parametrize("args", [["--api-key", "s3cret-key priority=urgent"], "file"])
def test_tokq_gateway_refuses_a_bad_entry_in_one_line_before_starting(tmp_path, args):
    if args == "file":
        (tmp_path / "keys").write_text("s3cret-key priority=urgent\n")
        args = ["--api-key-file", str(tmp_path / "keys")]
    run = subprocess.run([sys.executable, "-m", "tokq.cli", "gateway", "--port", "0", *args,
                          "--redis-url", "redis://127.0.0.1:1/0"],
                         capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "priority='urgent' is not one of interactive, batch" in errors[0], run.stderr
    assert "s3cret" not in run.stdout + run.stderr and "Traceback" not in run.stderr

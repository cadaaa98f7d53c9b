"""Configuration: one table, read when asked (never at import), bad values named, overrides win."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rgpu import config
from rgpu.config import GiB, MiB, TABLE, parse_address
from rgpu.errors import AuthenticationError, ConfigError
from rgpu.transport import tokens

# a valid value for every variable, and what it parses to
SAMPLES = {
    "RGPU_SERVER": ("gpu-host:9000", "gpu-host:9000"),
    "RGPU_HOST": ("0.0.0.0", "0.0.0.0"),
    "RGPU_PORT": ("9999", 9999),
    "RGPU_TOKEN": ("secret", "secret"),
    "RGPU_TOKEN_FILE": ("/tmp/t", "/tmp/t"),
    "RGPU_TRANSPORT": ("shm", "shm"),
    "RGPU_SHM_SPIN_US": ("2000", 2000.0),
    "RGPU_TCP_SPIN_US": ("500", 500.0),
    "RGPU_TCP_STREAMS": ("4", 4),
    "RGPU_TLS": ("yes", True),
    "RGPU_TLS_CERT": ("/c.pem", "/c.pem"),
    "RGPU_TLS_KEY": ("/k.pem", "/k.pem"),
    "RGPU_TLS_CA": ("/ca.pem", "/ca.pem"),
    "RGPU_TLS_FINGERPRINT": ("AB:CD", "AB:CD"),
    "RGPU_DEVICE": ("cpu", "cpu"),
    "RGPU_DEVICES": ("3", 3),
    "RGPU_CUDA_DRIVER": ("fake", "fake"),
    "RGPU_CUDA_IMAGE_CACHE": ("1G", GiB),
    "RGPU_CUDA_QUEUE_BYTES": ("64K", 64 << 10),
    "RGPU_CUDA_QUEUE_FIRST_BYTES": ("8K", 8 << 10),
    "RGPU_CUDA_LIB_DIR": ("/opt/nvidia/lib", "/opt/nvidia/lib"),
    "RGPU_TF32": ("1", True),
    "RGPU_NATIVE": ("off", "off"),
    "RGPU_SIM_RTT_MS": ("2.5", 2.5),
    "RGPU_POST_BATCH_COUNT": ("64", 64),
    "RGPU_POST_BATCH_BYTES": ("1M", MiB),
    "RGPU_POST_COPY_BYTES": ("64k", 64 << 10),
    "RGPU_QUEUE_MAX_BYTES": ("1.5G", int(1.5 * GiB)),
    "RGPU_CONNECT_TIMEOUT": ("3", 3.0),
    "RGPU_COLLECTIVE_TIMEOUT": ("20", 20.0),
    "RGPU_PEER_TIMEOUT": ("30", 30.0),
    "RGPU_PEER_COPY": ("client", "client"),
    "RGPU_TIMEOUT": ("0.25", 0.25),
    "RGPU_MAX_FRAME": ("512MiB", 512 * MiB),
    "RGPU_MAX_META": ("1MB", MiB),
    "RGPU_MAX_BUFFERS": ("10", 10),
    "RGPU_MAX_SESSIONS": ("4", 4),
    "RGPU_SPARE_WORKERS": ("0", 0),
    "RGPU_AUTH_TIMEOUT": ("2.5", 2.5),
    "RGPU_MAX_UNAUTH": ("100", 100),
    "RGPU_MAX_UNAUTH_PER_SOURCE": ("8", 8),
    "RGPU_MAX_SESSION_BYTES": ("1G", 1 << 30),
    "RGPU_MAX_SESSIONS_PER_TOKEN": ("4", 4),
    "RGPU_MAX_FRAMES_IN_FLIGHT": ("1000", 1000),
    "RGPU_SESSION_GRACE": ("120", 120.0),
    "RGPU_REPLAY_BYTES": ("16M", 16 << 20),
    "RGPU_DEBUG": ("on", True),
    "RGPU_CUDA_WAIT_REPORT": ("1", True),
    "RGPU_CUDA_LIB_TRACE": ("yes", True),
    "RGPU_CUDA_LAZY_LIBRARIES": ("1", True),
    "RGPU_CUDA_LIB_RECORD": ("/tmp/lib-traces", "/tmp/lib-traces"),
}

BAD = {
    "RGPU_PORT": "ninety", "RGPU_TRANSPORT": "carrier-pigeon", "RGPU_TLS": "maybe", "RGPU_MAX_FRAME": "lots",
    "RGPU_QUEUE_MAX_BYTES": "-1", "RGPU_TIMEOUT": "soon", "RGPU_DEVICE": "tpu", "RGPU_DEVICES": "1.5",
}


def test_with_no_environment_every_setting_has_its_default():
    s = config.settings(environ={})
    for item in TABLE:
        assert getattr(s, item.field) == item.default, item.env


@pytest.mark.parametrize("item", TABLE, ids=lambda i: i.env)
def test_every_variable_in_the_table_is_read_and_parsed(item):
    if item.env not in SAMPLES:
        pytest.fail(f"{item.env} was added to the table without a sample here")
    raw, parsed = SAMPLES[item.env]
    assert getattr(config.settings(environ={item.env: raw}), item.field) == parsed


@pytest.mark.parametrize("env, raw", list(BAD.items()))
def test_a_bad_value_is_a_config_error_naming_the_variable(env, raw):
    with pytest.raises(ConfigError, match=f"^{env}="):
        config.settings(environ={env: raw})


def test_rgpu_native_off_turns_every_native_twin_off_and_auto_leaves_them_on():
    on, off = config.settings(environ={}), config.settings(environ={"RGPU_NATIVE": "off"})
    assert all(getattr(on, f) for f in config.TWINS) and not any(getattr(off, f) for f in config.TWINS)


@pytest.mark.parametrize("field, env", list(config.TWINS.items()))
def test_each_twins_old_switch_still_works_for_a_release_with_a_warning(field, env, monkeypatch):
    monkeypatch.setattr(config, "_warned", set())
    with pytest.warns(FutureWarning, match=f"{env} is deprecated"):
        assert getattr(config.settings(environ={env: "0"}), field) is False
    assert getattr(config.settings(environ={env: "1", "RGPU_NATIVE": "off"}), field) is False
    with pytest.raises(ConfigError, match=f"^{env}="):
        config.settings(environ={env: "maybe"})


def test_keyword_overrides_win_over_the_environment_and_none_is_no_override():
    s = config.settings(environ={"RGPU_PORT": "1000", "RGPU_HOST": "h"}, port=2000, host=None)
    assert (s.port, s.host) == (2000, "h")
    assert s.with_(port=3000).port == 3000 and s.port == 2000


def test_settings_are_read_when_asked_not_at_import(monkeypatch):
    monkeypatch.setenv("RGPU_PORT", "1234")
    assert config.settings().port == 1234
    monkeypatch.setenv("RGPU_PORT", "4321")
    assert config.settings().port == 4321


def test_importing_rgpu_reads_no_environment():
    code = ("import rgpu, rgpu.config, rgpu.cli, rgpu.transport.client, rgpu.transport.connection, "
            "rgpu.server.serve, rgpu.server.worker; print('ok')")
    env = {**os.environ, "RGPU_PORT": "not-a-port", "RGPU_TRANSPORT": "nope", "RGPU_MAX_FRAME": "x"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("text, size", [("0", 0), ("4096", 4096), ("4k", 4096), ("4K", 4096), ("4KB", 4096),
                                        ("4KiB", 4096), ("2m", 2 * MiB), ("1.5G", int(1.5 * GiB)), (" 8M ", 8 * MiB)])
def test_sizes_take_binary_suffixes(text, size):
    assert config._size(text) == size


@pytest.mark.parametrize("text", ["", "M", "-1", "1T", "abc"])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(ValueError):
        config._size(text)


@pytest.mark.parametrize("text, address", [("gpu:9000", ("gpu", 9000)), ("gpu", ("gpu", 9713)),
                                           ("[::1]:9000", ("::1", 9000)), (":9000", ("127.0.0.1", 9000)),
                                           ("10.0.0.2:1", ("10.0.0.2", 1))])
def test_a_server_address_is_host_and_port_with_defaults(text, address):
    assert parse_address(text) == address


def test_a_server_address_with_a_bad_port_is_a_config_error():
    with pytest.raises(ConfigError, match="RGPU_SERVER"):
        config.settings(environ={"RGPU_SERVER": "gpu:http"}).server_address()


def test_the_token_variable_wins_over_the_token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("from-file\n")
    assert tokens.read_token(config.settings(environ={"RGPU_TOKEN_FILE": str(path)})) == b"from-file"
    assert tokens.read_token(config.settings(environ={"RGPU_TOKEN_FILE": str(path), "RGPU_TOKEN": "env"})) == b"env"


def test_no_token_anywhere_says_how_to_get_one(tmp_path):
    with pytest.raises(AuthenticationError, match="set RGPU_TOKEN or RGPU_TOKEN_FILE"):
        tokens.read_token(config.settings(environ={"RGPU_TOKEN_FILE": str(tmp_path / "missing")}))


def test_the_server_creates_the_token_file_once_with_mode_0600(tmp_path):
    s = config.settings(environ={"RGPU_TOKEN_FILE": str(tmp_path / "sub" / "token")})
    token, path, created = tokens.ensure_token(s)
    assert created and oct(path.stat().st_mode & 0o777) == "0o600" and path.read_text().strip().encode() == token
    assert tokens.ensure_token(s) == (token, path, False)


def test_every_variable_has_a_row_in_the_readme_table_or_in_docs_config_md_never_both():
    readme, docs = config.markdown_table(), config.docs_page()
    for item in TABLE:
        assert (f"| `{item.env}` |" in readme) != (f"| `{item.env}` |" in docs), item.env
        assert item.group == "user" or item.why, f"{item.env}: docs/config.md says why one would change it"


def test_the_readme_table_holds_what_a_user_sets_and_fits_on_one_screen():
    rows = config.markdown_table().splitlines()[2:]
    assert 12 <= len(rows) <= 20
    assert {s.group for s in TABLE} <= {"user", *config.GROUPS}


def test_settings_is_derived_from_the_table_field_by_field():
    from dataclasses import fields
    assert [f.name for f in fields(config.Settings)] == [s.field for s in TABLE] + list(config.TWINS)


def test_rgpu_config_prints_every_variable_and_its_value():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    out = subprocess.run([sys.executable, "-m", "rgpu", "config"], capture_output=True, text=True,
                         env={**env, "RGPU_PORT": "4444"}, check=True).stdout
    assert "RGPU_PORT                4444" in out
    assert all(item.env in out for item in TABLE)


def test_rgpu_config_says_whether_the_token_is_set_and_where_from_never_what_it_is(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    token_file = tmp_path / "token"
    out = subprocess.run([sys.executable, "-m", "rgpu", "config"], capture_output=True, text=True, check=True,
                         env={**env, "RGPU_TOKEN": "s3cret-value-42", "RGPU_TOKEN_FILE": str(token_file)}).stdout
    assert "s3cret-value-42" not in out
    assert "RGPU_TOKEN               set (from RGPU_TOKEN; not shown)" in out
    out = subprocess.run([sys.executable, "-m", "rgpu", "config"], capture_output=True, text=True, check=True,
                         env={**env, "RGPU_TOKEN_FILE": str(token_file)}).stdout
    assert f"RGPU_TOKEN               unset (the token comes from the token file {token_file}, absent)" in out

"""The broker's credentials: where the password comes from, URLs that hold one refused, the URL clients connect
with."""

from __future__ import annotations

import pytest
import redis

from dflash_queue.config import BROKER_URL_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV, load_config
from dflash_queue.errors import ConfigError


def test_the_password_comes_from_the_environment_then_a_file(write, tmp_path):
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "broker.password").write_text("from-config-file\n")
    (tmp_path / "env.password").write_text("from-env-file\r\n")
    # A relative password_file resolves against the config file, like other paths.
    broker = load_config(write({"url": "redis://h:6379/0", "password_file": "secrets/broker.password"}), env={}).broker
    assert broker.password_file == str(tmp_path / "secrets" / "broker.password")
    assert broker.password({}) == "from-config-file"
    assert broker.password({PASSWORD_FILE_ENV: str(tmp_path / "env.password")}) == "from-env-file"
    assert broker.password({PASSWORD_ENV: "direct", PASSWORD_FILE_ENV: str(tmp_path / "env.password")}) == "direct"
    assert broker.connection_url({}) == "redis://:from-config-file@h:6379/0"
    # The file is read when connecting: a password changed on disk is used by the next connection.
    (tmp_path / "secrets" / "broker.password").write_text("rotated")
    assert broker.password({}) == "rotated"


def test_no_password_leaves_the_url_as_it_is(write):
    broker = load_config(write({"url": "redis://h:6379/0"}), env={}).broker
    assert broker.password({}) is None
    assert broker.connection_url({}) == "redis://h:6379/0"
    assert load_config(write({}), env={}).broker.connection_url({PASSWORD_ENV: "x"}) == ""


def test_the_connection_url_percent_encodes_user_and_password(write):
    broker = load_config(write({"url": "rediss://broker.internal:6380/2", "username": "dfq worker"}), env={}).broker
    password = "p@ss:w/rd#?%"
    url = broker.connection_url({PASSWORD_ENV: password})
    assert url == "rediss://dfq%20worker:p%40ss%3Aw%2Frd%23%3F%25@broker.internal:6380/2"
    parsed = redis.connection.parse_url(url)
    assert (parsed["username"], parsed["password"], parsed["host"], parsed["port"], parsed["db"]) == \
        ("dfq worker", password, "broker.internal", 6380, 2)
    assert broker.url == "rediss://broker.internal:6380/2"  # what is shown holds neither


def test_a_missing_or_empty_password_file_names_the_file_and_the_key(write, tmp_path):
    broker = load_config(write({"url": "redis://h/0", "password_file": "nowhere"}), env={}).broker
    with pytest.raises(ConfigError, match=r"broker\.password_file: cannot read .*nowhere"):
        broker.connection_url({})
    with pytest.raises(ConfigError, match=rf"{PASSWORD_FILE_ENV}: cannot read .*elsewhere"):
        broker.password({PASSWORD_FILE_ENV: str(tmp_path / "elsewhere")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match=rf"{PASSWORD_FILE_ENV}: the broker password file .*empty is empty"):
        broker.password({PASSWORD_FILE_ENV: str(tmp_path / "empty")})


@pytest.mark.parametrize("url", ["redis://:s3cr3t-pw@h:6379/0", "redis://worker:s3cr3t-pw@h/0"])
def test_a_url_with_a_password_is_refused(write, url):
    path = write({"url": url})
    with pytest.raises(ConfigError) as refused:
        load_config(path, env={})
    message = str(refused.value)
    assert str(path) in message and "broker.url: " in message
    assert PASSWORD_ENV in message and "broker.password_file" in message
    assert "s3cr3t-pw" not in message
    # From the environment too, without showing it.
    with pytest.raises(ConfigError) as refused:
        load_config(write({}), env={BROKER_URL_ENV: url})
    assert "broker.url: " in str(refused.value) and "s3cr3t-pw" not in str(refused.value)


def test_a_user_in_the_url_or_a_password_key_is_refused(write):
    with pytest.raises(ConfigError, match=r"broker\.url: .*broker\.username"):
        load_config(write({"url": "redis://worker@h/0"}), env={})
    with pytest.raises(ConfigError, match=rf"broker\.password: .*never read from the config file.*{PASSWORD_ENV}"):
        load_config(write({"url": "redis://h/0", "password": "s3cr3t"}), env={})
